"""The `kvmemory` command line. Usage errors exit 2, runtime errors exit 1 with one line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvmemory.config import ASK_MIN_RELEVANCE as MIN_RELEVANCE, ASK_RECOMPUTE as RECOMPUTE, ASK_TOP_K as TOP_K
from kvmemory.errors import KVMemoryError
from kvmemory.index import SELECTORS

EPILOG = ("STORE is a directory or s3://bucket/prefix on any S3-compatible service (AWS_ENDPOINT_URL, "
          "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP=true for plain HTTP). "
          "Environment: KVMEMORY_CACHE_DIR (converted model weights), KVMEMORY_LOCK_TIMEOUT (seconds a writer "
          "waits), KVMEMORY_HOST_CACHE_BYTES (the pager's host-RAM budget), KVMEMORY_STORE_CACHE_DIR and "
          "KVMEMORY_STORE_CACHE_BYTES (local disk tier of an s3:// store).")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvmemory",
        description="Byte-exact KV-cache memory for frozen language models: save a prompt's attention "
                    "state once, restore it later instead of recomputing it.",
        epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"kvmemory {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_, desc):
        sp = sub.add_parser(name, help=help_, description=desc, epilog=EPILOG)
        return sp

    def model_arg(sp):
        sp.add_argument("--model", metavar="DIR", default=None,
                        help="local transformers model directory (default: embedded SmolLM2-135M-Instruct)")

    sp = add("save", "compute a prompt's KV state and store it; prints the state id",
             "Tokenize FILE (UTF-8 text, or - for standard input), compute its KV state block by block "
             "(reusing blocks the store already has) and commit it. Prints the state id.")
    sp.add_argument("store", metavar="STORE", help="store directory or s3://bucket/prefix (created if missing)")
    sp.add_argument("file", metavar="FILE", help="UTF-8 text file, or - for standard input")
    sp.add_argument("--label", default="", help="a name to show in `info --states`")
    sp.add_argument("--chat-system", action="store_true",
                    help="wrap the text as a system prompt of the model's chat template (pair with generate --chat)")
    model_arg(sp)

    sp = add("generate", "restore a state and continue it greedily after PROMPT",
             "Restore state ID (verified), feed PROMPT after it and print the greedy continuation.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("state_id", metavar="ID", help="state id, or a unique prefix of at least 8 hex digits")
    sp.add_argument("prompt", metavar="PROMPT")
    sp.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default 64")
    sp.add_argument("--chat", action="store_true", help="send PROMPT as a user turn of the chat template")
    model_arg(sp)

    sp = add("info", "describe a store: model, fingerprint, states, blocks, bytes",
             "Print the store's model, fingerprint, number of states and blocks, KV bytes, bytes on disk "
             "and compression ratio. Reads the manifest only; loads no model.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--states", action="store_true", help="also list every state")
    sp.add_argument("--json", action="store_true", help="print JSON")

    sp = add("verify", "check every block's digest (E1); with --recompute, recompute each block (E2)",
             "E1: read every committed block and check its digest. With --recompute, E2: recompute every "
             "block from its tokens and parent context with the model and compare bytes. Exits 1 naming "
             "every bad block.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--recompute", action="store_true", help="also recompute every block with the model (slow)")
    model_arg(sp)

    sp = add("add", "deposit documents: prefill once, store every block, index it",
             "Deposit each FILE as a document (its file name is the doc id): computed once in segments behind a "
             "fixed prelude, stored as blocks and indexed for selection. Shows progress with tokens/s on a terminal. "
             "A document becomes visible only when complete; re-running an interrupted add resumes it.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("files", metavar="FILE", nargs="+", help="UTF-8 text files")
    sp.add_argument("--segment-blocks", type=_positive_int, default=None, metavar="N",
                    help="blocks per segment (default 4 = 1,024 tokens)")
    sp.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="compute segments on Ray actors (one model each, a GPU each where the cluster has "
                         "them); ADDRESS of a cluster (e.g. auto, ray://head:10001), or none for a local one. "
                         "The store must be reachable by every worker (s3:// for a cluster)")
    sp.add_argument("--workers", type=_positive_int, default=2, metavar="N", help="Ray workers (default 2)")
    model_arg(sp)

    sp = add("ask", "answer a question from the deposited documents",
             "Select the blocks most relevant to QUESTION, graft them into a fixed-size window in document order "
             "and answer. Prints the answer, then the sources (doc id, token range, score) and timings.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("question", metavar="QUESTION")
    sp.add_argument("--top-k", type=int, default=None, metavar="N",
                    help=f"blocks to select (default {TOP_K}); each comes with the blocks before it in its segment")
    sp.add_argument("--selector", choices=list(SELECTORS), default="text",
                    help="text: MiniLM windows + BM25, fused (default); dense, bm25: one of them alone; "
                         "keys: the model's own keys (opt-in, weaker: see README)")
    sp.add_argument("--recompute", type=float, default=None, metavar="R",
                    help=f"fraction of the window's tokens to recompute so grafted blocks see each other "
                         f"(0..1, default {RECOMPUTE}; 1 = re-prefill the window's text)")
    sp.add_argument("--min-relevance", type=float, default=None, metavar="F",
                    help=f"drop selected blocks whose BM25 score is below F x the best block's (0..1, default "
                         f"{MIN_RELEVANCE})")
    sp.add_argument("--no-expand", action="store_true",
                    help="graft only the selected blocks, without the blocks before them in their segment")
    sp.add_argument("--max-new-tokens", type=int, default=48, metavar="N", help="default 48")
    sp.add_argument("--json", action="store_true", help="print answer, sources and stats as JSON")
    model_arg(sp)

    sp = add("docs", "list deposited documents", "List the store's documents: id, tokens, blocks, source.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--json", action="store_true")

    sp = add("rm", "remove a document and its vectors",
             "Remove DOC_ID from the store's document table and its vectors from the index. Its blocks stay on "
             "disk until `kvmemory gc` reclaims them.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("doc_id", metavar="DOC_ID")
    model_arg(sp)

    sp = add("reindex", "rebuild the selection indexes from the store",
             "Recompute every document block's selection entries (MiniLM windows, BM25 terms, key summaries) "
             "from the store and rewrite the index files "
             "(they are derived data).")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--selector", choices=list(SELECTORS), default=None,
                    help="only the indexes this selector needs")
    model_arg(sp)

    sp = add("serve", "serve the store over HTTP: document QA and OpenAI-compatible chat",
             "Serve STORE (created if missing) with FastAPI/uvicorn: POST /v1/documents (deposit jobs), "
             "GET /v1/jobs/ID, GET/DELETE /v1/documents, POST /v1/ask (SSE with stream), GET /v1/models, "
             "POST /v1/chat/completions (OpenAI shapes; every conversation persists as exact KV states, a "
             "request extending one restores its stored prefix), GET/DELETE /v1/sessions/ID, POST /v1/learn and "
             "/v1/solve (the verified-solution library), GET /health. "
             "Anything but loopback needs an API key.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback)")
    sp.add_argument("--port", type=int, default=8000, help="default 8000")
    sp.add_argument("--api-key-file", metavar="FILE", default=None,
                    help="file holding the bearer token clients must send (or set KVMEMORY_API_KEY)")
    sp.add_argument("--queue", type=_positive_int, default=32, metavar="N",
                    help="requests that may wait for the model; more get 429 (default 32)")
    sp.add_argument("--max-body-mb", type=_positive_int, default=16, metavar="MB", help="request size limit (413)")
    sp.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="serve with Ray Serve replicas reading the same store (a chat session always goes to the "
                         "replica holding its KV); ADDRESS of a cluster, or none for a local one")
    sp.add_argument("--replicas", type=_positive_int, default=2, metavar="N", help="Ray Serve replicas (default 2)")
    model_arg(sp)

    sp = add("gc", "reclaim the disk space of blocks no state or document uses",
             "After rm, the removed document's blocks stay on disk until gc: it records them as freed (from then "
             "on no reader takes them as valid), then removes or rewrites the shard files that hold them. Blocks "
             "committed less than --grace seconds ago are kept: a document being added commits its blocks "
             "before the document itself. Safe to run while others read the store; a crash mid-way is finished "
             "by the next gc. Loads no model.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                    help="keep blocks committed in the last SECONDS (default 3600)")

    sp = add("learn", "add verified solutions to the store's solution library",
             "Read FILE (JSON lines, or - for standard input): each line {\"problem\": ..., \"solution\": ..., "
             "\"answer\": ...}. A solution is stored (as exact KV behind the library prelude, indexed by its "
             "problem) only if its final line 'Answer: X' matches \"answer\"; one that does not is reported and "
             "skipped. Lines without \"answer\" are refused unless --unverified (stored, never grafted by "
             "solve). Every line is checked before anything is stored.")
    sp.add_argument("store", metavar="STORE", help="store directory or s3://bucket/prefix (created if missing)")
    sp.add_argument("file", metavar="FILE", help="JSON lines file, or - for standard input")
    sp.add_argument("--unverified", action="store_true", help="store lines without an answer, marked unverified")
    model_arg(sp)

    sp = add("solve", "solve a problem with the nearest verified solutions grafted as worked examples",
             "Select the K library solutions nearest to PROBLEM, graft their stored KV as worked examples, "
             "prefill only the problem and decode. A problem already in the library is answered from its "
             "stored state in a few tokens. With --answer, up to --attempts answers are drawn until one's "
             "final answer matches, and a matching solution is learned.")
    sp.add_argument("store", metavar="STORE")
    sp.add_argument("problem", metavar="PROBLEM")
    sp.add_argument("-k", type=int, default=3, metavar="K", help="worked examples to graft (default 3)")
    sp.add_argument("--answer", default=None, help="the expected final answer: verify against it")
    sp.add_argument("--attempts", type=_positive_int, default=1, metavar="N",
                    help="answers to draw until one verifies (first greedy, then sampled; default 1)")
    sp.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N", help="default 256")
    sp.add_argument("--recompute", type=float, default=0.0, metavar="R",
                    help="fraction of the examples' tokens to recompute so the examples after the first see "
                         "each other (0..1; 1 = as text; default 0)")
    sp.add_argument("--no-learn", action="store_true", help="do not add a verified solution to the library")
    sp.add_argument("--json", action="store_true", help="print JSON")
    model_arg(sp)

    sp = add("demo", "save real states, restore them, show bit-exactness and restore-vs-recompute time",
             "Save a few real prompts with the default model, restore them from disk, check that the next-token "
             "logits are bit-identical to a fresh computation, and time restore against recompute.")
    sp.add_argument("--store", metavar="DIR", default=None, help="store directory (default: a temporary one)")
    return p


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _version() -> str:
    from kvmemory import __version__

    return __version__


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="block", disable=not sys.stderr.isatty())


def _open(args, read_only=False, create=False):
    """The Memory of args.store. Only commands that write a first state (save) may create a store:
    a mistyped path given to ask, rm, reindex ... is an error, not a new empty store."""
    from pathlib import Path

    from kvmemory.manifest import MANIFEST_NAME
    from kvmemory.memory import Memory

    from kvmemory.store.objects import is_url, open_files

    there = open_files(args.store).exists(MANIFEST_NAME) if is_url(args.store) else \
        (Path(args.store) / MANIFEST_NAME).is_file()
    if not create and not there:
        raise KVMemoryError(f"no kvmemory store at {args.store} (no {MANIFEST_NAME}); check the path, or create "
                            "one with kvmemory save or kvmemory add")
    return Memory(args.store, model=getattr(args, "model", None), read_only=read_only)


def cmd_save(args) -> int:
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(args.file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise KVMemoryError(f"cannot read {args.file}: {e.strerror}") from None
    with _open(args, create=True) as mem:
        if args.chat_system:
            from kvmemory.errors import InputError

            try:
                data = mem.system_prompt(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InputError(f"{args.file} is not UTF-8 text: byte at offset {e.start}") from None
        state = mem.save(data, label=args.label)
    print(state.id)
    return 0


def cmd_generate(args) -> int:
    with _open(args, read_only=True) as mem:
        print(mem.generate(args.state_id, args.prompt, max_new_tokens=args.max_new_tokens, chat=args.chat))
    return 0


def cmd_info(args) -> int:
    from kvmemory.store.info import store_info

    info = store_info(args.store, with_states=args.states)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for k in ("path", "model", "fingerprint", "states", "blocks", "block_tokens", "codec", "kv_dtype"):
        print(f"{k:18} {info[k]}")
    print(f"{'kv_bytes':18} {info['kv_bytes']:,} ({info['kv_bytes'] / 2**20:.1f} MiB)")
    print(f"{'disk_bytes':18} {info['disk_bytes']:,} ({info['disk_bytes'] / 2**20:.1f} MiB)")
    print(f"{'compression_ratio':18} {info['compression_ratio']:.3f}  (kv_bytes / disk_bytes; padding of partial blocks counts)")
    for s in info.get("state_list", []):
        print(f"  {s['id']}  {s['n_tokens']:6d} tokens  {s['label']}")
    return 0


def cmd_verify(args) -> int:
    if args.recompute:
        with _open(args, read_only=True) as mem:
            with _progress(mem.store.n_blocks, "recompute") as bar:
                bad = mem.verify(recompute=True, progress=bar)
            n = mem.store.n_blocks
    else:
        from kvmemory.store import BlockStore

        store = BlockStore.open(args.store)
        n = store.n_blocks
        with _progress(n, "verify") as bar:
            bad = store.verify_all(progress=bar)
    for _, why in bad:
        print(f"BAD {why}")
    what = "E1 digest + E2 recompute" if args.recompute else "E1 digest"
    print(f"{n - len(bad)}/{n} blocks passed ({what})")
    return 1 if bad else 0


def cmd_demo(args) -> int:
    from kvmemory.demo import run_demo

    return run_demo(args.store)


def _open_docs(args):
    from kvmemory.memory import Memory

    return Memory(args.store, model=getattr(args, "model", None), segment_blocks=getattr(args, "segment_blocks", None))


def cmd_add(args) -> int:
    from kvmemory.documents import read_files

    read_files(args.files)                # every file checked before the store is opened or created
    if args.ray is not None:
        from kvmemory.distributed import ray_add

        r = ray_add(args.store, args.files, address=None if args.ray == "local" else args.ray, workers=args.workers,
                    model=args.model, segment_blocks=args.segment_blocks, progress=True)
        for info in r.docs:
            print(f"added {info.doc_id}: {info.n_tokens} tokens, {info.blocks} blocks, {info.segments} segments")
        print(f"ray: {r.workers} workers, {r.computed}/{r.segments} segments computed, {r.restarts} workers replaced, "
              f"{r.tokens_per_s:.0f} tokens/s")
        return 0
    with _open_docs(args) as mem:
        for info in mem.add_files(args.files, progress=True):
            print(f"added {info.doc_id}: {info.n_tokens} tokens, {info.blocks} blocks, {info.segments} segments")
    return 0


def cmd_ask(args) -> int:
    with _open(args, read_only=False) as mem:
        ans = mem.ask(args.question, top_k=args.top_k, selector=args.selector, max_new_tokens=args.max_new_tokens,
                      recompute=args.recompute, expand=not args.no_expand, min_relevance=args.min_relevance)
    if args.json:
        print(json.dumps({"text": ans.text, "sources": ans.sources, "stats": ans.stats}, indent=1))
        return 0
    print(ans.text)
    print()
    for doc, s, e, score in ans.sources:
        print(f"  {doc}  tokens {s}..{e}  score {score:.3f}")
    st = ans.stats
    t = st["timings_s"]
    print(f"\n{st['tokens_restored']} tokens restored ({st['exact_slots']} blocks exact, {st['rerotated_slots']} "
          f"re-rotated), {st['tokens_prefilled']} prefilled; blocks from disk {st['blocks_from']['disk']}, host "
          f"{st['blocks_from']['host']}; TTFT {t['ttft']:.3f} s (select {t['select']:.3f}, page-in "
          f"{t['page_in_and_graft']:.3f}, first token {t['first_token']:.3f}); store {st['store_tokens']} tokens")
    return 0


def cmd_docs(args) -> int:
    from kvmemory.store import BlockStore

    m = BlockStore.open(args.store).manifest
    rows = [{"doc_id": k, "n_tokens": d.n_tokens, "blocks": len(d.rows), "segments": d.segments, "source": d.source}
            for k, d in sorted(m.docs.items(), key=lambda kv: kv[1].created)]
    if args.json:
        print(json.dumps(rows, indent=1))
    for r in ([] if args.json else rows):
        print(f"{r['doc_id']}\t{r['n_tokens']} tokens\t{r['blocks']} blocks\t{r['source']}")
    return 0


def cmd_rm(args) -> int:
    with _open(args) as mem:
        mem.remove(args.doc_id)
    print(f"removed {args.doc_id}")
    return 0


def cmd_reindex(args) -> int:
    with _open(args) as mem:
        mem.reindex(args.selector, progress=True)
        print(f"reindexed {len(mem.documents.live_rows())} blocks")
    return 0


def cmd_serve(args) -> int:
    from kvmemory.server import serve

    key = os.environ.get("KVMEMORY_API_KEY") or None
    if args.api_key_file:
        try:
            key = open(args.api_key_file, encoding="utf-8").read().strip()
        except OSError as e:
            raise KVMemoryError(f"cannot read {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise KVMemoryError(f"{args.api_key_file} is empty")
    if args.ray is not None:
        from kvmemory.serve_ray import serve_ray

        serve_ray(args.store, host=args.host, port=args.port, replicas=args.replicas,
                  address=None if args.ray == "local" else args.ray, model=args.model, api_key=key,
                  queue_size=args.queue, max_body_bytes=args.max_body_mb << 20)
        return 0
    serve(args.store, host=args.host, port=args.port, model=args.model, api_key=key, queue_size=args.queue,
          max_body_bytes=args.max_body_mb << 20)
    return 0


def cmd_gc(args) -> int:
    from kvmemory.store import BlockStore

    if args.grace < 0:
        raise KVMemoryError(f"--grace must be >= 0 seconds, got {args.grace}")
    store = BlockStore.open(args.store, read_only=False)
    r = store.gc(grace_s=args.grace)
    print(f"freed {r.blocks_freed} blocks, {r.bytes_freed:,} bytes ({r.bytes_freed / 2**20:.1f} MiB); "
          f"{r.files_removed} files removed, {r.files_rewritten} rewritten")
    return 0


def _read_solutions(path: str, unverified: bool) -> list[tuple[str, str, str | None]]:
    raw = sys.stdin.buffer.read() if path == "-" else _read_bytes(path)
    out = []
    for n, line in enumerate(raw.decode("utf-8", errors="strict").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise KVMemoryError(f"{path}:{n}: not JSON: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("problem"), str) or not isinstance(d.get("solution"), str):
            raise KVMemoryError(f"{path}:{n}: each line needs string \"problem\" and \"solution\"")
        ans = d.get("answer")
        if ans is None and not unverified:
            raise KVMemoryError(f"{path}:{n}: no \"answer\" to verify against; add one, or pass --unverified")
        out.append((d["problem"], d["solution"], None if ans is None else str(ans)))
    if not out:
        raise KVMemoryError(f"{path}: no solutions")
    return out


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise KVMemoryError(f"cannot read {path}: {e.strerror}") from None


def cmd_learn(args) -> int:
    from kvmemory.errors import VerificationError
    try:
        rows = _read_solutions(args.file, args.unverified)
    except UnicodeDecodeError as e:
        raise KVMemoryError(f"{args.file}: not UTF-8 text (byte offset {e.start})") from None
    stored = rejected = 0
    with _open(args, create=True) as mem:
        for i, (problem, solution, ans) in enumerate(rows, 1):
            try:
                e = mem.learn(problem, solution, verify=None if ans is None else f"answer:{ans}")
            except VerificationError:
                rejected += 1
                print(f"line {i}: rejected: the solution's final answer is not {ans!r}", file=sys.stderr)
                continue
            stored += 1
            print(f"{e.entry_id[:16]}  {'verified' if e.verified else 'UNVERIFIED'}  answer {e.answer!r}  "
                  f"{e.problem[:60]!r}")
    print(f"{stored} stored, {rejected} rejected")
    return 0 if not rejected else 1


def cmd_solve(args) -> int:
    with _open(args) as mem:
        sol = mem.solve(args.problem, verify=None if args.answer is None else f"answer:{args.answer}", k=args.k,
                        attempts=args.attempts, max_new_tokens=args.max_new_tokens, learn=not args.no_learn,
                        recompute=args.recompute)
    if args.json:
        print(json.dumps({"text": sol.text, "answer": sol.answer, "verified": sol.verified, "sources": sol.sources,
                          "learned": sol.learned.entry_id if sol.learned else None, "stats": sol.stats}, indent=1))
        return 0
    st = sol.stats
    print(sol.text)
    how = "repeated problem, restored" if st["repeated"] else f"{st['examples']} worked examples grafted"
    print(f"\nanswer {sol.answer!r}; verified {sol.verified}; {how}; "
          f"{st['tokens_restored']} tokens restored, {st['tokens_prefilled']} prefilled, {st['tokens_decoded']} "
          f"decoded in {st['attempts']} attempt(s); TTFT {st['timings_s']['ttft']:.3f} s"
          + (f"; learned {sol.learned.entry_id[:16]}" if sol.learned else ""))
    return 0


COMMANDS = {"serve": cmd_serve, "gc": cmd_gc, "save": cmd_save, "generate": cmd_generate, "info": cmd_info, "verify": cmd_verify, "add": cmd_add,
            "ask": cmd_ask, "docs": cmd_docs, "rm": cmd_rm, "reindex": cmd_reindex, "demo": cmd_demo,
            "learn": cmd_learn, "solve": cmd_solve}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)   # exits 2 on usage errors
    if not sys.stderr.isatty():
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return COMMANDS[args.command](args)
    except KVMemoryError as e:
        print(f"kvmemory {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvmemory {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
