"""Schemathesis against the live server's OpenAPI schema (bounded for CI): generated paths and request
bodies for every operation, no 5xx, and every status the server answers is one its schema documents.
KVMEMORY_SCHEMA_EXAMPLES raises the bound (cases per operation)."""

import os
import threading
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, settings  # noqa: E402

import kvmemory  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory, tiny):
    import uvicorn

    from kvmemory.server import create_app
    mem = kvmemory.Memory(tmp_path_factory.mktemp("schema") / "s.kvm", model=tiny)
    srv = uvicorn.Server(uvicorn.Config(create_app(mem, queue_size=8), host="127.0.0.1", port=0,
                                        log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    yield schemathesis.openapi.from_url(url + "/openapi.json"), url
    srv.should_exit = True
    t.join(timeout=10)
    mem.close()


def test_every_post_declares_its_request_body(api_schema):
    import httpx
    _, url = api_schema
    spec = httpx.get(url + "/openapi.json").json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert len(posts) >= 5
    for path, op in posts.items():
        content = op.get("requestBody", {}).get("content", {})
        assert content, f"POST {path} declares no request body"
        for media, body in content.items():
            assert body.get("schema"), f"POST {path} ({media}) has no schema"


def test_no_server_error_and_only_documented_statuses(api_schema):
    from hypothesis import given
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import status_code_conformance
    schema, _ = api_schema
    examples = int(os.environ.get("KVMEMORY_SCHEMA_EXAMPLES", "25"))
    ran, cases, with_body = 0, [0], [0]
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            cases[0] += 1
            with_body[0] += case.operation.method.upper() == "POST"
            case.call_and_validate(checks=[not_a_server_error, status_code_conformance], timeout=60)
        check()
        ran += 1
    print(f"\nschemathesis: {cases[0]} cases over {ran} operations, {with_body[0]} with a generated body")
    assert ran >= 10                                   # every route of the server was exercised
    assert with_body[0] >= 5 * examples // 2           # POST bodies were generated, not only paths


@pytest.mark.parametrize("body,param", [
    ({"seed": 1208925819614629174706176}, "seed"),                       # past 64 bits
    ({"seed": -(2**63) - 1}, "seed"),
    ({"messages": [{"role": "user", "content": "hi \ud800 there"}]}, "messages"),   # a lone surrogate
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
    ({"stop": ["ok", "\ud834"]}, "stop"),
    ({"user": "ada\udc00"}, "user"),
])
def test_values_no_tokenizer_or_generator_can_take_are_400s_naming_the_parameter(api_schema, body, param):
    """Found by a careless client: a seed past 64 bits and a message holding a lone UTF-16 surrogate
    were 500s deep in torch and the tokenizer; they are 400s naming the parameter."""
    import json

    import httpx
    _, url = api_schema
    req = {"model": "kvmemory", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body}
    # json.dumps writes the lone surrogate as a \\ud800 escape, as a client's JSON encoder does
    r = httpx.post(url + "/v1/chat/completions", content=json.dumps(req), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_the_widest_seeds_torch_takes_are_served(api_schema):
    import httpx
    _, url = api_schema
    for seed in (2**64 - 1, -(2**63)):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "kvmemory", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0.7, "seed": seed})
        assert r.status_code == 200, r.text


# valid bodies of every POST, each field of which the hostile fuzz below replaces with a value a careless
# or hostile client sends (cheap to serve: one token at most)
BODIES = {
    "/v1/chat/completions": {"model": "kvmemory", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                             "temperature": 0.5, "seed": 3, "top_p": 0.9, "n": 1, "stop": ["x"], "user": "u",
                             "logprobs": False, "top_k": 5, "presence_penalty": 0.1, "logit_bias": {"5": 1}},
    "/v1/completions": {"model": "kvmemory", "prompt": "hi", "max_tokens": 1, "temperature": 0.5, "seed": 3,
                        "top_p": 0.9, "stop": "x", "logprobs": 1, "min_p": 0.1},
    "/tokenize": {"model": "kvmemory", "prompt": "hi"},
    "/detokenize": {"model": "kvmemory", "tokens": [5, 6]},
    "/v1/ask": {"question": "hi?", "max_new_tokens": 1, "top_k": 1, "rerank": 0, "recompute": 0.0},
    "/v1/documents": {"text": "a few words", "doc_id": "d"},
    "/v1/learn": {"problem": "p", "solution": "s"},
    "/v1/solve": {"problem": "p", "max_new_tokens": 1},
}


def _hostile():
    from hypothesis import strategies as st
    big = st.integers(min_value=2**63, max_value=2**200) | st.integers(min_value=-(2**200), max_value=-(2**63) - 1)
    surrogate = st.sampled_from(["\ud800", "a\udfffb", "\udc00" * 3, "x\ud834"])
    return st.one_of(
        big,
        st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324]),
        surrogate,
        st.lists(surrogate, min_size=1, max_size=3),
        st.builds(lambda n, c: c * n, st.integers(20_000, 200_000), st.sampled_from(["a", "é", "\u4e00", " "])),
        st.just([[[[[[[[[[[]]]]]]]]]]]),
        st.dictionaries(st.text(max_size=5), big | surrogate, max_size=3),
        st.sampled_from([None, True, -1, 0, "", [], {}]),
    )


def test_hostile_values_in_every_field_of_every_post_are_never_a_server_error(api_schema):
    """Big integers past 64 bits, lone surrogates, NaN and infinities, huge strings, deep nesting, wrong types:
    in every field of every POST (and in each message's content), a 4xx or a 200, never a 5xx."""
    import json

    import httpx
    from hypothesis import example, given, strategies as st
    _, url = api_schema
    examples = int(os.environ.get("KVMEMORY_SCHEMA_EXAMPLES", "25")) * 6
    statuses: dict = {}
    fields = [(p, k) for p, b in BODIES.items() for k in b] + [("/v1/chat/completions", "messages.0.content")]

    @given(target=st.sampled_from(fields), value=_hostile())
    # found by this test: a subnormal temperature overflowed logits / T into NaN, a 500 (decode.tempered)
    @example(target=("/v1/completions", "temperature"), value=5e-324)
    @example(target=("/v1/chat/completions", "temperature"), value=5e-324)
    # and a subnormal top_p rounded to 0 in float32 kept no token at all (decode.sample)
    @example(target=("/v1/completions", "top_p"), value=5e-324)
    @example(target=("/v1/chat/completions", "top_p"), value=5e-324)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(target, value):
        path, key = target
        body = json.loads(json.dumps(BODIES[path]))
        if key == "messages.0.content":
            body["messages"][0]["content"] = value
        else:
            body[key] = value
        r = httpx.post(url + path, content=json.dumps(body, allow_nan=True), timeout=120,
                       headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, key, repr(value)[:200], r.text[:500])
    check()
    print(f"\nhostile fuzz: {sum(statuses.values())} requests over {len(fields)} fields, statuses {statuses}")
    assert sum(v for s, v in statuses.items() if 400 <= s < 500) > 0
