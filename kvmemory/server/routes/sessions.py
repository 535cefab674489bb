"""GET and DELETE /v1/sessions/{session_id}: a chat session's states and what it recalled; forgetting
it removes its states and its older turns' documents."""

from fastapi import APIRouter, Depends

from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import check_id, not_found
from kvmemory.server.schemas import Session, SessionDeleted
from kvmemory.server.sessions import session_prefix

router = APIRouter()


@router.get("/v1/sessions/{session_id}", response_model=Session)
async def get_session(session_id: str, c: Context = Depends(ctx)):
    s = c.sessions.data.get(check_id(session_id, "session_id"))
    if s is None:
        raise not_found("session", session_id, "session_id")
    return s


@router.delete("/v1/sessions/{session_id}", response_model=SessionDeleted)
async def delete_session(session_id: str, c: Context = Depends(ctx)):
    s = c.sessions.forget(check_id(session_id, "session_id"))
    if s is None:
        raise not_found("session", session_id, "session_id")
    prefix, mem = session_prefix(session_id), c.mem

    def forget():
        mem.forget_states(s["states"])
        gone = [d for d in mem.require_store().manifest.docs if d.startswith(prefix)]
        for d in gone:
            mem.remove(d)
        return len(gone)
    n_docs = await c.worker.run(forget)
    return SessionDeleted(id=session_id, deleted=True, states=len(s["states"]), documents=n_docs)
