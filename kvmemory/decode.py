"""Decoding in one place: the decode loop (Memory.generate, ask, solve, the server's chat, the
integrations, the benchmarks), the sampler, and the text stream that turns decoded tokens into
text deltas safe to send (stop strings, unfinished UTF-8 characters)."""

from __future__ import annotations

import torch

from kvmemory.device import ids_tensor


@torch.inference_mode()
def greedy(model, cache, logits: torch.Tensor | None, max_new_tokens: int, eos: set[int], on_token=None,
           pick=None, feed: int | list[int] | None = None, first: list | None = None) -> list[int]:
    """Tokens after `logits` (of the last token already in `cache`), extending cache in place.
    logits None: `feed`, the prompt's last token (or its last tokens, a list), is not in the cache
    yet; its forward is the decoding's first (alone: the model's own forward of those tokens, as a
    caller would run it, kv.last_logits for a list; in a batcher: rows of a batched step, so a
    request's last prompt tokens share the pass that streams the weights with the others' decode
    steps).

    pick(logits) -> token id chooses each token (default: argmax, greedy). Stops at an eos id
    (not included), after max_new_tokens, or when on_token(new_ids), called after each token (for
    streaming), returns True; no forward pass for a token it would not use.

    first: a list that gets the logits the first token is picked from (with a feed, computed here).

    On a thread that serves through a kvmemory.batching.Batcher of this model, the sequence decodes
    in the batcher's shared loop (continuous batching) under the same rules."""
    from kvmemory import batching
    b = batching.current()
    if logits is None and feed is None:
        raise ValueError("greedy() needs the logits of the prompt's last token or that token (feed)")
    if b is not None and b.model is model:
        return b.decode(cache, logits, max_new_tokens, eos, on_token, pick, feed, first)
    if logits is None and isinstance(feed, list):
        from kvmemory.kv import last_logits
        logits = last_logits(model, ids_tensor(feed, model), cache)
    elif logits is None:
        logits = model(input_ids=ids_tensor([feed], model), past_key_values=cache, use_cache=True).logits[0, -1]
    pick = pick or (lambda x: int(x.argmax()))
    new: list[int] = []
    if first is not None:
        first.append(logits)
    nxt = pick(logits)
    while nxt not in eos and len(new) < max_new_tokens:
        new.append(nxt)
        if on_token is not None and on_token(new):
            break
        if len(new) == max_new_tokens:
            break
        out = model(input_ids=ids_tensor([nxt], model), past_key_values=cache, use_cache=True)
        nxt = pick(out.logits[0, -1])
    return new


