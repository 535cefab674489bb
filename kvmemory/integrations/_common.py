"""What both framework adapters share: the question of an input, the default model as a plain
chat LLM (the text baseline of the examples), and streaming a blocking call's text deltas as an
iterator."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import torch

from kvmemory.errors import InputError, WindowExceededError

QUESTION_KEYS = ("question", "query", "input")


def question_of(value) -> str:
    """The question in a runnable's input: a str, or a dict with one of QUESTION_KEYS."""
    if isinstance(value, dict):
        for k in QUESTION_KEYS:
            if k in value:
                value = value[k]
                break
        else:
            raise InputError(f"the input dict has none of the keys {QUESTION_KEYS}: {sorted(value)}")
    if not isinstance(value, str):
        raise InputError(f"the question must be a str (or a dict holding one), got {type(value).__name__}")
    if not value.strip():
        raise InputError("the question is empty")
    return value


def doc_source(mem, doc_id: str) -> str:
    entry = mem.require_store().manifest.docs.get(doc_id)
    return entry.source if entry is not None else ""


def stream_call(fn) -> Iterator[tuple[str, object]]:
    """Run fn(on_text) in a thread; yield ("delta", text) as it calls on_text, then ("done", result).

    fn's exception is raised here. If the consumer stops iterating, the next on_text returns True,
    which asks the decode loop to stop (Memory.ask and chat_complete honour it)."""
    q: queue.Queue = queue.Queue()
    gone = threading.Event()

    def on_text(delta: str) -> bool:
        q.put(("delta", delta))
        return gone.is_set()

    def run() -> None:
        try:
            q.put(("done", fn(on_text)))
        except BaseException as e:        # noqa: BLE001 - handed to the consumer, raised there
            q.put(("error", e))

    t = threading.Thread(target=run, name="kvmemory-stream", daemon=True)
    t.start()
    try:
        while True:
            kind, v = q.get()
            if kind == "error":
                raise v
            yield kind, v
            if kind == "done":
                return
    finally:
        gone.set()


@torch.inference_mode()
def chat_complete(mem, messages: list[dict], max_new_tokens: int = 256, stop=None, on_text=None
                  ) -> tuple[str, dict]:
    """The default model answering a conversation from scratch (everything prefilled, greedy):
    what a text-RAG pipeline does with retrieved text. Returns (text, stats).

    stop: strings that end the answer (not included). on_text(delta) streams the answer; returning
    True stops it."""

    from kvmemory import kv as kvops, prompts
    from kvmemory.decode import TextStream, greedy

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    t0 = time.perf_counter()
    ids = prompts.chat_ids(mem.tokenizer, messages)
    room = mem.geometry.max_positions - max_new_tokens
    if len(ids) > room:
        raise WindowExceededError(f"the prompt is {len(ids)} tokens; at most {room} fit the model's window with "
                                  f"{max_new_tokens} answer tokens")
    with mem.exclusive():
        cache = kvops.make_cache(None, mem.model.config)
        for _, _, logits in kvops.prefill_blocks(mem.model, ids, mem.block_tokens, cache,
                                                 chunk_tokens=mem.prefill_tokens):
            pass
        ttft = time.perf_counter() - t0
        stream = TextStream(mem.tokenizer, stop or [], on_text, strip=True)
        t = time.perf_counter()
        new = greedy(mem.model, cache, logits, max_new_tokens, mem.eos_ids, on_token=stream)
        decode_s = time.perf_counter() - t
        text = stream.finish(new)
    finish = "stop" if stream.stopped or len(new) < max_new_tokens else "length"
    return text, {"tokens_prefilled": len(ids), "tokens_decoded": len(new), "finish_reason": finish,
                  "timings_s": {"ttft": ttft, "decode": decode_s, "total": time.perf_counter() - t0}}
