"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, from every source: the
server's own checks (ApiError), request validation (pydantic), kvmemory's typed errors, and the
rest (a 500 that names only the exception's type)."""

from __future__ import annotations

from kvmemory.errors import (CompactStoreError, DocumentNotFoundError, EmptyStoreError, InputError, KVMemoryError, StateNotFoundError,
                             VerificationError, WindowExceededError)

CUSTOM_CODES = {"missing_required_parameter", "unsupported_parameter", "invalid_value"}
PYDANTIC_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
                  "json_invalid": "invalid_json", "model_attributes_type": "invalid_json"}
DOCUMENTED = (400, 401, 404, 405, 409, 413, 422, 429, 500)


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(what: str, value: str, param: str) -> ApiError:
    return ApiError(404, f"no {what} {value!r}", param=param, code="not_found")


def param_of(loc) -> str | None:
    """messages[0].content from pydantic's ("body", "messages", 0, "content", "str"): union and
    validator tags (which name a type, not a field) end the path."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none") or "-" in part:
            break
        else:
            out += ("." if out else "") + part
    return out or None


def from_validation(errors: list[dict]) -> ApiError:
    """The first pydantic error of a request as a 400 naming its parameter."""
    if not errors:
        return ApiError(400, "invalid request", code="invalid_value")
    e = errors[0]
    kind = e.get("type", "")
    param = param_of(e.get("loc", ()))
    code = kind if kind in CUSTOM_CODES else PYDANTIC_CODES.get(kind, "invalid_value")
    if code == "unknown_parameter":
        msg = f"unrecognized request argument: {param}"
    elif code == "invalid_json":
        msg, param = f"the request body must be a JSON object: {e.get('msg', '')}", None
    else:
        msg = f"{param or 'the request body'}: {e.get('msg', 'invalid')}"
    return ApiError(400, msg, param=param, code=code)


def from_exception(e: Exception) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (DocumentNotFoundError, StateNotFoundError)):
        return ApiError(404, str(e), code="not_found")
    if isinstance(e, EmptyStoreError):
        return ApiError(409, str(e), code="no_documents")
    if isinstance(e, CompactStoreError):          # a compact store served read-only: writes conflict with it
        return ApiError(409, str(e), code="compact_store")
    if isinstance(e, VerificationError):
        return ApiError(422, str(e), code="verification_failed")
    if isinstance(e, WindowExceededError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, InputError):
        return ApiError(400, str(e), code="invalid_value")
    if isinstance(e, KVMemoryError):
        return ApiError(500, f"{type(e).__name__}: {e}", type_="server_error")
    return ApiError(500, f"internal error: {type(e).__name__}", type_="server_error")


def check_id(value, what: str) -> str:
    from kvmemory.documents import valid_id
    if not valid_id(value):
        raise bad(what, f"{what} must be a non-empty string of at most 200 printable characters")
    return value
