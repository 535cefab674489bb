"""Crash trials: SIGKILL `kvmemory add` / `kvmemory save` at random moments, then check the store.

Each trial starts a real `kvmemory` process (a tiny random-weight model of the default model's
architecture, so a trial takes seconds; the commit protocol does not depend on the weights)
that adds a fresh document or saves a fresh prompt into one store shared by every trial, and
kills it with SIGKILL at a random moment: every first of two trials at a uniform time over the run
(from the first commit to the process's end in a reference run), every second inside a commit (the
process kills itself in its k-th commit, k drawn from the reference run's commits, at a uniform
point of that commit's duration in the reference run, or at the commit's last point if it ends
sooner: KVMEMORY_KILL_IN_COMMIT, kvmemory/store/commit.py). After every kill:

    opens     the store opens (Memory with the same model)
    verify    every committed block passes E1 (digest, id re-derived) -- Memory.verify()
    listed    every document / state committed before this trial is still listed
    answers   ask() about a random earlier document returns, citing a stored block
    resumed   re-running the interrupted add / save (in this process) completes; for add, the
              blocks the killed run had committed are reused, not recomputed

    python benchmarks/bench_crash.py --trials 200          # fresh seed; --seed to repeat

Writes benchmarks/results/crash-DATE.json and prints the table.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, seed_of, write_json  # noqa: E402,F401

WORDS = ("valve pump river stone garden lamp copper orchard harbor signal lantern meadow engine archive "
         "bridge falcon winter ledger compass velvet quarry beacon tunnel summit cedar").split()


def tiny_model_dir(work: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer, saved as a local model directory."""
    d = work / "tiny-model"
    if (d / "config.json").is_file():
        return d
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmemory.model import default_model_dir, load_model
    from kvmemory.config import RuntimeConfig, from_env
    cache = from_env(RuntimeConfig).resolved_cache_dir()
    _, tok, _ = load_model(default_model_dir(cache), cache_dir=cache)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


def text(rng: random.Random, words: int, tag: str) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Record {tag}. The keeper of {tag} is {rng.choice(WORDS)}. {body}"


