"""GET and DELETE /v1/sessions/{session_id}: a chat session's states and what it recalled; forgetting
it removes its states and its memory (the older turns of a session that outgrew the window)."""

from fastapi import APIRouter, Depends

from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import check_id, not_found
from kvmemory.server.memory_chat import session_memory
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
    check_id(session_id, "session_id")
    job = c.chat.take(session_id)          # a turn whose save was deferred: never saved now
    if c.sessions.data.get(session_id) is None and job is None:
        raise not_found("session", session_id, "session_id")
    prefix, mem = session_prefix(session_id), c.mem
    states: list[str] = []

    def forget():
        with mem.exclusive():      # a deferred save that was running has added its state by now
            s = c.sessions.data.get(session_id)
            listed = (s["states"] if s is not None else []) + (list(job[1].states) if job is not None else [])
            states.extend(dict.fromkeys(listed))       # each once: a deferred turn's prompt is in the record too
            mem.forget_states(states)
        # stores written before session memory kept a session's older turns as shared documents
        gone = [d for d in mem.require_store().manifest.docs if d.startswith(prefix)]
        for d in gone:
            mem.remove(d)
        return len(gone) + session_memory(mem, session_id).forget().turns
    n_docs = await c.worker.run(forget)
    c.sessions.forget(session_id)          # last: a crash before it leaves a record to forget again
    return SessionDeleted(id=session_id, deleted=True, states=len(states), documents=n_docs)
