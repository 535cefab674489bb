"""Text in, token ids out: what a document, a question or an id may be (typed errors naming the
problem), and how text becomes tokens without control tokens sneaking in."""

from __future__ import annotations

import unicodedata
from pathlib import Path

from kvmemory.errors import InputError


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of document or question text. Control-token spellings in it (`<|im_end|>`) stay
    text: a document must not be able to close the turn it is quoted in."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def decode_text(text, source: str = "") -> str:
    """A document's text: str, or bytes that must be UTF-8; not empty, not binary."""
    what = source or "document"
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not UTF-8 text (byte 0x{text[e.start]:02x} at offset {e.start})") from None
    if not isinstance(text, str):
        raise InputError(f"{what} must be text (str) or UTF-8 bytes, got {type(text).__name__}"
                         " (files go through add_files)")
    if not text.strip():
        raise InputError(f"{what} is empty")
    if "\x00" in text:
        raise InputError(f"{what} contains NUL bytes: it looks binary, not text")
    return text


def read_files(paths) -> tuple[list[Path], list[str]]:
    """Check and read document files before anything is written: names (the doc ids) unique and
    valid, every file readable UTF-8 text. Returns (paths, texts); InputError naming the problem."""
    paths = [Path(p) for p in paths]
    names = [p.name for p in paths]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        where = "; ".join(f"{n}: " + ", ".join(str(p) for p in paths if p.name == n) for n in dupes)
        raise InputError(f"two files share a name ({where}); doc ids come from file names, rename one")
    texts = []
    for p in paths:
        check_doc_id(p.name)
        try:
            texts.append(decode_text(p.read_bytes(), str(p)))
        except OSError as e:
            raise InputError(f"cannot read {p}: {e.strerror}") from None
    return paths, texts


def valid_id(value) -> bool:
    """An id (document, session) is printable text: no control characters (a terminal escape, a
    tab, a newline would corrupt `kvmemory docs` output and logs), 1 to 200 characters."""
    return isinstance(value, str) and 0 < len(value) <= 200 and \
        not any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in value)


def check_doc_id(doc_id: str) -> None:
    """InputError unless doc_id is a valid document id."""
    if not valid_id(doc_id):
        raise InputError(f"a document id is a non-empty string of at most 200 characters without control "
                         f"characters, got {doc_id!r}")
