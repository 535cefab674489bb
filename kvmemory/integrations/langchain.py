"""LangChain adapters: kvmemory as a retriever, as a question-answering Runnable that answers
from grafted KV (no re-prefill of retrieved text), and the default model and embedder as
LangChain components for offline text-RAG pipelines.

    pip install 'kvmemory[langchain]'

    from kvmemory.integrations.langchain import KVMemoryRetriever, KVMemoryQA
    retriever = KVMemoryRetriever(memory=mem, k=4)        # a BaseRetriever: Documents with metadata
    qa = KVMemoryQA(memory=mem)                           # a Runnable: question -> answer + sources
    qa.invoke("When was the bridge closed?")              # {"answer", "sources", "stats"}

Every call goes through Memory.retrieve / Memory.ask, so selection, exactness and the errors are
the library's own (kvmemory.KVMemoryError subclasses).
"""

from __future__ import annotations

from kvmemory.integrations import require

require(["langchain_core"], "langchain", "kvmemory.integrations.langchain")

from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.language_models.chat_models import BaseChatModel  # noqa: E402
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage  # noqa: E402
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.runnables import RunnableConfig, RunnableSerializable  # noqa: E402
from langchain_core.runnables.config import run_in_executor  # noqa: E402
from langchain_core.runnables.utils import AddableDict  # noqa: E402
from pydantic import ConfigDict, Field  # noqa: E402

from kvmemory.errors import InputError  # noqa: E402
from kvmemory.index.embedder import shared_embedder  # noqa: E402
from kvmemory.integrations._common import chat_complete, doc_source, question_of, stream_call  # noqa: E402
from kvmemory.memory import Memory  # noqa: E402

__all__ = ["KVMemoryChatModel", "KVMemoryQA", "KVMemoryRetriever", "MiniLMEmbeddings", "to_document"]


def to_document(mem: Memory, hit: dict, selector: str | None = None) -> Document:
    """A LangChain Document of one passage (a Memory.retrieve hit, or a passage of an answer)."""
    meta = {"doc_id": hit["doc_id"], "start_token": hit["start_token"], "end_token": hit["end_token"],
            "score": float(hit["score"]), "source": doc_source(mem, hit["doc_id"]) or hit["doc_id"]}
    if selector is not None:
        meta["selector"] = selector
    return Document(page_content=hit["text"], metadata=meta,
                    id=f"{hit['doc_id']}:{hit['start_token']}-{hit['end_token']}")


class KVMemoryRetriever(BaseRetriever):
    """The blocks Memory.ask would select for a query, as Documents, best first.

    metadata: doc_id, start_token, end_token (the block's token span in its document), score (the
    selector's, higher is better), source (the file it came from, else the doc id), selector.
    k and selector can be overridden per call: retriever.invoke(q, k=2)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory
    k: int = Field(default=4, ge=1)
    selector: str = "text"
    doc_filter: Callable[[str], bool] | None = None

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, selector: str | None = None) -> list[Document]:
        return self._search(query, k, selector)

    async def _aget_relevant_documents(self, query: str, *, run_manager, k: int | None = None,
                                       selector: str | None = None) -> list[Document]:
        return await run_in_executor(None, self._search, query, k, selector)

    def _search(self, query: str, k: int | None, selector: str | None) -> list[Document]:
        sel = selector or self.selector
        hits = self.memory.retrieve(query, k=self.k if k is None else k, selector=sel, doc_filter=self.doc_filter)
        return [to_document(self.memory, h, sel) for h in hits]


class KVMemoryQA(RunnableSerializable[Any, dict]):
    """Answers a question with Memory.ask: the selected blocks' stored KV is grafted, only the
    question is prefilled. Input: a str, or a dict with "question" (or "query"/"input").
    Output: {"answer": str, "sources": [Document], "stats": dict} (stats as Answer.stats:
    tokens_restored, tokens_prefilled, timings_s["ttft"], ...).

    stream() yields AddableDict chunks ({"answer": delta} ..., then {"sources", "stats"}); adding
    them up gives invoke()'s output."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory
    top_k: int | None = Field(default=None, ge=1)
    selector: str = "text"
    max_new_tokens: int = Field(default=48, ge=1)
    recompute: float | None = Field(default=None, ge=0.0, le=1.0)
    min_relevance: float | None = Field(default=None, ge=0.0, le=1.0)
    doc_filter: Callable[[str], bool] | None = None

    def _answer(self, question: str, on_text=None) -> dict:
        ans = self.memory.ask(question, top_k=self.top_k, selector=self.selector, max_new_tokens=self.max_new_tokens,
                              recompute=self.recompute, min_relevance=self.min_relevance, on_token=on_text,
                              doc_filter=self.doc_filter)
        stats = {k: v for k, v in ans.stats.items() if k != "ranking"}
        return {"answer": ans.text, "sources": [to_document(self.memory, p) for p in self.memory.passages(ans)],
                "stats": stats}

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        if kwargs:
            raise InputError(f"KVMemoryQA.invoke takes no extra arguments, got {sorted(kwargs)}")
        return self._call_with_config(lambda x: self._answer(question_of(x)), input, config, run_type="chain")

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        return await run_in_executor(config, self.invoke, input, config, **kwargs)

    def _chunks(self, inputs: Iterator[Any]) -> Iterator[AddableDict]:
        question = None
        for x in inputs:
            question = question_of(x)
        if question is None:
            raise InputError("no input")
        for kind, v in stream_call(lambda on_text: self._answer(question, on_text)):
            if kind == "delta":
                yield AddableDict(answer=v)
            else:
                yield AddableDict(sources=v["sources"], stats=v["stats"])

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[AddableDict]:
        if kwargs:
            raise InputError(f"KVMemoryQA.stream takes no extra arguments, got {sorted(kwargs)}")
        yield from self._transform_stream_with_config(iter([input]), self._chunks, config)

    async def astream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any):
        it = self.stream(input, config, **kwargs)
        done = object()
        while (chunk := await run_in_executor(None, next, it, done)) is not done:
            yield chunk


