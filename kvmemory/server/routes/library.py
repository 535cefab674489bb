"""POST /v1/learn and /v1/solve: the verified-solution library."""

from fastapi import APIRouter, Depends

from kvmemory.server.context import Context, ctx
from kvmemory.server.errors import bad
from kvmemory.server.schemas import LearnRequest, LearnResponse, SolveRequest, SolveResponse

router = APIRouter()


def _verifier(answer: str | None):
    return None if answer is None else f"answer:{answer}"


def learn_one(mem, q: LearnRequest) -> LearnResponse:
    e = mem.learn(q.problem, q.solution, verify=_verifier(q.answer))
    return LearnResponse(entry_id=e.entry_id, verified=e.verified, answer=e.answer, n_tokens=e.n_tokens)


def solve_one(mem, q: SolveRequest) -> SolveResponse:
    sol = mem.solve(q.problem, verify=_verifier(q.answer), k=q.k, attempts=q.attempts,
                    max_new_tokens=q.max_new_tokens, learn=q.learn, recompute=q.recompute)
    return SolveResponse(text=sol.text, answer=sol.answer, verified=sol.verified, sources=sol.sources,
                         learned=sol.learned.entry_id if sol.learned else None, stats=sol.stats)


@router.post("/v1/learn", response_model=LearnResponse)
async def learn(q: LearnRequest, c: Context = Depends(ctx)):
    if q.answer is None and not q.unverified:
        raise bad("answer", "give the expected answer to verify the solution against, or unverified: true",
                  "missing_required_parameter")
    return await c.worker.run(learn_one, c.mem, q)


@router.post("/v1/solve", response_model=SolveResponse)
async def solve(q: SolveRequest, c: Context = Depends(ctx)):
    return await c.worker.run(solve_one, c.mem, q)
