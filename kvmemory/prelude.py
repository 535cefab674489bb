"""The words around grafted blocks: a prompt layout, the prelude every deposit segment is computed
behind (and every window starts with), and the scope a Documents sees (the shared documents, or one
chat user's namespace)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmemory import prompts
from kvmemory.store.layout import INDEX_DIR
from kvmemory.text import text_ids


@dataclass(frozen=True)
class PromptLayout:
    """The words around the excerpts. For a 135M model they matter: measured with
    benchmarks/bench_prompt.py (the model given the gold passage as text, fresh draws)."""

    system: str = "Answer the question using the document excerpts. Be brief."
    intro: str = "Document excerpts:\n"
    question: str = "\n\nQuestion: {q}"
    answer_prefix: str = ""


USER_DOCS = "user:"                 # doc ids of chat memory: user:<hash of the user>:... (kvmemory/chat_memory)


@dataclass(frozen=True)
class Scope:
    """Which documents one Documents sees and where its indexes live: the store's shared documents
    (every doc id outside a user namespace, indexes in STORE/index/), or one user's namespace (doc
    ids under `prefix`, indexes of its own, a prelude of its own so that its blocks are its alone)."""

    prefix: str = ""                    # doc ids this scope owns start with it ("": the shared scope)
    index_dir: str = INDEX_DIR          # relative to the store's local directory
    layout: PromptLayout = PromptLayout()
    label: str = "kvmemory:prelude"     # the prelude state's label
    head: str | None = None             # the prelude's text as given (instead of one built from layout)
    owner: str | None = None            # whose blocks and index files these are (a chat user's key): their
                                        # chains are salted by it, an encrypted store seals them by its key

    def owns(self, doc_id: str) -> bool:
        return doc_id.startswith(self.prefix) if self.prefix else not doc_id.startswith(USER_DOCS)


class Prelude:
    """The fixed text before every segment and, at ask time, before the selected blocks, plus
    the text after them that asks the question. Built from the chat template when there is one."""

    MARK = "\u0000KVMEMORY-EXCERPTS\u0000"

    def __init__(self, tokenizer, layout: PromptLayout = PromptLayout(), head: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.layout = layout
        if head is not None:
            self.head, self.tail = head, layout.question + "\nAnswer:"
        elif getattr(tokenizer, "chat_template", None):
            self.head, self.tail = prompts.split_at(tokenizer, layout.system,
                                                    layout.intro + self.MARK + layout.question, self.MARK)
        else:
            self.head, self.tail = layout.intro, layout.question + "\nAnswer:"
        self.ids = tokenizer(self.head, add_special_tokens=False)["input_ids"]
        before, after = self.tail.split("{q}")
        # the template's own control tokens are tokens; the question's text stays text
        self._before = tokenizer(before.rstrip(" "), add_special_tokens=False)["input_ids"]
        self._after = tokenizer(after + layout.answer_prefix, add_special_tokens=False)["input_ids"]

    def question_ids(self, question: str) -> list[int]:
        """The tokens after the excerpts: the question (as text) and the opening of the answer."""
        return self._before + text_ids(self.tokenizer, " " + question.strip()) + self._after

    def question_span(self, q_ids: list[int]) -> tuple[int, int]:
        """Where the question's own words lie in question_ids(...): [start, stop)."""
        return len(self._before), len(q_ids) - len(self._after)
