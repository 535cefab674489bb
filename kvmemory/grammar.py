"""Structured output by constrained decoding (llguidance): a pick(logits) that only lets the model
choose tokens the grammar allows next, and ends the answer when the grammar is complete.

    grammar = Grammars(tokenizer, vocab)                 # the tokenizer converted once (~1 s)
    pick = grammar.constrain(pick, json_schema)          # any pick: greedy, a Sampler, Logprobs inside it

It works token by token inside the decode loop, so a constrained request decodes in the same batch
as the others (kvmemory.batching)."""

from __future__ import annotations

import json

import torch

from kvmemory.errors import InputError, MissingDependencyError


class Constrained:
    """pick(logits) within a grammar: the logits of every token it does not allow next are -inf before
    `pick` sees them; each token picked is consumed by the matcher; once the grammar cannot go on, the
    end-of-turn token is picked (the answer ends there, whole)."""

    def __init__(self, pick, matcher, eos: int, vocab: int) -> None:
        import llguidance.torch as lt
        self.pick, self.matcher, self.eos, self.lt = pick, matcher, eos, lt
        self.mask = lt.allocate_token_bitmask(1, vocab)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.matcher.is_stopped():
            return self.eos
        self.lt.fill_next_token_bitmask(self.matcher, self.mask, 0)
        x = logits.float().cpu().clone()[None]                   # [1, vocab]
        self.lt.apply_token_bitmask_inplace(x, self.mask)
        tok = self.pick(x[0])
        if not self.matcher.consume_token(tok):
            raise RuntimeError(f"the grammar refused token {tok}: {self.matcher.get_error()}")
        return tok


class Grammars:
    """The grammars of one tokenizer: JSON schemas compiled into matchers."""

    def __init__(self, tokenizer, vocab: int) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise MissingDependencyError("structured output needs llguidance: pip install llguidance") from None
        self.llg = llguidance
        self.eos = tokenizer.eos_token_id
        self.vocab = vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def matcher(self, schema: dict):
        """A matcher of `schema` (JSON Schema; {"type": "object"} for any JSON object), compact JSON (no
        free whitespace between tokens); InputError naming what the schema gets wrong."""
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                  overrides={"whitespace_flexible": False})
            m = self.llg.LLMatcher(self.tokenizer, grammar)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InputError(f"the JSON schema cannot be used: {e}") from None
        if m.is_error():
            raise InputError(f"the JSON schema cannot be used: {m.get_error()}")
        return m

    def constrain(self, pick, schema: dict) -> Constrained:
        return Constrained(pick or (lambda x: int(x.argmax())), self.matcher(schema), self.eos, self.vocab)
