"""What every route reaches: the Memory, the model worker and the services, one per app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from kvmemory.options import AskOptions
from kvmemory.server.chat import ChatService
from kvmemory.server.jobs import Jobs
from kvmemory.server.metrics import Metrics

if TYPE_CHECKING:
    from kvmemory.memory import Memory
from kvmemory.server.sessions import Sessions
from kvmemory.server.worker import Worker


@dataclass
class Context:
    mem: Memory                    # a writable kvmemory.Memory
    worker: Worker
    chat: ChatService
    jobs: Jobs
    sessions: Sessions
    max_body_bytes: int
    ask_defaults: AskOptions = field(default_factory=AskOptions)   # what an ask that leaves a field unset gets
    metrics: Metrics | None = None
    dtype_reason: str = ""         # why the model computes in its dtype (kvmemory.model.choose), said in /health

    @property
    def model_id(self) -> str:
        return self.mem.model_name


def ctx(request: Request) -> Context:
    """The route dependency: this app's Context."""
    return request.app.state.ctx
