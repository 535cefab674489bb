"""Every chat-template prompt kvmemory builds, in one place: a conversation's token ids, a system
prompt's text, the text one turn adds after a system message, and a template cut around a mark
(the documents' prelude). Pure functions of a tokenizer."""

from __future__ import annotations

from kvmemory.errors import InputError

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


def split_at(tokenizer, system: str, user: str, mark: str) -> tuple[str, str]:
    """The chat-template text of [system, user] with the assistant's opening, cut at `mark` (which
    `user` holds once): (text before it, text after it)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail
