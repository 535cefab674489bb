"""Every chat-template prompt kvmemory builds, in one place: a conversation's token ids, a system
prompt's text, the text one turn adds after a system message, and a template cut around a mark
(the documents' prelude). Pure functions of a tokenizer."""

from __future__ import annotations

from kvmemory.errors import InputError
from kvmemory.text import text_ids

ROLES = ("system", "user", "assistant")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}], roles system/user/assistant) in the
    model's chat template, ending with the assistant's opening."""
    if not messages:
        raise InputError("no messages")
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InputError(f"a message needs a role of system/user/assistant and str content, got {m!r}")
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


def system_text(tokenizer, text: str) -> str:
    """The chat-template text of a system prompt alone."""
    return tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)


def turn_text(tokenizer, user: str, assistant: str | None = None, system: str = "x") -> str:
    """The text one exchange adds after the system prompt `system`: the user turn and the
    assistant's opening, or with `assistant` the assistant's whole turn and its end."""
    head = system_text(tokenizer, system)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if assistant is None:
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": assistant}], tokenize=False)
    if not full.startswith(head):
        raise InputError("the chat template does not extend the system prompt; cannot build a turn after it")
    return full[len(head):]


def system_around(tokenizer, content: str, mark: str) -> tuple[str, str]:
    """The chat-template text of a system message alone, cut at `mark` (which `content` holds once):
    (the message's opening and content before the mark, the rest of it)."""
    head, tail = system_text(tokenizer, content).split(mark)
    return head, tail


def first_opening(tokenizer, mark: str) -> str:
    """The chat-template text before a conversation's first user message (no system message given: the
    template's own default, if it has one) and the message's opening: what a new conversation's first
    message follows. `mark` stands for the message's content (it must come out once, as it is)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True)
    if text.count(mark) != 1:
        raise InputError("the chat template does not render a user message's content as it is")
    return text.split(mark)[0]


def split_at(tokenizer, system: str, user: str, mark: str) -> tuple[str, str]:
    """The chat-template text of [system, user] with the assistant's opening, cut at `mark` (which
    `user` holds once): (text before it, text after it)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def message_ids(tokenizer, messages: list[dict], system: str = "x") -> tuple[list[int], list[tuple[int, int]]]:
    """The token ids `messages` add after the system prompt `system` in the chat template (no assistant
    opening after them), and each message's content span in them. The template's own tokens are
    parsed (its control tokens are control tokens); the contents are tokenized as text, so a content
    that spells `<|im_end|>` cannot close its message."""
    marks = [f"\u0000kvmemory-Content-{i}\u0000" for i in range(len(messages))]
    head = system_text(tokenizer, system)
    full = tokenizer.apply_chat_template([{"role": "system", "content": system}]
                                         + [{"role": m["role"], "content": k} for m, k in zip(messages, marks)],
                                         tokenize=False)
    if not full.startswith(head):
        raise InputError("the chat template does not extend the system prompt; cannot build messages after it")
    rest = full[len(head):]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for m, k in zip(messages, marks):
        if rest.count(k) != 1:
            raise InputError("the chat template does not render a message's content as it is")
        before, rest = rest.split(k)
        ids += tokenizer(before, add_special_tokens=False)["input_ids"] if before else []
        words = text_ids(tokenizer, m["content"])
        spans.append((len(ids), len(ids) + len(words)))
        ids += words
    ids += tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
    return ids, spans
