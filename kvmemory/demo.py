"""`kvmemory demo`: save real states, restore them from disk, prove bit-exactness, time it."""

from __future__ import annotations

import tempfile
import time

import torch

from kvmemory import kv as kvops
from kvmemory.exactness import kl_divergence

SYSTEM = ("You are a careful assistant for the Harbor Street Library. Answer briefly and only from what "
          "you were told. The library opens at 9 am and closes at 7 pm on weekdays, and at 5 pm on Saturdays. "
          "It is closed on Sundays. Members may borrow up to 12 items for 21 days.")

SECTIONS = [
    "Section {n}. Borrowing. Members may renew an item twice online unless another member has reserved it. "
    "Overdue items cost 20 cents a day, up to the price of the item. Lost cards are replaced for two dollars.",
    "Section {n}. Study rooms. The four study rooms on the second floor can be booked for two hours a day. "
    "Bookings open seven days ahead at the front desk or by phone; unused rooms are released after 15 minutes.",
    "Section {n}. Computers. Public computers need a member card or a guest pass. Printing costs ten cents a "
    "page in black and white and fifty cents in colour. Scanning to email is free of charge.",
    "Section {n}. Children. The children's corner hosts story time on Tuesdays and Thursdays at 10:30 am. "
    "Children under eight must be accompanied by an adult at all times in the building.",
    "Section {n}. Events. The auditorium seats 120 people. Community groups may reserve it for free on weekday "
    "evenings; commercial events pay a fee that depends on the length of the booking.",
]


def _handbook(n_sections: int) -> str:
    parts = [SECTIONS[i % len(SECTIONS)].format(n=i + 1) for i in range(n_sections)]
    return "Harbor Street Library staff handbook.\n\n" + "\n\n".join(parts)


def run_demo(store_dir: str | None = None, out=print) -> int:
    from kvmemory.memory import Memory

    tmp = None
    if store_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmemory-demo-")
        store_dir = tmp.name + "/demo.kvm"
    out(f"kvmemory demo: store {store_dir}")
    t = time.perf_counter()
    mem = Memory(store_dir)
    out(f"loaded {mem.model_name} in {time.perf_counter() - t:.1f} s, fingerprint {mem.fingerprint}")
    prompts = {"system prompt": mem.system_prompt(SYSTEM), "handbook (short)": _handbook(12),
               "handbook (long)": _handbook(60)}
    saved = {}
    for name, text in prompts.items():
        t = time.perf_counter()
        st = mem.save(text, label=name)
        saved[name] = (st.id, time.perf_counter() - t)
    mem.close()

    # a second Memory on the same directory: everything below comes back from disk
    mem = Memory(store_dir)
    question = mem.tokenize(mem.chat_turn("When does the library close on Saturdays?"))
    rows = []
    all_exact = True
    for name, (sid, _) in saved.items():
        t = time.perf_counter()
        st = mem.load(sid)
        restore_s = time.perf_counter() - t
        t = time.perf_counter()
        fresh = kvops.make_cache(None, mem.model.config)
        for _ in kvops.prefill_blocks(mem.model, st.token_ids, mem.block_tokens, fresh,
                                      chunk_tokens=mem.prefill_tokens):
            pass
        recompute_s = time.perf_counter() - t
        with torch.inference_mode():
            q = torch.tensor([question])
            a = kvops.last_logits(mem.model, q, fresh)
            b = kvops.last_logits(mem.model, q, st.cache())
        exact = torch.equal(a, b)
        all_exact &= exact
        rows.append((name, st.n_tokens, restore_s, recompute_s, exact, kl_divergence(a, b)))
    out("")
    out(f"{'state':18} {'tokens':>6} {'restore s':>10} {'recompute s':>12} {'speedup':>8} {'bit-exact':>9} {'KL':>6}")
    for name, n, r, c, exact, kl in rows:
        out(f"{name:18} {n:6d} {r:10.3f} {c:12.3f} {c / r:7.0f}x {str(exact):>9} {kl:6.0g}")
    answer = mem.generate(saved["system prompt"][0], "When does the library close on Saturdays?",
                          max_new_tokens=40, chat=True)
    out("")
    out(f"Q: When does the library close on Saturdays?\nA (from the restored system-prompt state): {answer.strip()}")
    info = mem.info()
    out(f"\nstore: {info['states']} states, {info['blocks']} blocks, {info['kv_bytes'] / 2**20:.1f} MiB of KV")
    mem.close()
    if tmp is not None:
        tmp.cleanup()
    if not all_exact:
        out("FAILED: a restored state did not reproduce the fresh logits bit for bit")
        return 1
    return 0
