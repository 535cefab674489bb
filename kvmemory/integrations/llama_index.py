"""LlamaIndex adapters: kvmemory as a retriever (for RetrieverQueryEngine and friends), as a query
engine that answers from grafted KV (Response.source_nodes are the grafted passages), and the
default model and embedder as LlamaIndex components for offline pipelines.

    pip install 'kvmemory[llamaindex]'

    from kvmemory.integrations.llama_index import KVMemoryQueryEngine, KVMemoryRetriever
    engine = KVMemoryQueryEngine(memory=mem)
    response = engine.query("When was the bridge closed?")   # str(response), response.source_nodes
"""

from __future__ import annotations

from kvmemory.integrations import require

require(["llama_index.core"], "llamaindex", "kvmemory.integrations.llama_index")

import asyncio  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from llama_index.core.base.base_query_engine import BaseQueryEngine  # noqa: E402
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.base.response.schema import Response, StreamingResponse  # noqa: E402
from llama_index.core.callbacks import CallbackManager  # noqa: E402
from llama_index.core.llms import (ChatMessage, ChatResponse, ChatResponseGen, CompletionResponse,  # noqa: E402
                                   CompletionResponseGen, CustomLLM, LLMMetadata, MessageRole)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback  # noqa: E402
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode  # noqa: E402
from pydantic import ConfigDict, Field  # noqa: E402

from kvmemory.errors import InputError  # noqa: E402
from kvmemory.index.embedder import shared_embedder  # noqa: E402
from kvmemory.integrations._common import chat_complete, doc_source, question_of, stream_call  # noqa: E402
from kvmemory.memory import Memory  # noqa: E402

__all__ = ["KVMemoryLLM", "KVMemoryQueryEngine", "KVMemoryRetriever", "MiniLMEmbedding", "to_node"]


def to_node(mem: Memory, hit: dict) -> NodeWithScore:
    """A NodeWithScore of one passage (a Memory.retrieve hit, or a passage of an answer)."""
    meta = {"doc_id": hit["doc_id"], "start_token": hit["start_token"], "end_token": hit["end_token"],
            "source": doc_source(mem, hit["doc_id"]) or hit["doc_id"]}
    node = TextNode(id_=f"{hit['doc_id']}:{hit['start_token']}-{hit['end_token']}", text=hit["text"], metadata=meta)
    return NodeWithScore(node=node, score=float(hit["score"]))


def _check_memory(memory) -> Memory:
    if not isinstance(memory, Memory):
        raise InputError(f"memory must be a kvmemory.Memory, got {type(memory).__name__}")
    return memory


def _check_k(name: str, v, optional: bool = False):
    if (v is None and optional) or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        return v
    raise InputError(f"{name} must be an integer >= 1, got {v!r}")


