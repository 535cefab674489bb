"""`kvmemory` commands. Documents: add, ask, docs, rm, reindex, gc. Each command's parser sits beside its handler."""

from __future__ import annotations

import json

import argparse
import dataclasses

from kvmemory.cli.common import KVMemoryError, open_memory, positive_int
from kvmemory.options import CHOICES, HELP, AskOptions


def register(add) -> None:
    """Add this module's commands: add(name, handler, help, description, store=, model=) -> a subparser."""
    sp = add("add", cmd_add, "deposit documents: prefill once, store every block, index it",
             "Deposit each FILE as a document (its file name is the doc id): computed once in segments behind a "
             "fixed prelude, stored as blocks and indexed for selection. Shows progress with tokens/s on a terminal. "
             "A document becomes visible only when complete; re-running an interrupted add resumes it.", model=True)
    sp.add_argument("files", metavar="FILE", nargs="+", help="UTF-8 text files")
    sp.add_argument("--segment-blocks", type=positive_int, default=None, metavar="N",
                    help="blocks per segment (default 4 = 1,024 tokens)")
    sp.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="compute segments on Ray actors (one model each, a GPU each where the cluster has "
                         "them); ADDRESS of a cluster (e.g. auto, ray://head:10001), or none for a local one. "
                         "The store must be reachable by every worker (s3:// for a cluster)")
    sp.add_argument("--workers", type=positive_int, default=2, metavar="N", help="Ray workers (default 2)")

    sp = add("ask", cmd_ask, "answer a question from the deposited documents",
             "Select the blocks most relevant to QUESTION, graft them into a fixed-size window in document order "
             "and answer. Prints the answer, then the sources (doc id, token range, score) and timings.", model=True)
    sp.add_argument("question", metavar="QUESTION")
    ask_arguments(sp)
    sp.add_argument("--json", action="store_true", help="print answer, sources and stats as JSON")

    sp = add("docs", cmd_docs, "list deposited documents", "List the store's documents: id, tokens, blocks, source.")
    sp.add_argument("--json", action="store_true")

    sp = add("rm", cmd_rm, "remove a document and its vectors",
             "Remove DOC_ID from the store's document table and its vectors from the index. Its blocks stay on "
             "disk until `kvmemory gc` reclaims them.", model=True)
    sp.add_argument("doc_id", metavar="DOC_ID")

    sp = add("reindex", cmd_reindex, "rebuild the selection indexes from the store",
             "Recompute every document block's selection entries (MiniLM windows, BM25 terms, key summaries) "
             "from the store and rewrite the index files "
             "(they are derived data).", model=True)
    sp.add_argument("--selector", choices=list(CHOICES["selector"]), default=None,
                    help="only the indexes this selector needs")

    sp = add("gc", cmd_gc, "reclaim the disk space of blocks no state or document uses",
             "After rm, the removed document's blocks stay on disk until gc: it records them as freed (from then "
             "on no reader takes them as valid), then removes or rewrites the shard files that hold them. Blocks "
             "committed less than --grace seconds ago are kept: a document being added commits its blocks "
             "before the document itself. Safe to run while others read the store; a crash mid-way is finished "
             "by the next gc. Also removes the index files of chat-memory users with no turns left (a forget "
             "a crash interrupted). Loads no model.")
    sp.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                    help="keep blocks committed in the last SECONDS (default 3600)")


def _open_docs(args):
    return open_memory(args, create=True, segment_blocks=getattr(args, "segment_blocks", None))


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


def ask_arguments(sp) -> None:
    """One flag per AskOptions field (--top-k, ..., --no-expand), its default and help from kvmemory.options."""
    for f in dataclasses.fields(AskOptions):
        metavar, text = HELP[f.name]
        if f.type in (bool, "bool"):
            sp.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action=argparse.BooleanOptionalAction,
                            default=None, help=f"{text} (default: {'yes' if f.default else 'no'})")
            continue
        kind = {"int": positive_int if f.name in ("top_k", "max_new_tokens", "max_context_tokens") else int,
                "float": float, "str": str}[str(f.type)]
        sp.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, metavar=metavar,
                        choices=list(CHOICES[f.name]) if f.name in CHOICES else None,
                        help=f"{text} (default {f.default})")


def options_of(args) -> AskOptions:
    """The AskOptions the flags set (unset ones keep AskOptions' defaults)."""
    return AskOptions().but(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AskOptions)})


def cmd_ask(args) -> int:
    with open_memory(args, read_only=False) as mem:
        ans = mem.ask(args.question, options_of(args))
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
          f"re-rotated, {st['reread_slots']} re-read), {st['tokens_prefilled']} prefilled; blocks from disk "
          f"{st['blocks_from']['disk']}, host {st['blocks_from']['host']}; TTFT {t['ttft']:.3f} s (select {t['select']:.3f}, page-in "
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
    with open_memory(args) as mem:
        mem.remove(args.doc_id)
    print(f"removed {args.doc_id}")
    return 0


def cmd_reindex(args) -> int:
    with open_memory(args) as mem:
        mem.reindex(args.selector, progress=True)
        print(f"reindexed {len(mem.documents.live_rows())} blocks")
    return 0


def cmd_gc(args) -> int:
    from kvmemory.store import BlockStore

    if args.grace < 0:
        raise KVMemoryError(f"--grace must be >= 0 seconds, got {args.grace}")
    from kvmemory.chat_memory.memory import drop_forgotten_users

    store = BlockStore.open(args.store, read_only=False)
    r = store.gc(grace_s=args.grace)
    users = drop_forgotten_users(store, store.root)          # the store's local directory, also of a remote one
    print(f"freed {r.blocks_freed} blocks, {r.bytes_freed:,} bytes ({r.bytes_freed / 2**20:.1f} MiB); "
          f"{r.files_removed} files removed, {r.files_rewritten} rewritten"
          + (f"; index files of {len(users)} forgotten users removed" if users else ""))
    return 0
