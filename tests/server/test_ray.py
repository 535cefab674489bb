"""`kvmemory serve --ray`: the HTTP server as Ray Serve replicas over one store, on a local Ray
cluster and a real HTTP proxy: a chat session always reaches the same replica (the one its
rendezvous hash picks), deposit jobs are polled on the replica that runs them, every replica
answers from the shared store, and streaming passes through."""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from kvmemory.server.ray import order, route_key, serve_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_dir):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = tmp_path_factory.mktemp("serve-ray") / "s.kvm"
    serve_ray(store, port=port, replicas=2, model=tiny_dir, blocking=False)
    yield httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    serve.shutdown()
    ray.shutdown()


def _sessions_for_each_replica(n=2, per=2):
    out: dict[int, list[str]] = {i: [] for i in range(n)}
    k = 0
    while any(len(v) < per for v in out.values()):
        sid = f"user-{k}"
        r = order(f"session:{sid}", n)[0]
        if len(out[r]) < per:
            out[r].append(sid)
        k += 1
    return out


def test_route_keys():
    assert route_key("GET", "/v1/jobs/job-r3-abc", {}, b"") == "rank:3"
    assert route_key("POST", "/v1/chat/completions", {}, b'{"prompt_cache_key": "s1"}') == "session:s1"
    assert route_key("POST", "/v1/chat/completions", {"x-session-id": "h"}, b'{"user": "u"}') == "session:h"
    assert route_key("DELETE", "/v1/sessions/abc", {}, b"") == "session:abc"
    assert route_key("POST", "/v1/ask", {}, b'{"question": "q"}') == ""
    assert route_key("POST", "/v1/chat/completions", {}, b"not json") == ""
    assert sorted(order("session:x", 3)) == [0, 1, 2] and order("session:x", 3) == order("session:x", 3)


def test_a_session_always_reaches_its_replica(cluster):
    assert cluster.get("/health").status_code == 200
    for replica, sids in _sessions_for_each_replica().items():
        for sid in sids:
            got = set()
            for turn in range(3):
                r = cluster.post("/v1/chat/completions", json={
                    "model": "kvmemory", "max_tokens": 3, "prompt_cache_key": sid,
                    "messages": [{"role": "user", "content": f"turn {turn} of {sid}"}]})
                assert r.status_code == 200, r.text
                got.add(int(r.headers["x-kvmemory-replica"]))
            assert got == {replica}
            s = cluster.get(f"/v1/sessions/{sid}")                 # its record lives on that replica
            assert s.status_code == 200 and s.json()["turns"] == 3 and s.headers["x-kvmemory-replica"] == str(replica)


def test_jobs_are_polled_on_their_replica_and_every_replica_answers_from_the_store(cluster):
    text = " ".join(f"The brass key number {i} opens locker {i * 3}." for i in range(60))
    r = cluster.post("/v1/documents", json={"text": text, "doc_id": "lockers"})
    assert r.status_code == 202, r.text
    job = r.json()["job_id"]
    assert job.startswith("job-r")
    deadline = time.monotonic() + 120
    while True:
        r = cluster.get(f"/v1/jobs/{job}")
        assert r.status_code == 200 and r.headers["x-kvmemory-replica"] == job[5]
        if r.json()["status"] in ("done", "failed") or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.json()["status"] == "done", r.json()
    answers = []
    for replica, sids in _sessions_for_each_replica(per=1).items():
        r = cluster.post("/v1/ask", json={"question": "Which locker does key 7 open?", "max_new_tokens": 4},
                         headers={"x-session-id": sids[0]})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvmemory-replica"] == str(replica)
        answers.append((r.json()["answer"], [s["doc_id"] for s in r.json()["sources"]]))
    assert answers[0] == answers[1] and answers[0][1][0] == "lockers"


def test_openai_client_streams_through_the_router(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=str(cluster.base_url) + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="kvmemory", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=4, stream=True))
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason in ("stop", "length")
