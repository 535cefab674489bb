"""`kvmemory serve`: a document-QA HTTP API and an OpenAI-compatible chat server over one Memory.

    app.py        the app factory, error handlers, API key and body-size guard, serve()
    schemas.py    pydantic request and response bodies (the OpenAPI schema)
    routes/       one module an area: meta (health, models), chat, ask, documents (+ jobs),
                  sessions, users (chat memory), library (learn, solve)
    chat.py       the chat service: fit to the window, restore, decode, save the conversation
    memory_chat.py  a chat request with a user: its memory recalled as KV, the exchange remembered
    jobs.py       deposit jobs (persisted, resumed after a restart); sessions.py; persist.py
    worker.py     the model worker (one thread, bounded queue, 429) and SSE streaming
    ray.py        `kvmemory serve --ray`: Ray Serve replicas and a session-affine router

One model, many clients: model work runs on one worker thread, in arrival order; at most
`queue_size` requests wait, more get 429 with Retry-After. Deposits run on their own thread (the
Memory serialises them with the model work). Jobs and sessions are kept in STORE/serve/ and
survive a restart; an interrupted deposit resumes.
"""

from kvmemory.errors import MissingDependencyError

try:
    import fastapi  # noqa: F401
except ImportError:
    raise MissingDependencyError("the server needs FastAPI and uvicorn: pip install 'kvmemory[serve]'") from None

from kvmemory.server.app import create_app, serve  # noqa: E402

__all__ = ["create_app", "serve"]