def tempered(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(x / T) of float32 logits [vocab], T > 0. A temperature so small that x / T overflows (a
    subnormal one, 5e-324, is a valid request) gives its limit instead of NaN: the mass shared by the
    tokens of the largest logit (what softmax(x / T) rounds to there for every T small enough)."""
    probs = torch.softmax(x / temperature, dim=-1)
    if bool(torch.isfinite(probs).all()):
        return probs
    top = (x == x.max()).float()
    return top / top.sum()


def nucleus(probs: torch.Tensor, top_p: float, of_mass: bool = False) -> torch.Tensor:
    """probs [vocab] with only the top_p nucleus kept (the others 0, not renormalized): the likeliest tokens
    whose mass before them is under top_p (of_mass: under top_p x the mass of probs, for probs already cut by
    top_k or min_p). The most likely token is always kept: a top_p under float32's least (5e-324) rounds
    to 0 and would keep none."""
    p, idx = probs.sort(descending=True)
    keep = p.cumsum(0) - p < (top_p * p.sum() if of_mass else top_p)
    keep[0] = True
    return torch.zeros_like(probs).scatter(0, idx[keep], p[keep])


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0, gen: torch.Generator | None = None) -> int:
    """One token of logits [vocab]: argmax at temperature 0; otherwise drawn from softmax(logits / T)
    restricted to the top_p nucleus (the most likely token is always kept), with `gen` (CPU) if given."""
    if temperature == 0:
        return int(logits.argmax())
    probs = tempered(logits.float().cpu(), temperature)
    if top_p < 1.0:
        probs = nucleus(probs, top_p)
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def sampler(temperature: float, top_p: float = 1.0, seed: int | None = None, *, top_k: int = 0,
            min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
            frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None, prompt=()):
    """pick(logits) for greedy(): `sample` with its own generator (seeded: reproducible draws). With
    any of the other keys set (the OpenAI and vLLM sampling parameters) a Sampler; at their neutral
    values the draws are exactly `sample`'s."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    if (top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty) == (0, 0.0, 1.0, 0.0, 0.0) \
            and not logit_bias:
        return lambda logits: sample(logits, temperature, top_p, gen)
    return Sampler(temperature, top_p, gen, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
                   logit_bias or {}, prompt)


class Sampler:
    """pick(logits) with the sampling parameters clients send, in vLLM's order: logit_bias added;
    repetition_penalty over the prompt's and the answer's tokens (a positive logit divided by it, a
    negative one multiplied); presence_penalty (once a token appeared) and frequency_penalty (per
    time it appeared) subtracted over the answer's tokens; then temperature (0: argmax of the
    adjusted logits), top_k, min_p (tokens under min_p x the most likely one's probability dropped)
    and top_p; a draw with the generator. It remembers the tokens it picked: the answer so far."""

    def __init__(self, temperature: float, top_p: float, gen, top_k: int, min_p: float, repetition_penalty: float,
                 presence_penalty: float, frequency_penalty: float, logit_bias: dict[int, float], prompt) -> None:
        self.temperature, self.top_p, self.gen, self.top_k, self.min_p = temperature, top_p, gen, top_k, min_p
        self.repetition, self.presence, self.frequency = repetition_penalty, presence_penalty, frequency_penalty
        self.bias = (torch.tensor(list(logit_bias), dtype=torch.long),
                     torch.tensor(list(logit_bias.values()), dtype=torch.float32)) if logit_bias else None
        self.prompt = set(int(t) for t in prompt)
        self.counts: dict[int, int] = {}

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [vocab] after the bias and the penalties (float32, on the CPU, a copy)."""
        x = logits.float().cpu().clone()
        if self.bias is not None:
            x[self.bias[0]] += self.bias[1]
        if self.repetition != 1.0:
            seen = torch.tensor(sorted(self.prompt | set(self.counts)), dtype=torch.long)
            if len(seen):
                v = x[seen]
                x[seen] = torch.where(v > 0, v / self.repetition, v * self.repetition)
        if self.counts and (self.presence or self.frequency):
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            n = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            x[ids] -= self.presence + self.frequency * n
        return x

    def __call__(self, logits: torch.Tensor) -> int:
        x = self.adjust(logits)
        if self.temperature == 0:
            tok = int(x.argmax())
        else:
            probs = tempered(x, self.temperature)
            if 0 < self.top_k < len(probs):
                probs[probs < probs.topk(self.top_k).values[-1]] = 0
            if self.min_p > 0:
                probs[probs < self.min_p * probs.max()] = 0
            if self.top_p < 1.0:
                probs = nucleus(probs, self.top_p, of_mass=True)
            tok = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok


class Logprobs:
    """A pick(logits) that records, for every token it picks, the token's log-probability under the
    model's distribution (log_softmax of the raw logits, in float32) and the `top` likeliest tokens'
    (OpenAI's logprobs / top_logprobs). The picking itself is `pick`'s: the tokens do not change."""

    def __init__(self, pick, top: int = 0) -> None:
        self.pick, self.top = pick or (lambda x: int(x.argmax())), top
        self.rows: list[tuple[int, float, list[tuple[int, float]]]] = []

    def __call__(self, logits: torch.Tensor) -> int:
        lp = torch.log_softmax(logits.float().cpu(), dim=-1)
        tok = self.pick(logits)
        alts = []
        if self.top:
            v, i = lp.topk(self.top)
            alts = [(int(a), float(b)) for a, b in zip(i, v)]
        self.rows.append((tok, float(lp[tok]), alts))
        return tok

    def content(self, tokenizer, n: int) -> list[dict]:
        """OpenAI's logprobs.content of the first n tokens picked (the answer's: an end-of-turn pick is not one)."""
        def one(t: int, lp: float) -> dict:
            text = tokenizer.decode([t])
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return [{**one(t, lp), "top_logprobs": [one(a, b) for a, b in alts]} for t, lp, alts in self.rows[:n]]


class TextStream:
    """The on_token callback of greedy() for text: decodes the tokens so far and hands
    on_text(delta) only text that will not change: an unfinished UTF-8 character (U+FFFD at the
    end) and a tail that may be the start of a stop string are held back. At a stop string the
    text ends before it (self.stopped); on_text returning True halts the decoding (self.halted:
    a consumer that went away). strip=True streams the answer as ask returns it (.strip()).
    After decoding, finish(ids) sends what is left and returns the whole text."""

    def __init__(self, tokenizer, stops=(), on_text=None, strip: bool = False) -> None:
        self.tokenizer, self.on_text, self.strip = tokenizer, on_text, strip
        self.stops = [s for s in stops if s]
        self.text, self.sent = "", 0
        self.stopped = self.halted = False

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text.strip() if self.strip else text

    def __call__(self, ids: list[int]) -> bool:
        text = self._decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text
        safe = len(text)
        if not self.stopped:
            while safe and text[safe - 1] == "\ufffd":
                safe -= 1
            safe -= max((k for s in self.stops for k in range(1, len(s)) if text[:safe].endswith(s[:k])), default=0)
        self._send(safe)
        return self.stopped or self.halted

    def _send(self, upto: int) -> None:
        if self.on_text is None or upto <= self.sent or self.halted:
            return
        if self.on_text(self.text[self.sent:upto]):
            self.halted = True
        self.sent = upto

    def finish(self, ids: list[int]) -> str:
        """The whole text of `ids` (cut at a stop string), its unsent rest sent."""
        if not self.stopped:
            self.text = self._decode(ids)
        self._send(len(self.text))
        return self.text


def eos_ids(tokenizer, model) -> set[int]:
    """Token ids that end an answer: the tokenizer's and the generation config's eos."""
    ids = set()
    for v in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
