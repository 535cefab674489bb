"""Request ids and logs: every request gets an id (the client's X-Request-Id when it sends a sane one,
else a new one), returned in the response's X-Request-Id and carried by every log line written while
the request is served, on any thread (the worker copies the request's context). One access line a
request on the "kvmemory.access" logger. Plain text or JSON lines (`kvmemory serve --log-format json`),
at `--log-level`."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvmemory_request_id", default="-")
HEADER = "X-Request-Id"
LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_SANE = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
access = logging.getLogger("kvmemory.access")


def request_id(sent: str | None) -> str:
    """The id of a request: the client's, when it is a short token of printable characters, else a new one."""
    return sent if sent is not None and _SANE.fullmatch(sent) else uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on every record (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, request_id, and any `extra` fields."""

    STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "request_id", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
               "request_id": getattr(record, "request_id", REQUEST_ID.get())}
        out.update({k: v for k, v in vars(record).items() if k not in self.STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """The server's logging: kvmemory's loggers and uvicorn's (its own access log off: ours carries the
    request id) through one handler at `level`, as text or JSON lines. Returns the handler."""
    if level not in LEVELS:
        raise ValueError(f"log level is one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format is one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    for name in ("kvmemory", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True
    return handler


def log_access(method: str, path: str, status: int, seconds: float, client: str | None) -> None:
    access.info("%s %s %d %.1f ms", method, path, status, seconds * 1000,
                extra={"method": method, "path": path, "status": status, "duration_ms": round(seconds * 1000, 2),
                       "client": client})
