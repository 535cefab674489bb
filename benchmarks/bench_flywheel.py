"""The flywheel: accuracy gained and decoded tokens saved by a library of verified solutions.

Fresh problems every run (benchmarks/problems.py: multi-step arithmetic, unit conversions, date
arithmetic, string manipulation, each generated with its exact answer). Side by side, in one run,
with the default model:

  base greedy      the model alone (library prelude only), one greedy answer
  base best-of-N   the model alone, up to N answers (greedy, then sampled) until one verifies
  flywheel         start from an empty library; solve a stream of problems with best-of-N, learn
                   what verifies; after 10, 50, 200 ... stream problems, answer the evaluation
                   problems greedily with the k nearest verified solutions grafted as KV
  text few-shot    the same k examples as the last flywheel checkpoint, re-prefilled as text
  seeded           a library of S program-written worked solutions (verified by the same
                   verifiers before they enter), in a second store: the eval problems answered
                   greedily with k of them grafted as KV, the same k as text, and best-of-N with them
  repeated         seeded problems asked again: restored from their state, against the model
                   alone with best-of-N on the same problems (and the stream's learned ones again)

Accuracy: the answer's final line matches (kvmemory.library.answer_is), with a 95% Wilson
interval. Decoded / prefilled tokens and TTFT per problem. JSON + PNG (the flywheel curve).

    python benchmarks/bench_flywheel.py --stream 200 --eval 40 --checkpoints 10,50,200 --seeded 200
    python benchmarks/bench_flywheel.py --stream 200 --checkpoints 10,50,200 --seeded 0   # the curve alone
    python benchmarks/bench_flywheel.py --seeded-only --sweep-k 3,8 --cold               # TTFT: KV, text, cold
    python benchmarks/bench_flywheel.py --stream 40 --eval 20 --checkpoints 10,40     # ~35 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qa import wilson  # noqa: E402
from common import describe, seed_of, write_json  # noqa: E402
from problems import FAMILIES, draw  # noqa: E402

import kvmemory  # noqa: E402
from kvmemory.library import answer_is  # noqa: E402


def run(mem, problems, label: str, bar, **solve_kw) -> dict:
    rows = []
    for fam, text, ans, _ in problems:
        sol = mem.solve(text, verify=answer_is(ans), **solve_kw)
        st = sol.stats
        rows.append({"family": fam, "problem": text, "answer": ans, "got": sol.answer, "ok": bool(sol.verified),
                     "decoded": st["tokens_decoded"], "prefilled": st["tokens_prefilled"],
                     "restored": st["tokens_restored"], "attempts": st["attempts"], "examples": st["examples"],
                     "states_from_ram": st.get("states_from_ram", 0),
                     "blocks_from_ram": (st.get("blocks_from") or {}).get("host", 0),
                     "repeated": st["repeated"], "ttft": st["timings_s"]["ttft"], "total": st["timings_s"]["total"],
                     "learned": sol.learned.entry_id if sol.learned else None,
                     # repeated problems: the answer is the stored verified one; this says whether the
                     # model, restored at the end of its solution, also ends the turn there
                     "answer_from": st.get("answer_from"), "model_ends_turn": st.get("model_ends_turn")})
        bar(label)
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    n, k = len(rows), sum(r["ok"] for r in rows)
    mean = lambda key: statistics.fmean(r[key] for r in rows) if rows else 0.0   # noqa: E731
    fams = {}
    for f in sorted({r["family"] for r in rows}):
        rs = [r for r in rows if r["family"] == f]
        fams[f] = {"n": len(rs), "correct": sum(r["ok"] for r in rs)}
    ends = [r["model_ends_turn"] for r in rows if r.get("model_ends_turn") is not None]
    return {"n": n, "correct": k, "accuracy": k / n if n else 0.0, "ci95": wilson(k, n),
            "model_ends_turn": sum(ends) if ends else None,
            "decoded_mean": mean("decoded"), "prefilled_mean": mean("prefilled"), "restored_mean": mean("restored"),
            "examples_mean": mean("examples"),
            "ttft_median": statistics.median(r["ttft"] for r in rows) if rows else 0.0,
            "total_mean": mean("total"), "families": fams, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream", type=int, default=200, help="problems the flywheel solves and learns from")
    ap.add_argument("--eval", type=int, default=40, help="new problems every condition is measured on")
    ap.add_argument("--checkpoints", default="10,50,200", help="stream lengths at which the library is evaluated")
    ap.add_argument("--n", type=int, default=8, help="best-of-N attempts (base and flywheel stream)")
    ap.add_argument("--k", type=int, default=3, help="worked examples grafted")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=12, help="learned problems asked again")
    ap.add_argument("--seeded", type=int, default=50,
                    help="program-written worked solutions in the seeded library (0: none; no seeded runs)")
    ap.add_argument("--sweep-k", default="", metavar="K,K,...",
                    help="also answer the eval problems greedily with these k of the seeded library, as KV and as "
                         "text (accuracy and the TTFT ratio as the grafted context grows)")
    ap.add_argument("--recompute", type=float, default=0.0, metavar="R",
                    help="also answer the seeded library's conditions (each k) with the fraction R of the examples' "
                         "tokens recomputed (solve(recompute=R))")
    ap.add_argument("--cold", action="store_true",
                    help="also answer the seeded conditions' problems (k = --k) with the library's host-RAM tier "
                         "off, every example read from the store: the TTFT the tier saves")
    ap.add_argument("--seeded-only", action="store_true",
                    help="only the seeded library's conditions (no base, stream or repeated runs)")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the table and PNG of an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        res = json.loads(Path(args.replot).read_text())
        print_table(res, res["args"]["n"])
        plot(res, res["args"]["n"], Path(args.replot).with_suffix(".png"))
        return
    if args.seeded_only and not args.seeded:
        ap.error("--seeded-only needs a seeded library (--seeded N, N > 0)")
    seed = seed_of(args)
    rng = random.Random(seed)
    checkpoints = sorted({min(int(c), args.stream) for c in args.checkpoints.split(",")})
    evals = draw(rng, args.eval)
    stream = draw(rng, args.stream, avoid={p[1] for p in evals})
    seeds = draw(rng, args.seeded, avoid={p[1] for p in evals + stream})
    done = [0]
    t_start = time.perf_counter()

    def bar(label: str) -> None:
        done[0] += 1
        if done[0] % 5 == 0:
            print(f"  [{time.perf_counter() - t_start:7.0f} s] {done[0]} solves ({label})", file=sys.stderr, flush=True)

    kw = {"max_new_tokens": args.max_new_tokens, "learn": False}
    res: dict = {"seed": seed, "machine": describe(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "args": vars(args), "families": list(FAMILIES), "conditions": {}, "curve": []}
    with tempfile.TemporaryDirectory(prefix="kvm-flywheel-") as tmp:
        mem = kvmemory.Memory(Path(tmp) / "lib.kvm")
        C = res["conditions"]
        if args.seeded_only:
            checkpoints = []
        else:
            C["base_greedy"] = run(mem, evals, "base greedy", bar, k=0, **kw)
            C[f"base_best_of_{args.n}"] = run(mem, evals, "base best-of-N", bar, k=0, attempts=args.n, **kw)
        stream_rows = []
        at = 0
        for c in checkpoints:
            part = run(mem, stream[at:c], "stream", bar, k=args.k, attempts=args.n, max_new_tokens=args.max_new_tokens,
                       learn=True)
            stream_rows += part["rows"]
            at = c
            lib = len([e for e in mem.library.entries() if e.verified])
            ev = run(mem, evals, f"flywheel@{c}", bar, k=args.k, reuse=False, **kw)
            res["curve"].append({"stream": c, "library": lib, **{k: v for k, v in ev.items() if k != "rows"}})
            C[f"flywheel_after_{c}"] = ev
            print(f"after {c} stream problems: library {lib}, eval accuracy {ev['accuracy']:.2f}", file=sys.stderr)
        if not args.seeded_only:
            C["flywheel_stream"] = summarize(stream_rows)
            C["text_few_shot"] = run(mem, evals, "text few-shot", bar, k=args.k, reuse=False, examples_as="text", **kw)
        if args.seeded:          # --seeded 0: the stream's curve alone, no seeded library
            seeded_conditions(args, res, mem, evals, seeds, bar, kw)
        if not args.seeded_only:
            learned = [(r["family"], r["problem"], r["answer"], "") for r in stream_rows if r["learned"]]
            if learned:
                C["repeated_stream"] = run(mem, learned[: args.repeat], "repeated stream", bar, k=args.k, **kw)
        mem.close()
    res["elapsed_s"] = time.perf_counter() - t_start
    stamp = datetime.now().strftime("%Y-%m-%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"flywheel-{stamp}.json"
    write_json(path, res, seed)
    print_table(res, args.n)
    plot(res, args.n, out / f"flywheel-{stamp}.png")
    print(f"\nwrote {path} and {path.with_suffix('.png')}; seed {seed}; {res['elapsed_s']:.0f} s")


def seeded_conditions(args, res: dict, mem, evals, seeds, bar, kw) -> None:
    """The seeded library (a second store on the same model), and the repeated conditions."""
    C = res["conditions"]
    with tempfile.TemporaryDirectory(prefix="kvm-seeded-") as tmp:
        # the seeded library: a second store on the same model
        seeded = kvmemory.Memory(Path(tmp) / "seeded.kvm", model=(mem.model, mem.tokenizer))
        t = time.perf_counter()
        for _, text, ans, worked in seeds:
            seeded.learn(text, worked, verify=answer_is(ans))
        res["seeded_learn_s"] = time.perf_counter() - t
        res["seeded_library"] = len(seeded.library.entries())
        C[f"seeded_{args.seeded}"] = run(seeded, evals, "seeded", bar, k=args.k, reuse=False, **kw)
        C[f"seeded_{args.seeded}_text"] = run(seeded, evals, "seeded text", bar, k=args.k, reuse=False,
                                              examples_as="text", **kw)
        S = args.seeded
        if args.cold:
            # the same solves with the pager's RAM tier off: every example's blocks read and verified from the store
            tier = seeded.pager.host
            budget = tier.budget_bytes
            tier.set_budget(0)
            C[f"seeded_{S}_cold"] = cold = run(seeded, evals, "seeded cold", bar, k=args.k, reuse=False, **kw)
            tier.set_budget(budget)
            warm = C[f"seeded_{S}"]
            res["cold_same_answers"] = all(a["got"] == b["got"] for a, b in zip(warm["rows"], cold["rows"]))
        if args.recompute:
            C[f"seeded_{S}_r{args.recompute:g}"] = run(seeded, evals, "seeded blend", bar, k=args.k, reuse=False,
                                                      recompute=args.recompute, **kw)
        for k in sorted({int(x) for x in args.sweep_k.split(",") if x.strip()} - {args.k}):
            C[f"seeded_{S}_k{k}"] = run(seeded, evals, f"seeded k={k}", bar, k=k, reuse=False, **kw)
            C[f"seeded_{S}_k{k}_text"] = run(seeded, evals, f"seeded k={k} text", bar, k=k, reuse=False,
                                             examples_as="text", **kw)
            if args.recompute:
                C[f"seeded_{S}_k{k}_r{args.recompute:g}"] = run(seeded, evals, f"seeded k={k} blend", bar, k=k,
                                                                reuse=False, recompute=args.recompute, **kw)
        if not args.seeded_only:
            C[f"seeded_{S}_best_of_{args.n}"] = run(seeded, evals, "seeded best-of-N", bar, k=args.k,
                                                    attempts=args.n, reuse=False, **kw)
            # repeated: problems the libraries hold, asked again, against the model alone on the same problems
            again = seeds[: args.repeat]
            C["repeated"] = run(seeded, again, "repeated", bar, k=args.k, **kw)
            C[f"repeated_base_best_of_{args.n}"] = run(mem, again, "repeated base", bar, k=0, attempts=args.n,
                                                       reuse=False, **kw)
        seeded.close()


def print_table(res: dict, n: int) -> None:
    print(f"\n{'condition':<24} {'acc':>6} {'95% CI':>13} {'n':>4} {'decoded':>8} {'prefilled':>9} {'restored':>8} "
          f"{'TTFT s':>7}")
    for name, c in res["conditions"].items():
        lo, hi = c["ci95"]
        print(f"{name:<24} {c['accuracy']:6.2f} {f'[{lo:.2f},{hi:.2f}]':>13} {c['n']:>4} {c['decoded_mean']:8.1f} "
              f"{c['prefilled_mean']:9.1f} {c['restored_mean']:8.1f} {c['ttft_median']:7.3f}")
    cold = [c for name, c in res["conditions"].items() if name.endswith("_cold")]
    if cold:
        warm = res["conditions"][f"seeded_{res['args']['seeded']}"]
        print(f"\nlibrary examples from host RAM vs read from the store (k = {res['args']['k']}): TTFT "
              f"{warm['ttft_median']:.3f} vs {cold[0]['ttft_median']:.3f} s, same answers: {res['cold_same_answers']}")
    ks = k_sweep(res)
    if ks:
        print("\nseeded library, greedy, k examples: KV vs the same examples as text")
        print(f"{'k':>3} {'acc KV':>7} {'acc text':>8} {'restored':>8} {'TTFT KV':>8} {'TTFT text':>9} {'ratio':>6}")
        for k, kv, tx, bl in ks:
            print(f"{k:>3} {kv['accuracy']:7.2f} {tx['accuracy']:8.2f} {kv['restored_mean']:8.1f} "
                  f"{kv['ttft_median']:8.3f} {tx['ttft_median']:9.3f} {tx['ttft_median'] / kv['ttft_median']:5.1f}x"
                  + (f"   recompute {res['args']['recompute']:g}: acc {bl['accuracy']:.2f}, TTFT {bl['ttft_median']:.3f}"
                     f" ({tx['ttft_median'] / bl['ttft_median']:.1f}x)" if bl else ""))
    print("\nper family (correct/n):")
    for name, c in res["conditions"].items():
        print(f"  {name:<24} " + "  ".join(f"{f} {v['correct']}/{v['n']}" for f, v in c["families"].items()))


def k_sweep(res: dict) -> list[tuple[int, dict, dict, dict | None]]:
    """(k, KV, text, KV with recompute or None) of the seeded library for every k measured."""
    C, S, a = res["conditions"], res["args"]["seeded"], res["args"]
    r = f"_r{a['recompute']:g}" if a.get("recompute") else None
    out = []
    for k in sorted({a["k"]} | {int(x) for x in (a.get("sweep_k") or "").split(",") if x.strip()}):
        base = f"seeded_{S}" if k == a["k"] else f"seeded_{S}_k{k}"
        if base in C:
            out.append((k, C[base], C[base + "_text"], C.get(base + r) if r else None))
    return out if len(out) > 1 or (out and r) else []


def plot(res: dict, n: int, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    C = res["conditions"]
    xs = [p["library"] for p in res["curve"]]
    ks = k_sweep(res)
    only = "base_greedy" not in C                      # --seeded-only: the k panel alone
    fig, axes = plt.subplots(1, (1 if only else 2) + bool(ks), figsize=(6 if only else (16 if ks else 11), 4),
                             squeeze=False)
    axes = axes[0]
    if ks:
        a3 = axes[-1]
        kx = [c[0] for c in ks]
        r = res["args"].get("recompute")
        for j, (lab, st) in enumerate((("KV", "D-"), ("text", "x--"), (f"KV, recompute {r:g}" if r else "", "s-."))):
            if j < 2 or r:
                a3.plot(kx, [c[1 + j]["accuracy"] for c in ks], st, color=f"C{3 + j}", label=f"accuracy, {lab}")
        a3.set_xlabel("worked examples k (seeded library)")
        a3.set_ylabel("accuracy")
        a3.set_ylim(0, 1)
        tw = a3.twinx()
        tw.plot(kx, [c[2]["ttft_median"] / c[1]["ttft_median"] for c in ks], "o:", color="C2",
                label="TTFT text / TTFT KV")
        tw.set_ylabel("TTFT ratio (text / KV)")
        tw.set_ylim(0, None)
        a3.legend(fontsize=7, loc="upper left")
        tw.legend(fontsize=7, loc="upper right")
    if only:
        fig.suptitle(f"kvmemory seeded library, SmolLM2-135M-Instruct, seed {res['seed']}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    a1, a2 = axes[0], axes[1]
    a1.plot(xs, [p["accuracy"] for p in res["curve"]], "o-", label="flywheel (greedy, k examples as KV)")
    a1.fill_between(xs, [p["ci95"][0] for p in res["curve"]], [p["ci95"][1] for p in res["curve"]], alpha=0.2)
    for name, style in (("base_greedy", "--"), (f"base_best_of_{n}", ":")):
        a1.axhline(C[name]["accuracy"], ls=style, color="gray", label=name)
    a1.plot([xs[-1]], [C["text_few_shot"]["accuracy"]], "s", label="text few-shot (same examples)")
    sk = [k for k in C if k.startswith("seeded_") and k.count("_") == 1]
    if sk:
        S = res["seeded_library"]
        a1.errorbar([S], [C[sk[0]]["accuracy"]], yerr=[[C[sk[0]]["accuracy"] - C[sk[0]]["ci95"][0]],
                    [C[sk[0]]["ci95"][1] - C[sk[0]]["accuracy"]]], fmt="D", color="C3",
                    label=f"seeded library of {S} (KV)")
        a1.plot([S], [C[sk[0] + "_text"]["accuracy"]], "x", color="C3", label="seeded, same examples as text")
        a2.plot([S], [C[sk[0]]["decoded_mean"]], "D", color="C3", label=f"seeded library of {S}")
    ticks = sorted(set(xs) | {res.get("seeded_library", 0)})
    for ax in (a1, a2):
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xticks(ticks, [str(t) for t in ticks])
    a1.set_xlabel("verified solutions in the library")
    a1.set_ylabel("accuracy on new problems")
    a1.set_ylim(0, 1)
    a1.legend(fontsize=7)
    a2.plot(xs, [p["decoded_mean"] for p in res["curve"]], "o-", label="flywheel")
    a2.axhline(C[f"base_best_of_{n}"]["decoded_mean"], ls=":", color="gray", label=f"base best-of-{n}")
    if "repeated" in C:
        a2.axhline(C["repeated"]["decoded_mean"], ls="-.", color="green", label="repeated (restored)")
    a2.set_yscale("log")
    a2.set_xlabel("verified solutions in the library")
    a2.set_ylabel("decoded tokens per problem")
    a2.legend(fontsize=7)
    fig.suptitle(f"kvmemory flywheel, SmolLM2-135M-Instruct, seed {res['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