def _messages(messages: list[BaseMessage]) -> list[dict]:
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    out = []
    for m in messages:
        if m.type not in roles:
            raise InputError(f"{type(m).__name__} messages are not supported (system, human and ai are)")
        out.append({"role": roles[m.type], "content": m.text})
    return out


class KVMemoryChatModel(BaseChatModel):
    """The Memory's model (the default SmolLM2-135M-Instruct) as a LangChain chat model: the
    conversation is prefilled in full and answered greedily, offline. It is the text baseline a
    LangChain RAG app would use; KVMemoryQA answers the same question from grafted KV instead."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory
    max_new_tokens: int = Field(default=256, ge=1)

    @property
    def _llm_type(self) -> str:
        return "kvmemory-local"

    @property
    def _identifying_params(self) -> dict:
        return {"model_name": self.memory.model_name, "max_new_tokens": self.max_new_tokens}

    def _message(self, text: str, stats: dict, chunk: bool = False):
        usage = {"input_tokens": stats["tokens_prefilled"], "output_tokens": stats["tokens_decoded"],
                 "total_tokens": stats["tokens_prefilled"] + stats["tokens_decoded"]}
        meta = {"model_name": self.memory.model_name, "finish_reason": stats["finish_reason"],
                "timings_s": stats["timings_s"]}
        cls = AIMessageChunk if chunk else AIMessage
        return cls(content=text, usage_metadata=usage, response_metadata=meta)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        max_new = kwargs.pop("max_new_tokens", self.max_new_tokens)
        if kwargs:
            raise InputError(f"unsupported arguments: {sorted(kwargs)}")
        text, stats = chat_complete(self.memory, _messages(messages), max_new, stop)
        return ChatResult(generations=[ChatGeneration(message=self._message(text, stats))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        max_new = kwargs.pop("max_new_tokens", self.max_new_tokens)
        if kwargs:
            raise InputError(f"unsupported arguments: {sorted(kwargs)}")
        msgs = _messages(messages)
        for kind, v in stream_call(lambda on_text: chat_complete(self.memory, msgs, max_new, stop, on_text)):
            if kind == "delta":
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=v))
                if run_manager is not None:
                    run_manager.on_llm_new_token(v, chunk=chunk)
                yield chunk
            else:
                yield ChatGenerationChunk(message=self._message("", v[1], chunk=True))


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 (offline, the embedder kvmemory's dense selector uses) as LangChain
    Embeddings: 384-dim, L2-normalised; a text longer than 512 pieces is embedded whole as the
    mean of its windows, never cut."""

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return shared_embedder().embed(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]
