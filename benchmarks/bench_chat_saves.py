"""What a chat session's saves cost: a conversation of --turns turns served by the server's chat
service (the real default model, a fresh store), every turn's deferred save run as an idle server
would run it (after the reply, before the next turn). Reports the store's bytes, its states, and
the seconds the deferred saves took; run it on two commits (a git worktree and PYTHONPATH) to
compare what they write.

    python benchmarks/bench_chat_saves.py --turns 16
"""

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, seed_of, write_json  # noqa: E402,F401


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--words", type=int, default=30, help="words of each user message")
    ap.add_argument("--max-tokens", type=int, default=24, help="each reply's max_tokens (greedy)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="a JSON file for the figures")
    args = ap.parse_args()
    if args.turns < 1:
        raise SystemExit("--turns must be >= 1")
    seed = seed_of(args)
    r = random.Random(seed)
    import kvmemory
    from benchmarks.bench_serve import text
    from kvmemory.server.chat import ChatParams, ChatService
    from kvmemory.server.sessions import Sessions
    with tempfile.TemporaryDirectory(prefix="kvm-saves-") as tmp:
        mem = kvmemory.Memory(Path(tmp) / "s.kvm")
        svc = ChatService(mem, Sessions(Path(tmp) / "sessions"))
        history = [{"role": "system", "content": "You are brief. " + text(r, 40)}]
        saves_s, replies, tokens = 0.0, [], 0
        for _ in range(args.turns):
            history.append({"role": "user", "content": text(r, args.words) + "?"})
            p = ChatParams(list(history), 0.0, 1.0, args.max_tokens, [], None, False, False, "bench")
            out = svc.complete(p, lambda s: None, threading.Event())
            history.append({"role": "assistant", "content": out["text"]})
            replies.append(out["text"])
            t = time.perf_counter()
            svc.flush(all_=True)                     # the idle server's deferred save
            saves_s += time.perf_counter() - t
            tokens = out["prompt_tokens"] + out["completion_tokens"]
        store_bytes = int(subprocess.run(["du", "-sb", str(Path(tmp) / "s.kvm")], capture_output=True,
                                         text=True, check=True).stdout.split()[0])
        res = {"benchmark": "chat_saves", "date": time.strftime("%Y-%m-%d"), "seed": seed, "machine": describe(),
               "turns": args.turns, "conversation_tokens": tokens, "states": len(mem.states()),
               "store_bytes": store_bytes, "deferred_saves_s": saves_s, "replies": replies}
        mem.close()
    print(f"{args.turns} turns, a {tokens}-token conversation: store {store_bytes / 1e6:.1f} MB, "
          f"{res['states']} states, deferred saves {saves_s:.1f} s")
    if args.out:
        write_json(Path(args.out), res, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
