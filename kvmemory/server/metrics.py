"""What an operator scrapes: GET /metrics in the Prometheus text format (behind the API key like the rest).

    kvmemory_requests_total{route,method,status}     every HTTP request (429s among them)
    kvmemory_request_seconds{route}                  latency to the response's start (histogram)
    kvmemory_time_to_first_token_seconds{endpoint}   chat and ask (histogram)
    kvmemory_tokens_total{endpoint,kind}             restored (from the store), grafted, recomputed,
                                                     prefilled, decoded
    kvmemory_deposits_total{status}, kvmemory_deposit_tokens_total, kvmemory_deposit_seconds_total
    kvmemory_chat_memory_recalls_total, kvmemory_chat_memory_recalled_turns_total, ..._forgets_total
    read at scrape time: kvmemory_queue_depth, kvmemory_batch_steps_total and kvmemory_batch_rows_total
    (the decode loop's steps and sequences x steps: their rates' ratio is the mean batch size),
    kvmemory_store_blocks, kvmemory_store_bytes, kvmemory_pager_{hits,misses,evictions}_total{tier},
    kvmemory_pager_bytes{tier}

Recording is a few dictionary updates a request: its cost on requests/s is measured in the docs."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_KINDS = ("restored", "grafted", "recomputed", "prefilled", "decoded")


class _Live:
    """The gauges read when a scrape comes: the queue, the batch, the store, the pager's tiers."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self.read = read

    def collect(self):
        s = self.read()
        yield GaugeMetricFamily("kvmemory_queue_depth", "requests admitted and not finished", value=s["queue"])
        yield CounterMetricFamily("kvmemory_batch_steps", "steps of the shared decode loop", value=s["steps"])
        yield CounterMetricFamily("kvmemory_batch_rows", "sequences x steps of the shared decode loop (rows / steps: "
                                  "the mean batch size)", value=s["rows"])
        yield GaugeMetricFamily("kvmemory_store_blocks", "blocks committed to the store", value=s["blocks"])
        yield GaugeMetricFamily("kvmemory_store_bytes", "bytes the store takes on disk", value=s["bytes"])
        fams = {k: CounterMetricFamily(f"kvmemory_pager_{k}", f"pager {k} per tier", labels=["tier"])
                for k in ("hits", "misses", "evictions")}
        used = GaugeMetricFamily("kvmemory_pager_bytes", "bytes held per pager tier", labels=["tier"])
        for tier, st in s["tiers"].items():
            for k, fam in fams.items():
                fam.add_metric([tier], st.get(k, 0))
            used.add_metric([tier], st.get("used_bytes", 0))
        yield from fams.values()
        yield used


class Metrics:
    """The server's metrics, in a registry of their own (two apps in one process do not mix)."""

    def __init__(self, live: Callable[[], dict], enabled: bool = True) -> None:
        """enabled=False (serve --no-metrics): nothing is recorded and /metrics is empty (the cost of the
        metrics, measured by bench_serve.py's `m` setting)."""
        self.enabled = enabled
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmemory_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("kvmemory_request_seconds", "time to the response's start", ["route"],
                                 buckets=LATENCY, registry=r)
        self.ttft = Histogram("kvmemory_time_to_first_token_seconds", "time to the first token", ["endpoint"],
                              buckets=LATENCY, registry=r)
        self.tokens = Counter("kvmemory_tokens", "tokens by endpoint and kind (restored from the store, grafted, "
                              "recomputed, prefilled, decoded)", ["endpoint", "kind"], registry=r)
        self.deposits = Counter("kvmemory_deposits", "document deposits by outcome", ["status"], registry=r)
        self.deposit_tokens = Counter("kvmemory_deposit_tokens", "tokens deposited", registry=r)
        self.deposit_seconds = Counter("kvmemory_deposit_seconds", "seconds spent depositing", registry=r)
        self.recalls = Counter("kvmemory_chat_memory_recalls", "chat requests that read a memory", registry=r)
        self.recalled = Counter("kvmemory_chat_memory_recalled_turns", "earlier turns recalled", registry=r)
        self.forgets = Counter("kvmemory_chat_memory_forgets", "users or sessions forgotten", registry=r)
        r.register(_Live(live))

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        if not self.enabled:
            return
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def answered(self, endpoint: str, ttft_s: float | None, **tokens: int) -> None:
        """A chat completion or an ask: its time to first token and its tokens by kind."""
        if not self.enabled:
            return
        if ttft_s is not None:
            self.ttft.labels(endpoint).observe(ttft_s)
        for kind in TOKEN_KINDS:
            n = tokens.get(kind) or 0
            if n:
                self.tokens.labels(endpoint, kind).inc(n)

    def deposited(self, ok: bool, tokens: int, seconds: float) -> None:
        if not self.enabled:
            return
        self.deposits.labels("done" if ok else "failed").inc()
        if ok:
            self.deposit_tokens.inc(tokens)
            self.deposit_seconds.inc(seconds)

    def remembered(self, memory: dict | None) -> None:
        """A chat request's `kvmemory` object: a memory was read, and how many turns came back."""
        if memory is not None and self.enabled:
            self.recalls.inc()
            self.recalled.inc(len(memory.get("recalled", [])))

    def forgot(self) -> None:
        if self.enabled:
            self.forgets.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) if self.enabled else b""
