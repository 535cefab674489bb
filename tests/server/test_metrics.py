"""GET /metrics: the Prometheus text format, parsed with prometheus-client's own parser; its counters
move with the requests (chat, ask, deposits, 404s, forgets) and it is behind the API key like the rest."""

from __future__ import annotations

import time

import httpx
import pytest

import kvmemory
from tests.server.test_server import serving

pytest.importorskip("prometheus_client")


def scrape(url: str, **kw) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(url + "/metrics", timeout=30, **kw)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in m.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_metrics_parse_and_move_with_the_requests(tmp_path, tiny):
    with serving(kvmemory.Memory(tmp_path / "s.kvm", model=tiny, segment_blocks=1), max_body_bytes=1 << 20) as url:
        before = scrape(url)
        assert value(before, "kvmemory_requests_total") == 0 and value(before, "kvmemory_store_blocks") == 0
        r = httpx.post(url + "/v1/documents", json={"doc_id": "d", "text": "The vault code is 4417. " * 40},
                       timeout=60)
        job = r.json()["job_id"]
        while httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json()["status"] not in ("done", "failed"):
            time.sleep(0.2)
        httpx.post(url + "/v1/ask", json={"question": "What is the vault code?", "max_new_tokens": 4}, timeout=60)
        for _ in range(2):
            httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "kvmemory", "max_tokens": 3, "user": "ada",
                "messages": [{"role": "user", "content": "My vault code is 4417."}]})
        httpx.get(url + "/nowhere", timeout=30)
        httpx.delete(url + "/v1/users/ada", timeout=60)
        m = scrape(url)
        assert value(m, "kvmemory_requests_total", route="/v1/chat/completions", status="200") == 2
        assert value(m, "kvmemory_requests_total", route="/v1/ask", status="200") == 1
        assert value(m, "kvmemory_requests_total", route="unmatched", status="404") == 1
        assert value(m, "kvmemory_request_seconds_count", route="/v1/chat/completions") == 2
        assert value(m, "kvmemory_time_to_first_token_seconds_count", endpoint="chat") == 2
        assert value(m, "kvmemory_time_to_first_token_seconds_count", endpoint="ask") == 1
        assert value(m, "kvmemory_tokens_total", endpoint="chat", kind="decoded") >= 2
        assert value(m, "kvmemory_tokens_total", endpoint="ask", kind="restored") > 0
        assert value(m, "kvmemory_deposits_total", status="done") == 1 and value(m, "kvmemory_deposit_tokens_total") > 0
        assert value(m, "kvmemory_chat_memory_recalls_total") == 2 and value(m, "kvmemory_chat_memory_forgets_total") == 1
        assert value(m, "kvmemory_store_blocks") > 0 and value(m, "kvmemory_store_bytes") > 0
        assert value(m, "kvmemory_pager_misses_total", tier="host") > 0        # ask read its blocks through it
        assert value(m, "kvmemory_queue_depth") == 0


def test_metrics_are_behind_the_api_key(tmp_path, tiny):
    with serving(kvmemory.Memory(tmp_path / "s.kvm", model=tiny), api_key="sesame") as url:
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401
        m = scrape(url, headers={"authorization": "Bearer sesame"})
        assert value(m, "kvmemory_requests_total", route="unmatched", status="401") == 1    # the refused scrape


def test_metrics_switched_off_record_nothing_and_serve_nothing(tmp_path, tiny):
    with serving(kvmemory.Memory(tmp_path / "s.kvm", model=tiny), metrics=False) as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "kvmemory", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
        m = httpx.get(url + "/metrics", timeout=30)
        assert m.status_code == 200 and m.text == ""


def test_every_request_has_an_id_on_its_response_and_its_log_lines(tmp_path, tiny):
    """X-Request-Id: the client's when it sends a sane one, else a new one; returned, and on the access
    line and on every line logged while the request is served (the worker thread included), as JSON."""
    import io
    import json
    import logging

    from kvmemory.cli.serve import FORMATS, LEVELS
    from kvmemory.server import logs
    assert (LEVELS, FORMATS) == (logs.LEVELS, logs.FORMATS)
    out = io.StringIO()
    handler = logs.configure("info", "json", stream=out)
    seen = []
    probe = logging.getLogger("kvmemory.probe")
    from kvmemory.server import chat as chat_module
    real = chat_module.ChatService.complete

    def complete(self, p, emit, cancel):              # a line logged on the worker thread, mid-request
        probe.info("decoding")
        seen.append(logs.REQUEST_ID.get())
        return real(self, p, emit, cancel)
    chat_module.ChatService.complete = complete
    try:
        with serving(kvmemory.Memory(tmp_path / "s.kvm", model=tiny)) as url:
            r = httpx.post(url + "/v1/chat/completions", headers={"X-Request-Id": "client-42"}, timeout=60,
                           json={"model": "kvmemory", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.headers["x-request-id"] == "client-42" and seen == ["client-42"]
            made = httpx.get(url + "/health", headers={"X-Request-Id": "no\tgood"}, timeout=30).headers["x-request-id"]
            assert made != "no\tgood" and len(made) == 32
            lines = [json.loads(x) for x in out.getvalue().splitlines()]
            mine = [x for x in lines if x["request_id"] == "client-42"]
            assert {x["logger"] for x in mine} >= {"kvmemory.probe", "kvmemory.access"}
            acc = next(x for x in mine if x["logger"] == "kvmemory.access")
            assert acc["status"] == 200 and acc["path"] == "/v1/chat/completions" and acc["duration_ms"] > 0
            assert any(x["request_id"] == made and x.get("path") == "/health" for x in lines)
    finally:
        chat_module.ChatService.complete = real
        for name in ("kvmemory", "uvicorn", "uvicorn.error"):
            lg = logging.getLogger(name)
            lg.handlers = [h for h in lg.handlers if h is not handler]
            lg.propagate = True
            lg.setLevel(logging.NOTSET)
        logging.getLogger("uvicorn.access").disabled = False
