"""POST /v1/completions (OpenAI's text completions, plain or streamed), POST /tokenize and /detokenize
(vLLM's). A text prompt is saved and restored like a conversation (its prefix: cached_tokens)."""

import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request

from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import bad, from_exception
from kvmemory.server.params import completion_params
from kvmemory.server.routes.chat import record, usage
from kvmemory.server.schemas_text import (Completion, CompletionChoice, CompletionRequest, DetokenizeRequest,
                                          DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from kvmemory.server.worker import sse

router = APIRouter()
STREAMED: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}},
                  "description": "the completion, or with stream: true its chunks as server-sent events"}}


def logprobs_of(content: list[dict] | None) -> Any:
    """The chat service's per-token logprobs in the text completions' shape."""
    if content is None:
        return None
    offsets, at = [], 0
    for t in content:
        offsets.append(at)
        at += len(t["token"])
    return {"tokens": [t["token"] for t in content], "token_logprobs": [t["logprob"] for t in content],
            "top_logprobs": [{a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in content],
            "text_offset": offsets}


@router.post("/v1/completions", response_model=Completion, responses=STREAMED)
async def completions(body: CompletionRequest, request: Request, c: Context = Depends(ctx)):
    vocab = c.mem.model.get_input_embeddings().num_embeddings
    p = completion_params(body, (c.model_id, "kvmemory"), request.headers, c.mem.tokenizer, vocab)
    c.chat.check_prompt(p)
    head: dict[str, Any] = {"id": "cmpl-" + uuid.uuid4().hex[:24], "created": int(time.time()), "model": c.model_id,
            "system_fingerprint": "kvm-" + c.mem.fingerprint[-12:]}
    if not p.stream:
        r = await c.worker.run(c.chat.complete, p, lambda _: False, threading.Event())
        record(c, r, "completions")
        return Completion(**head, usage=usage(r), choices=[CompletionChoice(
            text=r["text"], finish_reason=r["finish_reason"], logprobs=logprobs_of(r["logprobs"]))])

    def chunk(text: str, finish=None, logprobs=None, usage_=None) -> bytes:
        obj = {**head, "object": "text_completion",
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
        if p.include_usage:
            obj["usage"] = usage_.model_dump() if usage_ is not None else None
        return sse(obj)

    def events(kind, payload):
        if kind == "delta":
            yield chunk(payload)
        elif kind == "done":
            record(c, payload, "completions")
            yield chunk("", payload["finish_reason"], logprobs_of(payload["logprobs"]),
                        usage(payload) if p.include_usage else None)
            yield sse("[DONE]")
        else:
            yield sse(from_exception(payload).body())
            yield sse("[DONE]")
    return c.worker.stream(lambda emit, cancel: c.chat.complete(p, emit, cancel), events)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, c: Context = Depends(ctx)):
    """A prompt's token ids, or chat messages' in the model's chat template (with the assistant's opening)."""
    from kvmemory import prompts
    if (body.prompt is None) == (body.messages is None):
        raise bad("prompt", "give a prompt or messages, one of them")
    tok = c.mem.tokenizer
    if body.prompt is not None:
        ids = tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    elif body.messages is not None:
        ids = prompts.chat_ids(tok, [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                                     for m in body.messages])
    return TokenizeResponse(tokens=list(ids), count=len(ids), max_model_len=c.mem.geometry.max_positions)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, c: Context = Depends(ctx)):
    vocab = c.mem.model.get_input_embeddings().num_embeddings
    if any(t >= vocab for t in body.tokens):
        raise bad("tokens", f"token ids are in 0..{vocab - 1}")
    return DetokenizeResponse(prompt=c.mem.tokenizer.decode(body.tokens))
