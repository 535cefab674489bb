"""GET /health (open without a key), GET /metrics (Prometheus) and GET /v1/models."""

from fastapi import APIRouter, Depends, Response

from kvmemory.server.context import Context, ctx
from kvmemory.server.schemas import Health, Model, ModelList

router = APIRouter()


@router.get("/health", response_model=Health)
async def health(c: Context = Depends(ctx)):
    b = c.worker.batcher
    return Health(status="ok", model=c.model_id, queue=c.worker.pending,
                  dtype=c.mem.geometry.dtype, dtype_reason=c.dtype_reason,
                  invariant_rows=b is not None and b.scheme is not None)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(c: Context = Depends(ctx)):
    """The server's metrics in the Prometheus text format (kvmemory/server/metrics.py)."""
    from kvmemory.server.metrics import CONTENT_TYPE
    return Response(c.metrics.render() if c.metrics is not None else b"", media_type=CONTENT_TYPE)


@router.get("/v1/models", response_model=ModelList)
async def models(c: Context = Depends(ctx)):
    return ModelList(data=[Model(id=c.model_id)])
