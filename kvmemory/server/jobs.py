"""Deposit jobs: persisted in STORE/serve/jobs.json, their texts in STORE/serve/uploads/ until done,
run one at a time on the deposit thread; a job a restart interrupted is queued again and resumes
(Memory.add does not recompute the segments already committed)."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from pathlib import Path

from kvmemory.server.persist import JsonFile
from kvmemory.threads import release as release_team


class Jobs:
    def __init__(self, root: Path, prefix: str = "job-", seal=None) -> None:
        self.seal = seal                     # an encrypted store's: jobs and uploads sealed by its key
        self.file = JsonFile(root / "jobs.json", seal)
        self.uploads = root / "uploads"
        self.prefix = prefix
        self.on_done = None                  # on_done(ok, tokens, seconds) after each job (the server's metrics)
        self.jobs: dict[str, dict] = self.file.load()
        self.queue: "queue.Queue[str]" = queue.Queue()
        for jid, job in sorted(self.jobs.items(), key=lambda kv: kv[1]["created"]):
            if job["status"] in ("queued", "running"):       # interrupted by a restart: resume
                job["status"] = "queued"
                self.queue.put(jid)
        self.flush()

    def flush(self) -> None:
        with self.file.lock:
            self.file.save(self.jobs)

    def create(self, text: str, doc_id: str, source: str) -> dict:
        jid = self.prefix + uuid.uuid4().hex[:16]
        self.uploads.mkdir(parents=True, exist_ok=True)
        JsonFile(self.uploads / f"{jid}.json", self.seal).save({"text": text})
        job = {"id": jid, "doc_id": doc_id, "source": source, "status": "queued", "created": time.time(),
               "progress": {"tokens_done": 0, "tokens_total": None}, "error": None}
        self.jobs[jid] = job
        self.flush()
        self.queue.put(jid)
        return job

    def text(self, jid: str) -> str:
        return JsonFile(self.uploads / f"{jid}.json", self.seal).load()["text"]

    def pending(self, doc_id: str) -> bool:
        """True if a queued or running job deposits doc_id."""
        return any(j["doc_id"] == doc_id and j["status"] in ("queued", "running") for j in self.jobs.values())

    @staticmethod
    def public(job: dict) -> dict:
        return {k: job[k] for k in ("id", "doc_id", "status", "progress", "error", "created")}

    def run(self, mem, stop: threading.Event) -> None:
        """The deposit thread: one job at a time until `stop` is set."""
        while not stop.is_set():
            try:
                jid = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            job = self.jobs[jid]
            job["status"] = "running"
            self.flush()
            t0, tokens = time.perf_counter(), 0
            try:
                if job["doc_id"] not in {d.doc_id for d in mem.docs()}:
                    tokens = mem.add(self.text(jid), doc_id=job["doc_id"], source=job["source"],
                                     progress=_Progress(job, self)).n_tokens
                job["status"] = "done"
                job["progress"]["tokens_done"] = job["progress"]["tokens_total"] or job["progress"]["tokens_done"]
                (self.uploads / f"{jid}.json").unlink(missing_ok=True)
            except Exception as e:   # noqa: BLE001 -- a failed job reports why; the server goes on
                job["status"] = "failed"
                job["error"] = f"{type(e).__name__}: {e}"
            finally:
                if self.on_done is not None:
                    self.on_done(job["status"] == "done", tokens, time.perf_counter() - t0)
                release_team()       # no idle OpenMP team beside the threads serving (kvmemory/threads.py)
            self.flush()


class _Progress:
    """The progress object Memory.add drives (total, update(n)); persisted every few seconds."""

    def __init__(self, job: dict, jobs: Jobs) -> None:
        self.job, self.jobs, self.last = job, jobs, 0.0
        self._total = None

    @property
    def total(self):
        return self._total

    @total.setter
    def total(self, n) -> None:
        self._total = n
        self.job["progress"]["tokens_total"] = n

    def refresh(self) -> None:
        pass

    def update(self, n: int) -> None:
        self.job["progress"]["tokens_done"] += int(n)
        if time.monotonic() - self.last > 2.0:
            self.last = time.monotonic()
            self.jobs.flush()
