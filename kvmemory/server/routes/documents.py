"""Documents and their deposit jobs:

    POST   /v1/documents        JSON {"text", "doc_id"} or a multipart upload (file, doc_id): 202 {"job_id"}
    GET    /v1/jobs/{job_id}    {"status": queued|running|done|failed, "progress", "error"}
    GET    /v1/documents        the deposited documents (not the chat sessions' memory)
    DELETE /v1/documents/{doc_id}
"""

import json
from pathlib import Path

import xxhash
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvmemory.documents import USER_DOCS, check_doc_id, decode_text
from kvmemory.errors import InputError
from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import ApiError, bad, check_id, not_found
from kvmemory.server.schemas import Deleted, Document, DocumentCreate, DocumentList, DocumentUpload, Job, JobCreated
from kvmemory.server.sessions import SESSION_DOCS
from kvmemory.store.info import per_token_bytes

router = APIRouter()
BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": DocumentCreate.model_json_schema()},
    "multipart/form-data": {"schema": DocumentUpload.model_json_schema()}}}}


def _validated(model, data: dict, where: str = "body"):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": (where, *err["loc"])} for err in e.errors()]) from None


async def _upload(request: Request, limit: int) -> tuple[bytes | str, str | None, str]:
    """(data, doc_id, source) of the request: a multipart file or a JSON body."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        f = form.get("file")
        if f is None or not hasattr(f, "read"):
            raise bad("file", "a multipart upload needs a file field named 'file'", "missing_required_parameter")
        data = await f.read()
        if len(data) > limit:
            raise ApiError(413, f"the file is larger than {limit} bytes", code="request_too_large")
        doc_id = form.get("doc_id")
        if doc_id is not None and not isinstance(doc_id, str):
            raise bad("doc_id", "doc_id must be a string")
        return data, doc_id or Path(f.filename or "").name or None, f.filename or ""
    try:
        raw = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": f"not JSON: {e}"}]) from None
    body = _validated(DocumentCreate, raw)
    return body.text, body.doc_id, ""


@router.post("/v1/documents", status_code=202, response_model=JobCreated, openapi_extra=BODY)
async def add_document(request: Request, c: Context = Depends(ctx)):
    data, doc_id, source = await _upload(request, c.max_body_bytes)
    try:
        text = decode_text(data, source or "text")
        if doc_id is None:
            doc_id = "doc-" + xxhash.xxh3_64_hexdigest(text.encode())
        check_doc_id(doc_id)
        if doc_id.startswith(SESSION_DOCS):
            raise InputError(f"document ids starting with {SESSION_DOCS!r} are reserved for chat sessions")
    except InputError as e:
        raise bad("doc_id" if "document id" in str(e) else "text", str(e)) from None
    if doc_id in c.mem.require_store().manifest.docs or c.jobs.pending(doc_id):
        raise ApiError(409, f"document {doc_id!r} already exists or is being added; DELETE it first",
                       param="doc_id", code="conflict")
    job = c.jobs.create(text, doc_id, source)
    return JobCreated(job_id=job["id"], doc_id=doc_id, status=job["status"])


@router.get("/v1/jobs/{job_id}", response_model=Job)
async def get_job(job_id: str, c: Context = Depends(ctx)):
    job = c.jobs.jobs.get(job_id)
    if job is None:
        raise not_found("job", job_id, "job_id")
    return c.jobs.public(job)


@router.get("/v1/documents", response_model=DocumentList)
async def list_documents(c: Context = Depends(ctx)):
    store = c.mem.require_store()          # the store, not the Memory: answers while a deposit runs
    store.refresh()
    # the shared documents only: not a session's older turns, nor any user's chat memory
    docs = sorted(((k, d) for k, d in store.manifest.docs.items() if not k.startswith((SESSION_DOCS, USER_DOCS))),
                  key=lambda kv: kv[1].created)
    per_token = per_token_bytes(store.manifest)
    return DocumentList(data=[Document(doc_id=k, n_tokens=d.n_tokens, blocks=len(d.rows), kv_bytes=d.n_tokens * per_token,
                                       source=d.source, created=d.created) for k, d in docs])


@router.delete("/v1/documents/{doc_id}", response_model=Deleted)
async def delete_document(doc_id: str, c: Context = Depends(ctx)):
    await c.worker.run(c.mem.remove, check_id(doc_id, "doc_id"))
    return Deleted(doc_id=doc_id, deleted=True)
