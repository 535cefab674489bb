"""Deposits on Ray: segments of documents computed by a pool of actors, documents made visible
in order by one committer (`kvmemory add STORE FILES --ray [ADDRESS]`, `ray_add`).

    driver (this process)                         actors (one model each; a GPU where the cluster has one)
    ------------------------------------------    ------------------------------------------------------
    check and tokenize every file                 Memory(store) on the same store
    save the prelude state once
    hand out segments not already stored   --->   prefill the segment behind the prelude, commit its
                                                  blocks (immutable rows; invisible: no document
                                                  names them yet), return
    as each document's segments are all    <---
    stored, in file order: index them and
    commit the document (Memory.add finds
    every segment stored and computes nothing)

A worker that dies (killed, out of memory, its node lost) is replaced and its segment handed out
again: a segment's blocks land in one commit or not at all, and a document becomes visible only
in the driver's last commit, so nothing half-done is ever visible. Running the same command again
resumes: stored segments are skipped.

The store must be reachable by every worker under the same name: a local directory on one
machine (or a shared filesystem), or an s3:// store for a cluster. Workers on one store commit
without a shared lock on S3 (create-only records and shard claims; see kvmemory/store).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kvmemory.errors import InputError, KVMemoryError, MissingDependencyError


def _ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--ray needs Ray: pip install 'kvmemory[ray]'") from None
    return ray


@dataclass
class RayAddReport:
    docs: list = field(default_factory=list)      # DocInfo of each file, in order
    segments: int = 0                             # segments of all files
    computed: int = 0                             # segments the workers computed (the rest were stored)
    restarts: int = 0                             # workers replaced after dying
    workers: int = 0
    seconds: float = 0.0                          # all of it: model loads, worker start, deposits, indexing
    compute_seconds: float = 0.0                  # from every worker ready to the last document committed
    tokens: int = 0
    worker_pids: set = field(default_factory=set)   # processes that computed segments

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def compute_tokens_per_s(self) -> float:
        return self.tokens / self.compute_seconds if self.compute_seconds else 0.0


class _Worker:
    """A Ray actor: one Memory (one model) on the store; computes and commits segments."""

    def __init__(self, store: str, model, segment_blocks, storage_options, threads: int | None, hook) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from kvmemory.memory import Memory

        kw = {"storage_options": storage_options} if storage_options else {}
        self.mem = Memory(store, model=model, segment_blocks=segment_blocks, **kw)
        self.hook = hook
        self.pid = os.getpid()

    def ready(self) -> int:
        return self.pid

    def compute(self, key: tuple[int, int], seg: list[int]) -> dict:
        t = time.perf_counter()
        hook = None if self.hook is None else (lambda: self.hook(key))
        rows, kv = self.mem.documents.compute_segment(seg, before_commit=hook)
        return {"key": key, "computed": kv is not None, "pid": self.pid, "seconds": time.perf_counter() - t}


def ray_add(store, files, address: str | None = None, workers: int = 2, model=None,
            segment_blocks: int | None = None, storage_options: dict | None = None, threads_per_worker: int | None = None,
            num_gpus_per_worker: float | None = None, progress: bool = False, hook=None, max_restarts: int = 8,
            mem=None) -> RayAddReport:
    """Deposit `files` (their names are the doc ids) with segments computed by `workers` Ray actors.

    address: a Ray cluster ("auto", "ray://host:10001", ...) or None for a local one. GPUs are
    given to workers where the cluster has them (num_gpus_per_worker, default 1 if any).
    hook(key), if given, runs in a worker between a segment's prefill and its commit (tests
    use it to kill a worker mid-segment).

    threads_per_worker: the CPUs Ray reserves for a worker and its torch threads. By default a
    worker reserves 1 CPU but runs as many torch threads as this process: on CPU the bytes of
    a block depend on the thread count (a partial block's reductions split differently), and
    with equal counts a worker stores exactly the bytes a local `add` would. Returns a RayAddReport; raises KVMemoryError if a
    segment fails more than max_restarts times.
    """
    from kvmemory.documents import read_files, text_ids
    from kvmemory.memory import Memory

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers must be an integer >= 1, got {workers!r}")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InputError("with --ray, model must be a directory every worker can load")
    paths, texts = read_files(files)
    ray = _ray()
    t0 = time.perf_counter()
    owns = mem is None
    if owns:
        kw = {"storage_options": storage_options} if storage_options else {}
        mem = Memory(store, model=model, segment_blocks=segment_blocks, **kw)
    report = RayAddReport()
    try:
        manifest = mem.require_store().manifest
        mem.require_store().refresh()
        for p in paths:
            if p.name in manifest.docs:
                raise InputError(f"document {p.name!r} already exists; remove it first")
        docs = mem.documents
        docs.prelude_state()                     # saved once, before any worker needs it
        seg_of = [docs.segments(text_ids(mem.tokenizer, t)) for t in texts]
        tasks = {(d, i): seg for d, segs in enumerate(seg_of) for i, seg in enumerate(segs)}
        report.segments = len(tasks)
        report.tokens = sum(len(s) for s in tasks.values())
        started = ray.is_initialized()
        if not started:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
        gpus = num_gpus_per_worker
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        Actor = ray.remote(max_restarts=0, max_task_retries=0)(_Worker)
        opts = {"num_cpus": threads_per_worker or 1, "num_gpus": gpus}
        import torch

        threads = threads_per_worker or torch.get_num_threads()
        model_arg = None if model is None else str(model)    # a path each worker loads
        seg_blocks = mem.documents.segment_blocks
        n = max(1, min(workers, len(tasks)))
        report.workers = n

        def spawn():
            return Actor.options(**opts).remote(str(store), model_arg, seg_blocks, storage_options, threads, hook)
        pool = [spawn() for _ in range(n)]
        try:
            ray.get([a.ready.remote() for a in pool])   # every worker has loaded its model
        except ray.exceptions.RayActorError as e:
            raise KVMemoryError(f"a Ray worker could not start: {str(e).strip().splitlines()[-1][:500]}") from None
        t_ready = time.perf_counter()
        todo = list(tasks)
        running: dict = {}                          # object ref -> (actor index, key)
        failures: dict = {}
        done_keys: set = set()
        next_doc = 0
        bar = None
        if progress:
            import sys

            from tqdm import tqdm
            bar = tqdm(total=report.tokens, unit="tok", desc="ray add", disable=not sys.stderr.isatty())
        idle = list(range(n))
        try:
            while todo or running:
                while todo and idle:
                    a = idle.pop()
                    key = todo.pop(0)
                    running[pool[a].compute.remote(key, tasks[key])] = (a, key)
                ready, _ = ray.wait(list(running), num_returns=1)
                ref = ready[0]
                a, key = running.pop(ref)
                try:
                    out = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                    failures[key] = failures.get(key, 0) + 1
                    if failures[key] > max_restarts:
                        raise KVMemoryError(f"segment {key[1]} of {paths[key[0]].name} failed {failures[key]} times; "
                                            f"last: {type(e).__name__}") from None
                    report.restarts += 1
                    pool[a] = spawn()           # a new worker; the segment is handed out again
                    todo.insert(0, key)
                    idle.append(a)
                    continue
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if isinstance(getattr(e, "cause", None), KVMemoryError) else None
                    if cause is not None:
                        raise cause from None
                    raise KVMemoryError(f"segment {key[1]} of {paths[key[0]].name} failed: {e}") from None
                idle.append(a)
                done_keys.add(key)
                report.computed += bool(out["computed"])
                if out["computed"]:
                    report.worker_pids.add(out["pid"])
                if bar is not None:
                    bar.update(len(tasks[key]))
                # documents become visible in file order, each once all its segments are stored
                while next_doc < len(paths) and all((next_doc, i) in done_keys for i in range(len(seg_of[next_doc]))):
                    p = paths[next_doc]
                    report.docs.append(mem.add(texts[next_doc], doc_id=p.name, source=str(p)))
                    next_doc += 1
            report.compute_seconds = time.perf_counter() - t_ready
        finally:
            if bar is not None:
                bar.close()
            for actor in pool:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
            if not started:
                ray.shutdown()
    finally:
        if owns:
            mem.close()
    report.seconds = time.perf_counter() - t0
    return report
