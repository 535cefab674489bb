"""`kvmemory` commands. States: save, generate, info, verify, audit, compact, demo. Each command's parser sits beside its handler."""

from __future__ import annotations

import json
import sys

from kvmemory.cli.common import CREATES, KVMemoryError, open_memory, positive_int, progress, store_header


def register(add) -> None:
    """Add this module's commands: add(name, handler, help, description, store=, model=) -> a subparser."""
    sp = add("save", cmd_save, "compute a prompt's KV state and store it; prints the state id",
             "Tokenize FILE (UTF-8 text, or - for standard input), compute its KV state block by block "
             "(reusing blocks the store already has) and commit it. Prints the state id.", store=CREATES, model=True)
    sp.add_argument("file", metavar="FILE", help="UTF-8 text file, or - for standard input")
    sp.add_argument("--label", default="", help="a name to show in `info --states`")
    sp.add_argument("--chat-system", action="store_true",
                    help="wrap the text as a system prompt of the model's chat template (pair with generate --chat)")

    sp = add("generate", cmd_generate, "restore a state and continue it greedily after PROMPT",
             "Restore state ID (verified), feed PROMPT after it and print the greedy continuation.", model=True)
    sp.add_argument("state_id", metavar="ID", help="state id, or a unique prefix of at least 8 hex digits")
    sp.add_argument("prompt", metavar="PROMPT")
    sp.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default 64")
    sp.add_argument("--chat", action="store_true", help="send PROMPT as a user turn of the chat template")

    sp = add("info", cmd_info, "describe a store: model, fingerprint, states, blocks, bytes",
             "Print the store's model, fingerprint, number of states and blocks, KV bytes, bytes on disk "
             "and compression ratio; of a compact store also its encoding, the bytes it saves and the worst "
             "block's measured error. Reads the manifest (and a compact store's error array); loads no model.")
    sp.add_argument("--states", action="store_true", help="also list every state")
    sp.add_argument("--json", action="store_true", help="print JSON")

    sp = add("verify", cmd_verify, "check every block's digest (E1); with --recompute, recompute each block (E2)",
             "E1: read every committed block and check its digest. With --recompute, E2: recompute every "
             "block from its tokens and parent context with the model and compare bytes. Exits 1 naming "
             "every bad block.", model=True)
    sp.add_argument("--recompute", action="store_true", help="also recompute every block with the model (slow)")

    sp = add("audit", cmd_audit, "prove a store: E3 on N random states (restore vs recompute, bit for bit)",
             "For N states drawn at random: restore each from the store (verified) and prefill its tokens "
             "afresh the canonical way; the two caches and the logits of a random suffix after each must be "
             "bit-identical (KL 0). In invariant mode (taken from the store) one plain forward pass must match "
             "too; with the default kernels its largest logit difference is shown, not required. Exits 1 "
             "naming every state that fails.", model=True)
    sp.add_argument("--samples", type=positive_int, default=8, metavar="N", help="states to audit (default 8)")
    sp.add_argument("--seed", type=int, default=None, help="which states and suffixes (default: fresh, printed)")
    sp.add_argument("--json", action="store_true", help="print JSON")

    sp = add("compact", cmd_compact, "write a compact copy of a store (half the bytes, lossy) with each block's "
             "error measured",
             "Write a new store at DEST holding STORE's blocks encoded (fp16: an fp32 model's KV rounded to "
             "IEEE half; bf16: to bfloat16), for cold storage. Every block's error is measured against its exact "
             "KV (key and value relative error; next-token KL at the end of every state and deposit segment, one "
             "forward each) and kept with it; every graft from the copy reports it, `info` shows it and the bytes "
             "saved. The copy is built beside DEST and appears whole or not at all; STORE is only read. The copy "
             "takes no new blocks: add to STORE and compact again.", model=True)
    sp.add_argument("dest", metavar="DEST", help="a new directory for the compact copy")
    sp.add_argument("--encoding", choices=("fp16", "bf16"), default="fp16",
                    help="fp16 (11 significant bits, |x| <= 65504: a block past it is refused; default: 20-100x less "
                         "KL than bf16 on the default model, benchmarks/bench_codec.py) or bf16 (fp32's range, 8 bits)")
    sp.add_argument("--json", action="store_true", help="print the report as JSON")

    sp = add("demo", cmd_demo, "save real states, restore them, show bit-exactness and restore-vs-recompute time",
             "Save a few real prompts with the default model, restore them from disk, check that the next-token "
             "logits are bit-identical to a fresh computation, and time restore against recompute.", store=False)
    sp.add_argument("--store", metavar="DIR", default=None, help="store directory (default: a temporary one)")


