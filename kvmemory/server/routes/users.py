"""A user's memory across sessions (the chat request's `user`, or the X-Kvmemory-User header):

    GET    /v1/users/{user}/memory                what is kept: sessions, turns, tokens, bytes
    DELETE /v1/users/{user}                       forget the user: turns, states, sessions
    DELETE /v1/users/{user}/sessions/{session_id} forget one session of the user

Forgetting runs on the model worker, so it is ordered with chat requests: a request after it
recalls nothing forgotten. `kvmemory gc` then deletes the bytes."""

from fastapi import APIRouter, Depends

from kvmemory.chat_memory import user_key
from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import check_id, not_found
from kvmemory.server.schemas import UserForgotten, UserMemory

router = APIRouter()


def _memory(mem, sessions, user: str) -> UserMemory:
    cm = mem.chat_memory(user)
    kept = cm.sessions()
    records = sessions.of_user(user)
    g = mem.geometry
    per_token = g.layers * 2 * g.kv_heads * g.head_dim * mem.kv_dtype.itemsize
    tokens = sum(s["tokens"] for s in kept)
    by_id = {r["id"]: r for r in records.values()}
    return UserMemory(user=user, turns=sum(s["turns"] for s in kept), tokens=tokens, kv_bytes=tokens * per_token,
                      sessions=[{**s, "states": len(by_id.get(s["id"], {}).get("states", []))} for s in kept])


def _forget(mem, sessions, user: str, session: str | None) -> UserForgotten:
    gone = mem.chat_memory(user).forget(session)      # turns and states: one commit
    key = user_key(user)
    records = sessions.of_user(user) if session is None else \
        {k: s for k, s in sessions.of_user(user).items() if k == f"{key}/{session}"}
    states = gone.states + mem.forget_states([x for s in records.values() for x in s["states"]])
    for k in records:
        sessions.forget(k)
    return UserForgotten(user=user, session=session, deleted=True, turns=gone.turns, states=states,
                         sessions=len(records))


@router.get("/v1/users/{user}/memory", response_model=UserMemory)
async def get_memory(user: str, c: Context = Depends(ctx)):
    return await c.worker.run(_memory, c.mem, c.sessions, check_id(user, "user"))


@router.delete("/v1/users/{user}", response_model=UserForgotten)
async def forget_user(user: str, c: Context = Depends(ctx)):
    r = await c.worker.run(_forget, c.mem, c.sessions, check_id(user, "user"), None)
    if c.metrics is not None:
        c.metrics.forgot()
    return r


@router.delete("/v1/users/{user}/sessions/{session_id}", response_model=UserForgotten)
async def forget_session(user: str, session_id: str, c: Context = Depends(ctx)):
    r = await c.worker.run(_forget, c.mem, c.sessions, check_id(user, "user"), check_id(session_id, "session_id"))
    if not r.turns and not r.sessions:
        raise not_found("session", session_id, "session_id")
    if c.metrics is not None:
        c.metrics.forgot()
    return r
