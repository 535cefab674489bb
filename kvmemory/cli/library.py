"""`kvmemory` commands. The verified-solution library: learn, solve. Each command's parser sits beside its handler."""

from __future__ import annotations

import json
import sys

from kvmemory.cli.common import CREATES, KVMemoryError, open_memory, positive_int


def register(add) -> None:
    """Add this module's commands: add(name, handler, help, description, store=, model=) -> a subparser."""
    sp = add("learn", cmd_learn, "add verified solutions to the store's solution library",
             "Read FILE (JSON lines, or - for standard input): each line {\"problem\": ..., \"solution\": ..., "
             "\"answer\": ...}. A solution is stored (as exact KV behind the library prelude, indexed by its "
             "problem) only if its final line 'Answer: X' matches \"answer\"; one that does not is reported and "
             "skipped. Lines without \"answer\" are refused unless --unverified (stored, never grafted by "
             "solve). Every line is checked before anything is stored.", store=CREATES, model=True)
    sp.add_argument("file", metavar="FILE", help="JSON lines file, or - for standard input")
    sp.add_argument("--unverified", action="store_true", help="store lines without an answer, marked unverified")

    sp = add("solve", cmd_solve, "solve a problem with the nearest verified solutions grafted as worked examples",
             "Select the K library solutions nearest to PROBLEM, graft their stored KV as worked examples, "
             "prefill only the problem and decode. A problem already in the library is answered from its "
             "stored state in a few tokens. With --answer, up to --attempts answers are drawn until one's "
             "final answer matches, and a matching solution is learned.", model=True)
    sp.add_argument("problem", metavar="PROBLEM")
    sp.add_argument("-k", type=int, default=3, metavar="K", help="worked examples to graft (default 3)")
    sp.add_argument("--answer", default=None, help="the expected final answer: verify against it")
    sp.add_argument("--attempts", type=positive_int, default=1, metavar="N",
                    help="answers to draw until one verifies (first greedy, then sampled; default 1)")
    sp.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N", help="default 256")
    sp.add_argument("--recompute", type=float, default=0.0, metavar="R",
                    help="fraction of the examples' tokens to recompute so the examples after the first see "
                         "each other (0..1; 1 = as text; default 0)")
    sp.add_argument("--no-learn", action="store_true", help="do not add a verified solution to the library")
    sp.add_argument("--json", action="store_true", help="print JSON")


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
    with open_memory(args, create=True) as mem:
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
    with open_memory(args) as mem:
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
