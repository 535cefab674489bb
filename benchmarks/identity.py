"""Identity check for refactors: answers, first-token logits (sha256), sources and token counts of ask
(six settings), retrieve, solve (KV and text, with and without recompute, repeated) and chat memory,
with the real default model on a fixed seed. Run it on the old and the new code and compare the JSON:

    git worktree add /tmp/base OLD_COMMIT
    PYTHONPATH=/tmp/base BENCH=/tmp/base/benchmarks python benchmarks/identity.py before.json
    BENCH=benchmarks python benchmarks/identity.py after.json && cmp before.json after.json
"""
import hashlib
import json
import random
import sys
import tempfile
import os
sys.path.insert(0, os.environ.get("BENCH", os.path.dirname(os.path.abspath(__file__))))
from haystack import haystack, make_questions
from problems import draw
import kvmemory

def h(t):
    return hashlib.sha256(t.float().numpy().tobytes()).hexdigest()[:16] if t is not None else None

out = {}
rng = random.Random(1234)
with tempfile.TemporaryDirectory() as d:
    mem = kvmemory.Memory(os.path.join(d, "s.kvm"))
    qs = make_questions(rng, 6)
    text = haystack(rng, mem.tokenizer, 5000, qs)
    mem.add(text, doc_id="hay")
    mem.add(haystack(rng, mem.tokenizer, 2000, make_questions(rng, 3)), doc_id="hay2")
    settings = [{}, {"rerank": 0}, {"recompute": 0.2}, {"seam": 4, "rerank": 0}, {"order": "best_last", "top_k": 3},
                {"expand": False, "rerank": 0}]
    for i, q in enumerate(qs):
        for j, s in enumerate(settings):
            a = mem.ask(q.question, **s)
            out[f"ask{i}.{j}"] = [a.text, h(a.first_logits), a.sources, a.stats["tokens_restored"],
                                  a.stats["tokens_recomputed"], a.stats["reranked"]["blocks"]]
    r = mem.retrieve(qs[0].question, k=4)
    out["retrieve"] = [(x["doc_id"], x["start_token"], round(x["score"], 6)) for x in r]
    probs = [(x[1], x[3]) for x in draw(random.Random(7), 5)]
    for p, sol in probs[:4]:
        mem.learn(p, sol, verify=None)
    for k, (p, sol) in enumerate(probs[:4]):
        mem.learn(p, sol, verify=lambda s: True)
    for ex in ("kv", "text"):
        for rc in (0.0, 0.3):
            s = mem.solve(probs[4][0], k=3, max_new_tokens=24, learn=False, examples_as=ex, recompute=rc)
            out[f"solve.{ex}.{rc}"] = [s.text, h(s.first_logits), s.sources, s.stats.get("tokens_restored"),
                                      s.stats.get("tokens_recomputed")]
    s = mem.solve(probs[0][0], max_new_tokens=8)
    out["solve.repeat"] = [s.text, h(s.first_logits), s.stats["repeated"]]
    # the turns kept whole, as before ChatMemory(keep=...) existed (its default is now the user's words alone)
    keep = {"keep": "exchange"} if "keep" in mem.chat_memory.__code__.co_varnames else {}
    cm = mem.chat_memory("ann", **keep)
    facts = ["My locker combination is 52917.", "I live in Bergen and work as a baker.", "My cat is named Pixel."]
    for i, f in enumerate(facts):
        t, st = cm.reply([{"role": "user", "content": f}], session=f"s{i}", max_new_tokens=16)
        out[f"chat.tell{i}"] = [t, st["tokens_grafted"], st["tokens_prefilled"]]
    for as_ in ("kv", "text", "none"):
        t, st = cm.reply([{"role": "user", "content": "What is my locker combination?"}], session="q",
                         max_new_tokens=16, as_=as_, remember=False)
        out[f"chat.ask.{as_}"] = [t, st["tokens_grafted"], st["tokens_recomputed"], [r["doc_id"] for r in st["recalled"]]]
    cm2 = mem.chat_memory("bob", layout="system", **keep)
    cm2.reply([{"role": "user", "content": "I was born in Lima."}], session="b1", max_new_tokens=8)
    t, st = cm2.reply([{"role": "user", "content": "Where was I born?"}], session="b2", max_new_tokens=12, remember=False)
    out["chat.system"] = [t, st["tokens_grafted"]]
    mem.close()
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
print("ok", len(out))
