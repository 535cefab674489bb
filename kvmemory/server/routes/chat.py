"""POST /v1/chat/completions: OpenAI's chat completions, plain or streamed (SSE)."""

import threading
import time
import uuid

from fastapi import APIRouter, Depends, Request

from kvmemory.server.chat import params_of
from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import from_exception
from kvmemory.server.schemas import (AssistantMessage, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                                     Choice, PromptTokensDetails, Usage)
from kvmemory.server.worker import sse

router = APIRouter()
STREAMED = {200: {"content": {"text/event-stream": {"schema": ChatCompletionChunk.model_json_schema()}},
                  "description": "the completion, or with stream: true its chunks as server-sent events"}}


def record(c: Context, r: dict, endpoint: str = "chat") -> None:
    """A finished chat (or text) completion into the server's metrics."""
    if c.metrics is None:
        return
    m = r["kvmemory"] or {}
    c.metrics.answered(endpoint, r.get("ttft_s"), restored=r["cached_tokens"], grafted=m.get("tokens_grafted", 0),
                       recomputed=m.get("tokens_recomputed", 0), decoded=r["completion_tokens"],
                       prefilled=r["prompt_tokens"] - r["cached_tokens"])
    c.metrics.remembered(r["kvmemory"])


def usage(r: dict) -> Usage:
    return Usage(prompt_tokens=r["prompt_tokens"], completion_tokens=r["completion_tokens"],
                 total_tokens=r["prompt_tokens"] + r["completion_tokens"],
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=r["cached_tokens"]))


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request, c: Context = Depends(ctx)):
    p = params_of(body, (c.model_id, "kvmemory"), request.headers, c.mem.model.get_input_embeddings().num_embeddings)
    if p.session is None:                  # no session to keep older turns in: refuse now, not mid-stream
        c.chat.overflows(p)
    c.chat.check_schema(p)
    head = {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": c.model_id,
            "system_fingerprint": "kvm-" + c.mem.fingerprint[-12:]}
    if not p.stream:
        r = await c.worker.run(c.chat.complete, p, lambda _: False, threading.Event())
        record(c, r)
        return ChatCompletion(**head, usage=usage(r), kvmemory=r["kvmemory"], choices=[Choice(
            index=i, message=AssistantMessage(content=x["text"]), finish_reason=x["finish_reason"],
            logprobs=None if x["logprobs"] is None else {"content": x["logprobs"]}) for i, x in enumerate(r["choices"])])

    def chunk(delta: dict | None, finish=None, usage_: Usage | None = None, memory=None, logprobs=None) -> bytes:
        """A ChatCompletionChunk event; usage only with stream_options.include_usage (null until the last);
        with logprobs: true, every token's on the chunk that finishes."""
        obj = {**head, "object": "chat.completion.chunk",
               "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish,
                                                     "logprobs": None if logprobs is None
                                                     else {"content": logprobs}}]}
        if p.include_usage:
            obj["usage"] = usage_.model_dump() if usage_ is not None else None
        if memory is not None:
            obj["kvmemory"] = memory
        return sse(obj)

    first = [True]

    def events(kind, payload):
        if first[0] and kind != "error":
            first[0] = False
            yield chunk({"role": "assistant", "content": ""})
        if kind == "delta":
            yield chunk({"content": payload})
        elif kind == "done":
            record(c, payload)
            yield chunk({}, finish=payload["finish_reason"], memory=payload["kvmemory"], logprobs=payload["logprobs"])
            if p.include_usage:
                yield chunk(None, usage_=usage(payload))
            yield sse("[DONE]")
        else:
            yield sse(from_exception(payload).body())
            yield sse("[DONE]")
    return c.worker.stream(lambda emit, cancel: c.chat.complete(p, emit, cancel), events)