class KVMemoryRetriever(BaseRetriever):
    """The blocks Memory.ask would select for a query, as NodeWithScore(TextNode), best first.

    node.metadata: doc_id, start_token, end_token, source; node.score: the selector's (higher is
    better). Use it anywhere LlamaIndex takes a retriever, e.g. RetrieverQueryEngine.from_args."""

    def __init__(self, memory: Memory, similarity_top_k: int = 4, selector: str = "text",
                 doc_filter: Callable[[str], bool] | None = None, callback_manager: CallbackManager | None = None,
                 verbose: bool = False) -> None:
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self.memory = _check_memory(memory)
        self.similarity_top_k = _check_k("similarity_top_k", similarity_top_k)
        self.selector = selector
        self.doc_filter = doc_filter

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self.memory.retrieve(query_bundle.query_str, k=self.similarity_top_k, selector=self.selector,
                                    doc_filter=self.doc_filter)
        return [to_node(self.memory, h) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class KVMemoryQueryEngine(BaseQueryEngine):
    """Answers with Memory.ask: the selected blocks' stored KV is grafted, only the question is
    prefilled, nothing retrieved is re-read as text. query() returns a Response whose
    source_nodes are the grafted passages (window order) and whose metadata is Answer.stats;
    with streaming=True a StreamingResponse (source_nodes and metadata filled once it ends)."""

    def __init__(self, memory: Memory, top_k: int | None = None, selector: str = "text", max_new_tokens: int = 48,
                 recompute: float | None = None, min_relevance: float | None = None,
                 doc_filter: Callable[[str], bool] | None = None, streaming: bool = False,
                 callback_manager: CallbackManager | None = None) -> None:
        super().__init__(callback_manager=callback_manager)
        self.memory = _check_memory(memory)
        self.top_k = _check_k("top_k", top_k, optional=True)
        self.max_new_tokens = _check_k("max_new_tokens", max_new_tokens)
        self.selector, self.recompute, self.min_relevance = selector, recompute, min_relevance
        self.doc_filter, self.streaming = doc_filter, streaming

    def _get_prompt_modules(self) -> dict:
        return {}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        """The passages ask() would select first (Memory.retrieve), without answering."""
        hits = self.memory.retrieve(query_bundle.query_str, k=self.top_k or 4, selector=self.selector,
                                    doc_filter=self.doc_filter)
        return [to_node(self.memory, h) for h in hits]

    def _ask(self, question: str, on_text=None) -> tuple[str, list[NodeWithScore], dict]:
        ans = self.memory.ask(question, top_k=self.top_k, selector=self.selector, max_new_tokens=self.max_new_tokens,
                              recompute=self.recompute, min_relevance=self.min_relevance, on_token=on_text,
                              doc_filter=self.doc_filter)
        stats = {k: v for k, v in ans.stats.items() if k != "ranking"}
        return ans.text, [to_node(self.memory, p) for p in self.memory.passages(ans)], stats

    def _query(self, query_bundle: QueryBundle):
        question = question_of(query_bundle.query_str)
        if not self.streaming:
            text, nodes, stats = self._ask(question)
            return Response(response=text, source_nodes=nodes, metadata=stats)
        nodes: list[NodeWithScore] = []
        meta: dict = {}

        def gen():
            for kind, v in stream_call(lambda on_text: self._ask(question, on_text)):
                if kind == "delta":
                    yield v
                else:
                    nodes.extend(v[1])
                    meta.update(v[2])
        return StreamingResponse(response_gen=gen(), source_nodes=nodes, metadata=meta)

    async def _aquery(self, query_bundle: QueryBundle):
        return await asyncio.to_thread(self._query, query_bundle)


def _messages(messages: Sequence[ChatMessage]) -> list[dict]:
    roles = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
    out = []
    for m in messages:
        if m.role not in roles:
            raise InputError(f"{m.role} messages are not supported (system, user and assistant are)")
        out.append({"role": roles[m.role], "content": m.content or ""})
    return out


class KVMemoryLLM(CustomLLM):
    """The Memory's model (the default SmolLM2-135M-Instruct) as a LlamaIndex LLM, offline: the
    prompt is prefilled in full in the model's chat template and answered greedily. It is what a
    text-RAG pipeline (RetrieverQueryEngine, VectorStoreIndex.as_query_engine) re-reads retrieved
    text with; KVMemoryQueryEngine answers from grafted KV instead."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory = Field(exclude=True)
    max_new_tokens: int = Field(default=256, ge=1)

    @classmethod
    def class_name(cls) -> str:
        return "kvmemory_local_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.memory.geometry.max_positions, num_output=self.max_new_tokens,
                           is_chat_model=True, model_name=self.memory.model_name)

    def _run(self, msgs: list[dict], kwargs: dict, on_text=None) -> tuple[str, dict]:
        max_new = kwargs.pop("max_new_tokens", self.max_new_tokens)
        stop = kwargs.pop("stop", None)
        kwargs.pop("formatted", None)
        if kwargs:
            raise InputError(f"unsupported arguments: {sorted(kwargs)}")
        return chat_complete(self.memory, msgs, max_new, stop, on_text)

    def _stream(self, msgs: list[dict], kwargs: dict):
        text = ""
        for kind, v in stream_call(lambda on_text: self._run(msgs, dict(kwargs), on_text)):
            if kind == "delta":
                text += v
                yield text, v, None
            else:
                yield v[0], "", v[1]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        text, stats = self._run([{"role": "user", "content": prompt}], kwargs)
        return CompletionResponse(text=text, raw=stats)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        msgs = [{"role": "user", "content": prompt}]

        def gen():
            for text, delta, stats in self._stream(msgs, kwargs):
                yield CompletionResponse(text=text, delta=delta, raw=stats)
        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, stats = self._run(_messages(messages), kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), raw=stats)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        msgs = _messages(messages)

        def gen():
            for text, delta, stats in self._stream(msgs, kwargs):
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta,
                                   raw=stats)
        return gen()


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 (offline, the embedder kvmemory's dense selector uses) as a LlamaIndex
    embedding: 384-dim, L2-normalised, long texts embedded whole (mean of windows), never cut."""

    model_name: str = "all-MiniLM-L6-v2"

    @classmethod
    def class_name(cls) -> str:
        return "kvmemory_minilm"

    def _get_query_embedding(self, query: str) -> list[float]:
        return shared_embedder().embed([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return shared_embedder().embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return shared_embedder().embed(list(texts)).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await asyncio.to_thread(self._get_query_embedding, query)
