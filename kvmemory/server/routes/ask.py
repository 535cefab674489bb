"""POST /v1/ask: answer from the deposited documents, with the passages grafted (SSE with stream)."""

from fastapi import APIRouter, Depends

from kvmemory.options import AskOptions
from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import from_exception
from kvmemory.server.schemas import AskRequest, AskResponse
from kvmemory.server.sessions import SESSION_DOCS
from kvmemory.server.worker import sse

router = APIRouter()
STREAMED = {200: {"content": {"text/event-stream": {}},
                  "description": "the answer, or with stream: true delta events and a final one"}}


def answer(mem, q: AskRequest, emit, defaults: AskOptions = AskOptions(), metrics=None) -> dict:
    """Memory.ask with the request's settings (unset ones take the server's `defaults`); chat memory
    is not a document."""
    ans = mem.ask(q.question, q.options(defaults), on_token=emit, doc_filter=lambda d: not d.startswith(SESSION_DOCS))
    if metrics is not None:
        s = ans.stats
        metrics.answered("ask", s["timings_s"]["ttft"], restored=s["tokens_restored"] - s["tokens_recomputed"],
                         grafted=s["tokens_restored"] - ans.window.prelude_tokens if ans.window else 0,
                         recomputed=s["tokens_recomputed"], prefilled=s["tokens_prefilled"],
                         decoded=s["tokens_decoded"])
    return {"answer": ans.text, "sources": mem.passages(ans), "stats": ans.stats}


@router.post("/v1/ask", response_model=AskResponse, responses=STREAMED)
async def ask(q: AskRequest, c: Context = Depends(ctx)):
    if not q.stream:
        return await c.worker.run(answer, c.mem, q, None, c.ask_defaults, c.metrics)

    def events(kind, payload):
        if kind == "delta":
            yield sse({"type": "delta", "text": payload})
        elif kind == "done":
            yield sse({"type": "final", **payload})
            yield sse("[DONE]")
        else:
            yield sse(from_exception(payload).body())
            yield sse("[DONE]")
    return c.worker.stream(lambda emit, cancel: answer(c.mem, q, emit, c.ask_defaults, c.metrics), events)