def cmd_save(args) -> int:
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(args.file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise KVMemoryError(f"cannot read {args.file}: {e.strerror}") from None
    with open_memory(args, create=True) as mem:
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
    with open_memory(args, read_only=True) as mem:
        print(mem.generate(args.state_id, args.prompt, max_new_tokens=args.max_new_tokens, chat=args.chat))
        if mem.store.encoding.lossy:          # never silently: what the compact blocks cost
            err = mem.load(args.state_id).encoding_error
            print(f"note: state restored from {err['encoding']}-encoded blocks: next-token KL <= {err['kl_max']:.3g} "
                  "against the exact blocks (measured at compaction)", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from kvmemory.store.info import store_info

    info = store_info(args.store, with_states=args.states)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for k in ("path", "model", "fingerprint", "states", "blocks", "block_tokens", "prefill_tokens", "codec", "kv_dtype",
              "attention", "encoding", "encryption"):
        print(f"{k:18} {info[k]}")
    for k in ("kv_bytes", "disk_bytes", "bytes_saved"):
        print(f"{k:18} {info[k]:,} ({info[k] / 2**20:.1f} MiB)")
    print(f"{'compression_ratio':18} {info['compression_ratio']:.3f}  (kv_bytes / disk_bytes; padding of partial blocks counts)")
    err = info.get("encoding_error")
    if err is not None:
        def num(x):
            return "not measured" if x is None else f"{x:.3g}"
        print(f"{'encoding_error':18} lossy ({err['encoding']}), measured against the exact blocks: next-token KL "
              f"<= {num(err['kl_max'])}, key rel. error <= {num(err['key_rel_error_max'])}, value rel. error <= "
              f"{num(err['value_rel_error_max'])}")
    for s in info.get("state_list", []):
        print(f"  {s['id']}  {s['n_tokens']:6d} tokens  {s['label']}")
    return 0


def _store_mode(args) -> None:
    """Recompute with the kernels that computed the store's blocks (its header says which)."""
    header = None if args.invariant else store_header(args.store)
    if header is not None:
        args.invariant = header.model.get("kernels", "default") != "default" or None


def cmd_audit(args) -> int:
    _store_mode(args)
    with open_memory(args, read_only=True) as mem:
        n = min(args.samples, len(mem.states()))
        with progress(n, "audit", unit="state") as bar:
            seed, rows = mem.audit(args.samples, args.seed, progress=bar)
        kernels = mem.info()["kernels"]
    if args.json:
        print(json.dumps({"seed": seed, "kernels": kernels, "states": [r.__dict__ for r in rows],
                          "passed": sum(r.ok for r in rows)}, indent=1))
    else:
        for r in rows:
            if r.ok:
                print(f"OK  {r.state}  {r.tokens} tokens  KL {r.kl:.1g}  "
                      f"vs one pass: max |dlogit| {r.vs_one_pass:.2g}")
            else:
                print(f"BAD {r.state}  {r.error or f'restored differs from recomputed (KL {r.kl:.3g})'}")
        one = max((r.vs_one_pass for r in rows if not r.error), default=0.0)
        print(f"{sum(r.ok for r in rows)}/{len(rows)} states bit-exact (E3: restored == recomputed the canonical "
              f"way); {kernels} kernels; one plain forward pass: max |dlogit| {one:.3g} "
              f"({'required to be 0' if kernels != 'default' else 'a different computation, not required'}); "
              f"seed {seed}")
    return 0 if all(r.ok for r in rows) else 1


def cmd_compact(args) -> int:
    _store_mode(args)
    with open_memory(args, read_only=True) as mem:
        with progress(2 * mem.store.n_blocks, "compact") as bar:
            rep = mem.compact(args.dest, encoding=args.encoding, progress=bar)
    if args.json:
        print(json.dumps(rep.__dict__ | {"bytes_saved": rep.bytes_saved}, indent=1))
        return 0
    print(f"{rep.path}: {rep.blocks} blocks ({rep.tokens:,} tokens) as {rep.encoding}, in {rep.seconds:.1f} s")
    print(f"  disk {rep.source_disk_bytes / 2**20:,.1f} MiB -> {rep.disk_bytes / 2**20:,.1f} MiB "
          f"(saved {rep.bytes_saved / 2**20:,.1f} MiB; exact KV {rep.kv_bytes / 2**20:,.1f} MiB)")
    print(f"  error against the exact blocks: next-token KL max {rep.kl_max:.3g}, mean {rep.kl_mean:.3g} over "
          f"{rep.chains} chain ends (max |dlogit| {rep.logit_diff_max:.3g}; the same greedy token at "
          f"{rep.chains_same_top1}/{rep.chains}); key rel. error <= "
          f"{rep.key_rel_error_max:.3g}, value rel. error <= {rep.value_rel_error_max:.3g}")
    return 0


def cmd_verify(args) -> int:
    if args.recompute:
        _store_mode(args)
        with open_memory(args, read_only=True) as mem:
            with progress(mem.store.n_blocks, "recompute") as bar:
                bad = mem.verify(recompute=True, progress=bar)
            n = mem.store.n_blocks
    else:
        from kvmemory.store import BlockStore

        store = BlockStore.open(args.store)
        n = store.n_blocks
        with progress(n, "verify") as bar:
            bad = store.verify_all(progress=bar)
    for _, why in bad:
        print(f"BAD {why}")
    what = "E1 digest + E2 recompute" if args.recompute else "E1 digest"
    print(f"{n - len(bad)}/{n} blocks passed ({what})")
    return 1 if bad else 0


def cmd_demo(args) -> int:
    from kvmemory.demo import run_demo

    return run_demo(args.store)
