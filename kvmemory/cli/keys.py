"""`kvmemory` commands. kvmemory keys: master keys of encrypted stores (kvmemory/keys.py)."""

from __future__ import annotations

import sys


def register(add) -> None:
    """Add this module's commands: add(name, handler, help, description, store=, model=) -> a subparser."""
    sp = add("keys", cmd_keys, "an encrypted store's keys: a new master key, master-key rotation",
             "Keys of encrypted stores live in a keyring directory apart from every store (KVMEMORY_KEYRING), each "
             "data key wrapped by the master key (KVMEMORY_MASTER_KEY, 64 hex digits, or KVMEMORY_MASTER_KEY_FILE). "
             "`kvmemory keys new` prints a fresh master key; `kvmemory keys rotate --new-key-file FILE` re-wraps "
             "every data key of the keyring with the key in FILE (the data is not touched; run it again if it was "
             "cut short), after which only the new master key opens the keyring.", store=False)
    sp.add_argument("action", choices=("new", "rotate", "list"),
                    help="new: print a fresh master key; rotate: re-wrap the keyring's data keys; list: the "
                         "keyring's data keys and destroyed keys (names only)")
    sp.add_argument("--new-key-file", metavar="FILE", default=None,
                    help="rotate: a file holding the new master key (64 hex digits)")


def cmd_keys(args) -> int:
    from kvmemory.errors import InputError
    from kvmemory.keys import LocalKeyProvider, new_master_key, parse_master_key

    if args.action == "new":
        print(new_master_key())
        return 0
    if args.action == "rotate" and not args.new_key_file:
        raise InputError("rotate needs --new-key-file FILE (the new master key; `kvmemory keys new` prints one)")
    ring = LocalKeyProvider.from_env()
    if args.action == "list":
        for name in ring.names():
            print(f"{name}  key")
        for p in sorted(ring.root.glob("*.destroyed")):
            print(f"{p.stem}  destroyed")
        return 0
    try:
        text = open(args.new_key_file, encoding="utf-8").read()
    except OSError as e:
        raise InputError(f"cannot read {args.new_key_file}: {e.strerror}") from None
    n = ring.rotate(parse_master_key(text, args.new_key_file))
    print(f"re-wrapped {n} data keys in {ring.root} with master key {ring.master_id}", file=sys.stderr)
    return 0
