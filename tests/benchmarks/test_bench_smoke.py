"""bench_flat_access.py, bench_qa.py, bench_invariant.py, bench_select.py, bench_codec.py, bench_lexical.py, bench_models.py and
bench_serve.py run end to end at a tiny size (so they do not rot), and what they report holds: the window's grafted
tokens stay within ask's budget at every size, a kept deposit is reused by a run that draws the same text,
invariant mode is exact, probing every IVF list is the exact search, the compact tier is half the
bytes at a small, measured error, the in-place BM25 ranks as bm25s rebuilt, and a live server answers under load
and restores a conversation it has seen."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clirun import run_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_bench_flat_access_reports_a_bounded_window(tmp_path):
    out = tmp_path / "flat.json"
    p = run_script([sys.executable, "benchmarks/bench_flat_access.py", "--tokens", "2048,8192", "--questions", "3",
                    "--top-k", "2,8", "--no-faiss", "--reread", "on,off", "--json", str(out), "--dir", str(tmp_path)],
                   cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert sorted((r["store_tokens"], r["top_k"], r["reread"]) for r in res["rows"]) == \
        sorted((n, k, rr) for n in (2048, 8192) for k in (2, 8) for rr in (True, False))
    for r in res["rows"]:
        assert 0 < r["window_tokens_max"] <= r["max_context_tokens"]
        assert r["reread_share"] == 0 if not r["reread"] else 0 <= r["reread_share"] <= 1
        assert r["ask_ms_p10"] <= r["ask_ms_median"] <= r["ask_ms_p90"] and len(r["ask_ms_all"]) == 3
        assert 0 <= r["reranked_share"] <= 1 and (r["rerank_ms_mean"] > 0) == (r["reranked_share"] > 0)
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.real_model
def test_bench_qa_reuses_a_kept_deposit(tmp_path):
    def run(tag):
        return run_script([sys.executable, "benchmarks/bench_qa.py", "--sizes", "1500", "--questions", "2",
                           "--configs", "k2,k2-rr4-m0.1,k2-s16-last", "--methods", "rag", "--selectors", "bm25",
                           "--max-new-tokens", "4", "--seed", "7", "--keep", str(tmp_path / "kept"),
                           "--generators", "mixed,records",
                           "--out", str(tmp_path), "--tag", tag], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    first, second = run("a"), run("b")
    assert first.returncode == 0 and second.returncode == 0, (first.stderr + second.stderr)[-3000:]
    a, b = (json.loads(next(tmp_path.glob(f"qa-*-{t}.json")).read_text()) for t in ("a", "b"))
    assert a["rows"][0]["deposits_reused"] == 0 and b["rows"][0]["deposits_reused"] == a["rows"][0]["haystacks"]
    assert a["prose"] == "stdlib"                                                # the default haystack prose
    assert "reusing the deposit" in second.stderr
    ma, mb = a["rows"][0]["methods"], b["rows"][0]["methods"]
    assert set(ma) == set(mb) == {"rag", "kvm-k2", "kvm-k2-rr4-m0.1", "kvm-k2-s16-last"}
    assert ma["kvm-k2"]["paired_vs_first_config"] == [0, 0] and ma["rag"]["seamed_share"] == 0
    assert ma["rag"]["paired_vs_rag"] == [0, 0] and sum(ma["kvm-k2"]["paired_vs_rag"]) <= 4
    assert all(v["ttft_p90_s"] >= v["ttft_median_s"] > 0 for v in ma.values())
    assert a["configs"]["kvm-k2"]["rerank"] == 0 and a["configs"]["kvm-k2-rr4-m0.1"]["rerank"] == 4
    assert a["configs"]["kvm-k2-s16-last"]["seam"] == 16 and a["configs"]["kvm-k2-s16-last"]["order"] == "best_last"
    assert [e["replies"] for e in a["rows"][0]["examples"]] == [e["replies"] for e in b["rows"][0]["examples"]]
    # one row per generator, then the pooled row: its counts are the generators' summed
    assert [r["generator"] for r in a["rows"]] == ["mixed", "records", "pooled"]
    mixed, records, pooled = a["rows"]
    assert pooled["questions"] == mixed["questions"] + records["questions"]
    assert {e["shape"] for e in records["examples"]} == {"records"}
    for m in pooled["methods"]:
        assert pooled["methods"][m]["correct"] == mixed["methods"][m]["correct"] + records["methods"][m]["correct"]
    assert pooled["methods"]["kvm-k2"]["paired_vs_no_rerank"] == [0, 0]          # k2 is the no-re-rank config
    assert 0 < pooled["methods"]["kvm-k2-rr4-m0.1"]["sign_p_vs_no_rerank"] <= 1


@pytest.mark.real_model
def test_bench_invariant_runs_and_finds_only_the_invariant_mode_exact(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_invariant.py", "--tokens", "300", "--decode", "3",
                    "--batch", "2", "--reps", "1", "--out", str(tmp_path), "--seed", "3"],
                   cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("invariant-*.json")).read_text())
    inv, default = res["modes"]["invariant"], res["modes"]["default"]
    assert inv["chunked_equals_one_pass"] and inv["chunked_max_abs_diff"] == 0.0 and inv["batched_replies_differ"] == 0
    assert default["decode_alone_tok_s"] > 0 and default["prefill_chunked_tok_s"] > 0
    assert set(res["invariant_over_default"]) == {"prefill_one_pass_tok_s", "prefill_chunked_tok_s",
                                                  "decode_alone_tok_s", "decode_batch_tok_s"}
    assert next(tmp_path.glob("invariant-*.png")).stat().st_size > 0


def test_bench_select_sweeps_ivf_probes(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_select.py", "--sizes", "16384", "--questions", "5",
                    "--nprobe", "2,1000", "--hnsw-ef", "4,1000", "--out", str(tmp_path), "--seed", "4"],
                   cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads(next(tmp_path.glob("select-*.json")).read_text())["rows"][0]
    few, every = row["ivf_sweep"]
    assert few["nprobe"] == 2 and every["nprobe"] == row["ivf_nlist"]           # capped at the lists there are
    assert every["top_window_overlap_with_flat"] == 1.0                          # every list probed: exact
    assert every["recall_at_pool_by_score"] == 1.0
    assert few["top_window_overlap_with_flat"] < 1.0 and few["recall_at_pool_by_score"] < 1.0
    assert row["flat16"]["recall_at_pool_by_score"] == 1.0                       # fp16 codes: still a full scan
    assert row["flat16"]["top_window_overlap_with_flat"] > 0.9 and row["latency_ms_median"]["flat_scan"] > 0
    narrow, wide = row["hnsw_sweep"]                                             # HNSW: recall grows with efSearch
    assert narrow["recall_at_pool_by_score"] < wide["recall_at_pool_by_score"] and wide["recall_at_pool_by_score"] > 0.95
    assert 0 < row["unique_windows"] <= row["windows"] and row["prose"] == "stdlib"


@pytest.mark.real_model
def test_bench_codec_measures_the_compact_tier_against_the_exact_store(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_codec.py", "--tokens", "700", "--reps", "1",
                    "--out", str(tmp_path), "--seed", "5"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("codec-*.json")).read_text())
    raw = next(s for s in res["store"] if s["codec"] == "none")
    assert [c["encoding"] for c in res["compact"]] == ["bf16", "fp16"]
    for c in res["compact"]:
        assert 0.4 < c["disk_bytes"] / raw["disk_bytes"] < 0.6 and c["blocks"] > raw["blocks"]   # + the prelude
        assert 0 < c["kl_mean"] <= c["kl_max"] < 1e-2 and 0 < c["fresh_suffix_kl_per_token_max"] < 1e-2
        assert c["chains_same_top1"] <= c["chains"] and c["chains"] >= 2 and c["decode_GBps"] > 0
    bf16, fp16 = res["compact"]
    assert fp16["key_rel_error_max"] < bf16["key_rel_error_max"]      # 11 significant bits against 8


def test_bench_lexical_compares_the_rebuilt_and_the_in_place_bm25(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_lexical.py", "--sizes", "300,900", "--reps", "4",
                    "--out", str(tmp_path), "--seed", "6"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("lexical-*.json")).read_text())
    assert [r["windows"] for r in res["rows"]] == [300, 900]
    for r in res["rows"]:
        assert r["same_top8"] == r["reps"] == 4          # the same ranking both ways
        assert r["in_place_ms"]["median"] > 0 and r["rebuild_ms"]["median"] > 0 and r["file_mb"] > 0
        assert r["log_reads_back"] and r["append_ms"]["median"] > 0 and r["save_ms"]["median"] > 0
    assert next(tmp_path.glob("lexical-*.png")).stat().st_size > 0 and "| 900 |" in p.stdout


@pytest.mark.real_model
def test_bench_serve_loads_a_live_server_and_restores_the_conversation(tmp_path):
    """A live server under a short load, the conversation restored on its second send, a document's
    ingestion timed, and the same load against a --baseline checkout's server (this checkout,
    started in a subprocess)."""
    out = tmp_path / "serve.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_serve.py", "--batch", "8", "--clients", "2", "--seconds", "3",
                        "--differ", "0", "--deposit-tokens", "0", "--conversation-tokens", "600", "--ask-rerank", "0",
                        "--ingest-tokens", "700", "--baseline", str(ROOT), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ask_rerank"] == 0
    # the same load against another checkout's server (this one, in a subprocess), and the ratio to it
    (base,) = res["baseline"]["rows"]
    assert base["clients"] == 2 and base["ok"] > 0 and base["errors"] == 0 and res["baseline"]["path"] == str(ROOT)
    assert "batch 8 over the baseline: x" in p.stdout
    (row,) = res["settings"][0]["rows"]
    assert row["clients"] == 2 and row["ok"] > 0 and row["errors"] == 0 and set(row["status"]) == {"200"}
    t = res["ttft"]
    # the second send of the conversation is restored from the store up to its last whole forward of
    # the store's prefill (256 tokens here; the rest is computed as rows of the decoding), the first computed
    n = t["conversation_tokens"]
    assert t["cached_tokens_recomputed"] == 0 and t["cached_tokens_restored"] == (n - 1) // 256 * 256 >= 256
    # the ingestion: the whole document deposited (its job done) on the idle server, and the rate printed
    g = res["ingest"]
    assert 500 < g["tokens"] < 900 and g["seconds"] > 0 and g["tokens_per_s"] == g["tokens"] / g["seconds"]
    assert f"ingestion of a {g['tokens']}-token document: ours {g['tokens_per_s']:.0f} tokens/s" in p.stdout


def test_bench_serve_counts_a_server_that_drops_connections_as_errors():
    """A server that dies under the load (llama.cpp's crashed on one machine) is counted, per
    kind of transport failure, among the errors of the level instead of ending the benchmark."""
    import asyncio
    import random
    import socket
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_serve import load
    with socket.socket() as s:                     # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    row = asyncio.run(load(f"http://127.0.0.1:{port}", "peer", 2, 0.6, random.Random(1), chat_only=True, peer=True))
    assert row["ok"] == 0 and row["p50_s"] is None
    assert set(row["status"]) == {"transport:ConnectError"} and row["errors"] == row["status"]["transport:ConnectError"] >= 2


@pytest.mark.real_model
def test_bench_chat_saves_stores_nothing_of_a_conversation_shorter_than_a_block(tmp_path):
    """A default store restores whole blocks only, so a session whose conversation stays inside
    its first block has nothing worth saving: no state, no row (each turn used to write one)."""
    out = tmp_path / "saves.json"
    p = run_script([sys.executable, "benchmarks/bench_chat_saves.py", "--turns", "2", "--words", "12",
                    "--max-tokens", "4", "--seed", "3", "--out", str(out)], cwd=ROOT, capture_output=True,
                   text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["turns"] == 2 and len(res["replies"]) == 2 and 0 < res["conversation_tokens"] < 256
    assert res["states"] == 0 and res["deferred_saves_s"] >= 0


@pytest.mark.real_model
def test_bench_models_measures_a_family_and_reports_a_refused_one(tmp_path):
    p = run_script([sys.executable, "benchmarks/bench_models.py", "--families", "tiny-llama,phi-3.5-mini",
                    "--tokens", "300", "--e3", "2", "--dtype", "float32", "--seed", "3", "--out", str(tmp_path)],
                   cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(tmp_path.glob("models-*.json")).read_text())
    ok, refused = res["rows"]
    assert ok["family"] == "tiny-llama" and ok["e3_exact"] == ok["e3_states"] == 2
    assert ok["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and ok["disk_bytes_per_token"] >= ok["kv_bytes_per_token"]
    assert ok["prefill_tok_s"] > 0 and ok["restore_suffix_s"] > 0 and ok["batched_speedup"] > 0
    assert refused["family"] == "phi-3.5-mini" and "longrope" in refused["refused"]
    assert ok["dead_share"] == 0.0 and ok["local_layers"] == 0
    assert next(tmp_path.glob("models-*.png")).stat().st_size > 0
