"""`kvmemory demo`: the three jobs, on the embedded default model, in about a minute on a laptop CPU.

1. states: save real prompts, restore them from disk in a new Memory, prove bit-exactness, time it
   against recomputing them;
2. documents: deposit a handbook, ask it a question, show the answer with its source and the time to
   the first token against re-reading the whole handbook;
3. chat memory: a user tells the assistant a fact in one session; the memory is closed and reopened,
   and in a new session the user's earlier turn is recalled (as KV) for the question.

Only the first is a pass/fail check (a restored state must reproduce the fresh logits bit for bit);
the answers are whatever the 135M model makes of what it is given."""

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
    _documents(mem, out)
    mem.close()
    _chat_memory(store_dir, out)
    mem = Memory(store_dir)
    info = mem.info()
    out(f"\nstore: {info['states']} states, {info['blocks']} blocks, {info['kv_bytes'] / 2**20:.1f} MiB of KV")
    mem.close()
    if tmp is not None:
        tmp.cleanup()
    if not all_exact:
        out("FAILED: a restored state did not reproduce the fresh logits bit for bit")
        return 1
    return 0


QUESTION = "How much does colour printing cost per page?"


def _documents(mem, out) -> None:
    """Job 2: a document deposited once, asked; the same answer's first token against re-reading it."""
    from kvmemory.integrations._common import chat_complete
    out("\n-- documents: deposit once, ask with sources --")
    t = time.perf_counter()
    handbook = _handbook(40)
    doc = mem.add(handbook, doc_id="handbook")
    out(f"deposited {doc.doc_id}: {doc.n_tokens} tokens in {time.perf_counter() - t:.1f} s (computed once, stored)")
    ans = mem.ask(QUESTION)
    src = mem.passages(ans)[0]
    out(f"Q: {QUESTION}\nA: {ans.text.strip()}")
    out(f"source: {src['doc_id']} tokens {src['start_token']}..{src['end_token']}: "
        f"{src['text'].strip()[:100]}...")
    reread = [{"role": "system", "content": "Answer the question using the document. Be brief."},
              {"role": "user", "content": f"{handbook}\n\nQuestion: {QUESTION}"}]
    _, st = chat_complete(mem, reread, 8)
    ttft, again = ans.stats["timings_s"]["ttft"], st["timings_s"]["ttft"]
    out(f"time to first token: {ttft:.2f} s from the store against {again:.2f} s re-reading the whole handbook "
        f"({again / ttft:.0f}x)")


def _chat_memory(store_dir: str, out) -> None:
    """Job 3: a fact told in one session, recalled in a new one after the memory is reopened."""
    from kvmemory.memory import Memory
    out("\n-- chat memory: told in one session, recalled in another after a restart --")
    told = "Please remember that my locker combination is 52917."
    with Memory(store_dir) as mem:
        reply, _ = mem.chat_memory("ada").reply([{"role": "user", "content": told}], session="monday",
                                                  max_new_tokens=24)
        out(f"session monday, ada: {told}\nassistant: {reply.strip()}")
    with Memory(store_dir) as mem:                   # a new process would see the same
        ask = "What is my locker combination? Answer with the number."
        text, st = mem.chat_memory("ada").reply([{"role": "user", "content": ask}], session="friday",
                                                 max_new_tokens=24, remember=False)
        recalled = [r["text"].strip() for r in st["recalled"]]
        out(f"session friday (memory reopened), ada: {ask}\nrecalled as KV: {recalled}\n"
            f"assistant: {text.strip()}  (first token after {st['ttft_s']:.2f} s)")
