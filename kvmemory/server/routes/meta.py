"""GET /health (open without a key) and GET /v1/models."""

from fastapi import APIRouter, Depends

from kvmemory.server.context import Context, ctx
from kvmemory.server.schemas import Health, Model, ModelList

router = APIRouter()


@router.get("/health", response_model=Health)
async def health(c: Context = Depends(ctx)):
    b = c.worker.batcher
    return Health(status="ok", model=c.model_id, queue=c.worker.pending,
                  dtype=c.mem.geometry.dtype,
                  invariant_rows=b is not None and b.scheme is not None)


@router.get("/v1/models", response_model=ModelList)
async def models(c: Context = Depends(ctx)):
    return ModelList(data=[Model(id=c.model_id)])
