"""The server's routes, one module an area; each holds an APIRouter named `router`."""

from kvmemory.server.routes import ask, chat, completions, documents, library, meta, sessions, users, web

ROUTERS = [meta.router, chat.router, completions.router, ask.router, documents.router, sessions.router, users.router, library.router,
           web.router]