def _spawn(op: str, store: Path, file: Path, model: Path, trace: Path, kill: str | None = None) -> subprocess.Popen:
    from kvmemory.store.commit import KILL_ENV, TRACE_ENV
    env = {**os.environ, TRACE_ENV: str(trace), "HF_HUB_OFFLINE": "1"}
    env.pop(KILL_ENV, None)
    if kill:
        env[KILL_ENV] = kill
    cmd = [sys.executable, "-m", "kvmemory.cli", op, str(store), str(file), "--model", str(model)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _trace(path: Path) -> list[tuple[str, float]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((parts[0], float(parts[1])))
    return out


def _reference(op: str, store: Path, file: Path, model: Path, work: Path) -> dict:
    """An unkilled run: its duration from the first commit on, and its commit windows (relative)."""
    trace = work / f"ref-{op}.trace"
    trace.unlink(missing_ok=True)
    p = _spawn(op, store, file, model, trace)
    _, err = p.communicate(timeout=600)
    end = time.time()
    if p.returncode != 0:
        raise RuntimeError(f"reference {op} failed: {err.decode()[-2000:]}")
    ev = _trace(trace)
    t0 = ev[0][1]
    windows = [(b[1] - t0, e[1] - t0) for b, e in zip(ev[0::2], ev[1::2])]
    return {"span": end - t0, "commits": windows}


def run_trials(n: int, seed: int, work: Path, model: Path | None = None, progress: bool = True) -> dict:
    import kvmemory
    from kvmemory.errors import KVMemoryError

    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    model = model or tiny_model_dir(work)
    store = work / "store.kvm"
    files = work / "files"
    files.mkdir(exist_ok=True)
    committed_docs: dict[str, str] = {}          # doc id -> text (known committed)
    committed_states: dict[str, str] = {}        # state id -> text

    def new_file(op: str, i: int) -> Path:
        tag = f"{op}{i}x{rng.randrange(10**6)}"
        words = rng.randrange(150, 1400) if op == "add" else rng.randrange(50, 700)
        f = files / f"{tag}.txt"
        f.write_text(text(rng, words, tag))
        return f

    refs = {}
    # reference runs (their results count as committed); the first add also creates the store and
    # its prelude, a commit later runs do not make, so the add reference is the second one
    for op in ("add", "add", "save"):
        f = new_file(op, -1)
        refs[op] = _reference(op, store, f, model, work)
        if op == "add":
            committed_docs[f.name] = f.read_text()
    mem = kvmemory.Memory(store, model=str(model))
    for st in mem.states():
        committed_states[st.id] = ""
    rows = {"trials": 0, "killed": 0, "finished_before_kill": 0, "killed_inside_commit": 0,
            "unreadable_stores": 0, "verify_failures": 0, "lost_documents": 0, "lost_states": 0,
            "ask_failures": 0, "resumed": 0, "resume_failures": 0, "blocks_reused_on_resume": 0,
            "blocks_recomputed_on_resume": 0}
    failures: list[str] = []
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=n, desc="crash trials", unit="trial")
    for i in range(n):
        op = "add" if rng.random() < 0.7 else "save"
        f = new_file(op, i)
        trace = work / "trial.trace"
        trace.unlink(missing_ok=True)
        ref = refs[op]
        if i % 2 == 1 and ref["commits"]:
            # every second trial dies inside a commit, so even a short run kills some there: the
            # process kills itself (KILL_ENV) inside its k-th commit, k drawn from the reference
            # run's commits, at a uniform point of that commit's duration there (or at the
            # commit's last point, its record durable, if this one is quicker); a run with fewer
            # commits than k finishes unkilled
            k = rng.randrange(len(ref["commits"]))
            b, e = ref["commits"][k]
            p = _spawn(op, store, f, model, trace, kill=f"{k} {rng.random() * (e - b):.6f}")
            try:
                p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                pass
        else:
            p = _spawn(op, store, f, model, trace)
            deadline = time.time() + 300
            while not trace.is_file() and p.poll() is None and time.time() < deadline:
                time.sleep(0.002)
            first = _trace(trace)
            at = (first[0][1] if first else time.time()) + rng.random() * ref["span"]
            time.sleep(max(0.0, at - time.time()))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        _, err = p.communicate()
        finished = p.returncode != -signal.SIGKILL
        if finished and p.returncode != 0:
            failures.append(f"trial {i}: {op} exited {p.returncode}: {err.decode()[-300:]}")
        ev = _trace(trace)
        rows["trials"] += 1
        rows["killed"] += not finished
        rows["finished_before_kill"] += finished
        rows["killed_inside_commit"] += (not finished) and bool(ev) and ev[-1][0] == "begin"
        # ---- checks
        try:
            mem.close()
            mem = kvmemory.Memory(store, model=str(model))
        except Exception as e:   # noqa: BLE001 -- any failure to open is what we count
            rows["unreadable_stores"] += 1
            failures.append(f"trial {i}: store does not open: {e}")
            break
        bad = mem.verify()
        if bad:
            rows["verify_failures"] += 1
            failures.append(f"trial {i}: verify: {bad[:3]}")
        listed = {d.doc_id for d in mem.docs()}
        lost = set(committed_docs) - listed
        rows["lost_documents"] += len(lost)
        if lost:
            failures.append(f"trial {i}: lost documents {sorted(lost)}")
        have_states = {s.id for s in mem.states()}
        lost_states = set(committed_states) - have_states
        rows["lost_states"] += len(lost_states)
        if lost_states:
            failures.append(f"trial {i}: lost states {sorted(lost_states)[:3]}")
        if committed_docs:
            doc = rng.choice(sorted(committed_docs))
            tag = doc.removesuffix(".txt")
            try:
                ans = mem.ask(f"Who is the keeper of {tag}?", max_new_tokens=4)
                if not ans.sources:
                    raise KVMemoryError("no sources")
            except KVMemoryError as e:
                rows["ask_failures"] += 1
                failures.append(f"trial {i}: ask: {e}")
        # ---- resume what was interrupted
        try:
            if op == "add":
                if f.name not in listed:
                    before = mem.require_store().n_blocks
                    info = mem.add(f.read_text(), doc_id=f.name, source=str(f))
                    written = mem.require_store().n_blocks - before
                    rows["blocks_recomputed_on_resume"] += written
                    rows["blocks_reused_on_resume"] += info.blocks - written
                committed_docs[f.name] = f.read_text()
                ok = f.name in {d.doc_id for d in mem.docs()}
            else:
                sid = mem.save(f.read_bytes()).id
                committed_states[sid] = f.read_text()
                ok = sid in {s.id for s in mem.states()}
            rows["resumed"] += ok
            rows["resume_failures"] += not ok
        except KVMemoryError as e:
            rows["resume_failures"] += 1
            failures.append(f"trial {i}: resume {op}: {e}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    final_bad = mem.verify()
    mem.close()
    return {"seed": seed, **rows, "final_verify_failures": len(final_bad), "documents": len(committed_docs),
            "states": len(committed_states), "failures": failures[:20],
            "reference_span_s": {k: v["span"] for k, v in refs.items()},
            "reference_commits": {k: len(v["commits"]) for k, v in refs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one (printed)")
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / f"crash-{time.strftime('%Y-%m-%d')}.json")
    args = ap.parse_args()
    seed = seed_of(args)
    print(f"seed {seed}", file=sys.stderr)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvm-crash-") as tmp:
        res = run_trials(args.trials, seed, args.work or Path(tmp))
    res["seconds"] = time.time() - t0
    res["machine"] = describe()
    res["date"] = time.strftime("%Y-%m-%d")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, res, seed)
    keys = ["trials", "killed", "killed_inside_commit", "finished_before_kill", "unreadable_stores",
            "verify_failures", "lost_documents", "lost_states", "ask_failures", "resumed", "resume_failures",
            "blocks_reused_on_resume", "blocks_recomputed_on_resume", "final_verify_failures"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    print("| " + " | ".join(str(res[k]) for k in keys) + " |")
    for f in res["failures"]:
        print("  " + f)
    bad = res["unreadable_stores"] + res["verify_failures"] + res["lost_documents"] + res["lost_states"] + \
        res["resume_failures"] + res["final_verify_failures"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
