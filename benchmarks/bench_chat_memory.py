"""Memory for chat assistants, measured: LongMemEval's design with exact answers (no judge model),
generated afresh every run (a new seed unless --seed).

Per user, a history of N sessions of filler conversation with evidence exchanges planted in some;
then questions asked in a new session, of six kinds:

    single     a fact said once                       "What is my locker code?"
    multi      two facts from two sessions            both values must be in the answer
    update     a value, later changed                 the latest value, and not the old one
    temporal   which of two dated events came first   the first one named first
    abstain    a thing never said                     an answer that says it was not said
    cross      several users hold values for the same thing: this user's, and no other's

Side by side on the same questions (one run, one machine):

    none       no memory: the question alone
    text       the same recalled turns quoted as text in the system message (text memory)
    kv         the recalled turns grafted as KV after the conversation's exact prefix, a part of them
               recomputed (kvmemory's default, ChatMemory.recompute)
    kv-end     A/B of the KV window: the recalled turns closed with <|im_end|> (2 tokens prefilled)
    kv-head    ... with their prelude grafted before them (a user message of their own) and closed
    kv-head0   ... with their prelude grafted, not closed
    kv-rR      KV recall with a fraction R of the grafted turns' tokens recomputed in the window
               (CacheBlend-style: those whose K/V deviate most), e.g. kv-r0 (none), kv-r1 (all of them);
               with a cut after it: kv-r0-cut0.75
    kv-cutF    KV recall keeping a turn after the most relevant one only with F x its BM25 score
    text-cutF  (ChatMemory.min_relevance; default 0.75; 0: the k best turns, however weak), e.g. kv-cut0;
               -cover / -nocover after it: a turn under the cut holding a word of the question no kept
               turn holds kept at half the best's score, or not (ChatMemory.cover; default: on)
    -guard     last on a kv or text condition: the reply kept from opening as a remembered turn reads
    -noguard   ("The user said: ..."; kvmemory/chat_memory/guard.py), or not (ChatMemory.guard), e.g.
               kv-noguard, kv-r0-guard, text-cut0-guard
    -rel       before -guard / -noguard: the recalled turns in the window the most relevant last, nearest
    -time      the question, or oldest first (ChatMemory.order), e.g. kv-rel, text-time, kv-cut0-rel-guard
    -topic     after -rel / -time: after the most relevant turn only turns holding a content word of the
    -notopic   question, or not (ChatMemory.on_topic), e.g. kv-topic, kv-rel-notopic-guard
    -first     after -topic / -notopic: a most relevant turn holding no content word of the question
    -nofirst   gives way to the best that does, or not (ChatMemory.topic_first), e.g. kv-nofirst
    -open      after -first / -nofirst: the turns opening the new user message, where the turns layout
    -after     computed them (ChatMemory.place = "message"), or grafted after the conversation and quoted
               in the system message ("after"), e.g. kv-open, text-after, kv-nofirst-open-guard
    -content   after -open / -after: BM25 scores the question's content words alone ("what", "my"
    -held      dropped); or all its words, ranking only the turns holding a content word of it; or all
    -allwords  its words, every turn (ChatMemory.lexical), e.g. kv-content, text-allwords
    -newer     after -content / -held / -allwords: a turn said after the most relevant one and holding a word of
    -nonewer   the question it holds comes under the cut, or not (ChatMemory.newer), e.g. kv-content-newer
    -supersede after -newer / -nonewer: of the kept turns holding the same words of the question, the
    -nosupersede  newest alone (a correction stands for what it corrects), or not (ChatMemory.supersede)
    -dense     after -supersede / -nosupersede: the dense ranking's best turn kept too, room permitting,
    -nodense   or not (ChatMemory.dense), e.g. kv-supersede-dense
    -additive  after -dense / -nodense: with supersede, a statement adding to what was told ("I also speak
    -noadditive  German") kept beside it, or not (ChatMemory.additive), e.g. kv-supersede-noadditive
    full       the whole history as text, where it fits the window
    oracle     only the evidence exchanges, quoted as text (the model's ceiling)

Reports evidence recall@k, accuracy with Wilson 95% intervals per kind, TTFT, tokens prefilled per
turn, the cost of a write (ms per remembered exchange; model calls: one prefill, no generation),
bytes per remembered token, and leaks (turns of another user recalled; answers holding another
user's value). JSON + PNG.

    python benchmarks/bench_chat_memory.py --users 3 --sessions 50
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qa import wilson  # noqa: E402
from common import describe, seed_of, write_json  # noqa: E402

import kvmemory  # noqa: E402

NAMES = ["Ingrid", "Tomas", "Aiko", "Mateo", "Leila", "Oskar", "Priya", "Jonas", "Freya", "Ravi", "Elena", "Nils",
         "Sofia", "Karim", "Hanna", "Diego", "Mira", "Lukas", "Amara", "Viktor"]
CITIES = ["Bergen", "Oslo", "Lisbon", "Krakow", "Porto", "Tallinn", "Ghent", "Turin", "Malmo", "Lyon", "Graz", "Split"]
CARS = ["Volvo", "Subaru", "Skoda", "Toyota", "Peugeot", "Mazda", "Kia", "Fiat"]
COLOURS = ["teal", "amber", "violet", "crimson", "olive", "indigo", "coral", "ochre"]
JOBS = ["nurse", "carpenter", "librarian", "pilot", "baker", "chemist", "architect", "plumber"]
PLACES = ["the aquarium", "the castle", "the lighthouse", "the botanical garden", "the old mill", "the observatory",
          "the harbour museum", "the ice rink"]
ABSTAIN = ("don't know", "do not know", "not sure", "haven't told", "have not told", "didn't tell", "did not tell",
           "didn't mention", "did not mention", "haven't mentioned", "no information", "not mentioned",
           "don't have", "do not have", "cannot", "can't", "unable", "not provided", "never told", "never mentioned")
FILLER = [("Can you suggest a quick breakfast?", "Oatmeal with fruit is quick and filling."),
          ("How do I keep basil alive indoors?", "Give it sun, water when the soil is dry, and pinch the tops."),
          ("What's a good stretch after running?", "Try a standing quad stretch and a calf stretch."),
          ("Tell me a fun fact about octopuses.", "Octopuses have three hearts."),
          ("How long should I boil an egg?", "About nine minutes for a hard-boiled egg."),
          ("Any tips for sleeping better?", "Keep a regular schedule and avoid screens before bed."),
          ("What is a haiku?", "A short poem of three lines with five, seven and five syllables."),
          ("How do I remove a coffee stain?", "Blot it and rinse with cold water and a little soap."),
          ("Recommend a board game for two.", "Patchwork is a good board game for two players."),
          ("What should I pack for a day hike?", "Water, snacks, a map, a rain jacket and sunscreen."),
          ("How can I learn to juggle?", "Start with one ball, then two, then add the third."),
          ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue scatters most.")]

FOODS = ["risotto", "dumplings", "paella", "lasagne", "falafel", "ramen", "goulash", "pierogi"]
INSTRUMENTS = ["cello", "banjo", "clarinet", "harp", "trumpet", "accordion", "oboe", "ukulele"]
MONTHS = ["January", "March", "April", "June", "August", "September", "October", "December"]
HOBBIES = ["pottery", "chess", "birdwatching", "knitting", "climbing", "baking", "rowing", "sketching"]


def filler(rng: random.Random) -> list[dict]:
    """One exchange of small talk, made unique with a detail (a long history is not 12 lines repeated)."""
    q, a = rng.choice(FILLER)
    return exchange(f"{q} I ask because of my {rng.choice(HOBBIES)} club, week {rng.randint(1, 500)}.", a)


# kind of fact: (statement, update statement or None, question, values)
FACTS = {
    "locker code": ("Please remember that my locker code is {v}.", None, "What is my locker code?", None),
    "sister": ("My sister is called {v}.", None, "What is my sister's name?", NAMES),
    "dog": ("My dog is called {v}.", None, "What is my dog's name?", NAMES),
    "colour": ("My favourite colour is {v}.", None, "What is my favourite colour?", COLOURS),
    "neighbour": ("My neighbour is called {v}.", None, "What is my neighbour's name?", NAMES),
    "food": ("My favourite food is {v}.", None, "What is my favourite food?", FOODS),
    "instrument": ("I play the {v}.", None, "Which instrument do I play?", INSTRUMENTS),
    "month": ("I was born in {v}.", None, "Which month was I born in?", MONTHS),
    "city": ("I live in {v}.", "I have moved: I live in {v} now.", "Which city do I live in now?", CITIES),
    "car": ("I drive a {v}.", "I sold my old car; I drive a {v} now.", "What car do I drive now?", CARS),
    "job": ("I work as a {v}.", "I changed jobs: I work as a {v} now.", "What is my job now?", JOBS),
}
NEVER = ["What is my brother's name?", "What is my cat's name?", "What is my bicycle's colour?",
         "What is my flat number?", "What is my grandmother's name?"]


def value(kind: str, rng: random.Random, avoid=()) -> str:
    pool = FACTS[kind][3]
    if pool is None:
        while True:
            v = str(rng.randint(1000, 9999))
            if v not in avoid:
                return v
    return rng.choice([x for x in pool if x not in avoid] or pool)     # more users than values: they repeat


def exchange(u: str, a: str) -> list[dict]:
    return [{"role": "user", "content": u}, {"role": "assistant", "content": a}]


def make_user(rng: random.Random, sessions: int, n_filler: int, shared: dict) -> dict:
    """A user's history (sessions of exchanges with times) and its questions with their answers."""
    day0 = 1.75e9
    hist = [[filler(rng) for _ in range(n_filler)] for _ in range(sessions)]
    times = [day0 + i * 86400 for i in range(sessions)]
    facts, questions = {}, []

    def plant(kind_key: str, text: str, ack: str, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        s = rng.randrange(lo, sessions if hi is None else hi)
        at = rng.randrange(0, len(hist[s]) + 1)
        hist[s].insert(at, exchange(text, ack))
        return s, text

    for kind, (stmt, upd, q, _) in FACTS.items():
        v = value(kind, rng, avoid=shared.get(kind, ()))
        shared.setdefault(kind, []).append(v)
        if upd is None:
            s, text = plant(kind, stmt.format(v=v), f"Noted: {v}.")
            facts[kind] = v
            questions.append({"kind": "single", "q": q, "want": [v], "not": [], "evidence": [text], "fact": kind})
        else:
            half = sessions // 2
            s1, t1 = plant(kind, stmt.format(v=v), f"Noted: {v}.", 0, max(1, half))
            v2 = value(kind, rng, avoid=[v] + list(shared.get(kind, ())))
            s2, t2 = plant(kind, upd.format(v=v2), f"Noted: {v2} now.", max(1, half), sessions)
            facts[kind] = v2
            questions.append({"kind": "update", "q": q, "want": [v2], "not": [v], "evidence": [t2], "fact": kind})
    # multi-session: two single facts
    singles = [q for q in questions if q["kind"] == "single"]
    for a, b in zip(singles, singles[1:] + singles[:1]):
        questions.append({"kind": "multi", "q": f"{a['q'][:-1]}, and {b['q'][0].lower()}{b['q'][1:]}",
                          "want": a["want"] + b["want"], "not": [], "evidence": a["evidence"] + b["evidence"]})
    # temporal: two dated visits
    places = rng.sample(PLACES, 4)
    for a, b in ((places[0], places[1]), (places[2], places[3])):
        sa, ta = plant("visit", f"Today I visited {a}.", "How lovely!")
        sb, tb = plant("visit", f"Today I visited {b}.", "How lovely!")
        first, second = (a, b) if sa < sb else (b, a)
        if sa == sb:
            continue
        questions.append({"kind": "temporal", "q": f"Which did I visit first, {a} or {b}?", "want": [first],
                          "first": first, "second": second, "not": [], "evidence": [ta, tb]})
    for q in rng.sample(NEVER, 4):
        questions.append({"kind": "abstain", "q": q, "want": [], "not": [], "evidence": []})
    return {"sessions": hist, "times": times, "facts": facts, "questions": questions}


def correct(q: dict, answer: str) -> bool:
    a = answer.casefold()
    if q["kind"] == "abstain":
        return any(p in a for p in ABSTAIN)
    if q["kind"] == "temporal":
        f, s = q["first"].casefold(), q["second"].casefold()
        if f not in a:
            return False
        return s not in a or a.index(f) < a.index(s)
    return all(w.casefold() in a for w in q["want"]) and not any(n.casefold() in a for n in q["not"])


def run(args) -> dict:
    seed = seed_of(args)
    rng = random.Random(seed)
    shared: dict = {}
    users = {f"user-{i}-{rng.randrange(1 << 20):05x}": make_user(rng, args.sessions, args.filler, shared)
             for i in range(args.users)}
    for u in users.values():                           # cross-user probes: facts other users also hold
        for q in u["questions"]:
            if q["kind"] == "single" and q["fact"] in shared and len(shared[q["fact"]]) > 1:
                q["others"] = [v for v in shared[q["fact"]] if v not in q["want"]]
    work = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="kvm-chatmem-")) / "m.kvm"
    from kvmemory.config import StoreConfig, from_env
    cfg = from_env(StoreConfig, block_tokens=args.block_tokens, codec=args.codec)
    mem = kvmemory.Memory(work, store_config=cfg)
    layout = {"block_tokens": mem.block_tokens, "codec": mem.require_store().manifest.codec}
    writes, hist_tokens, bar = [], 0, _bar(sum(len(s) for u in users.values() for s in u["sessions"]), "remember")
    for name, u in users.items():
        cm = mem.chat_memory(name, args.layout)
        for i, (sess, when) in enumerate(zip(u["sessions"], u["times"])):
            for ex in sess:
                t = time.perf_counter()
                cm.remember(ex, f"s{i}", when=when)
                writes.append(time.perf_counter() - t)
                if bar is not None:
                    bar.update(1)
        hist_tokens += sum(s["tokens"] for s in cm.sessions())
    if bar is not None:
        bar.close()
    rows = []
    conds = args.conditions.split(",")
    qs = [(name, q) for name, u in users.items() for q in u["questions"]]
    rng.shuffle(qs)
    if args.questions:                                 # a random subset, drawn like the rest
        qs = qs[:args.questions]
    bar = _bar(len(qs) * len(conds), "ask")
    for n, (name, q) in enumerate(qs):
        cm, u = mem.chat_memory(name, args.layout), users[name]
        msgs = [{"role": "user", "content": q["q"]}]
        row = {"user": name, "kind": q["kind"], "q": q["q"], "want": q["want"], "cross": bool(q.get("others"))}
        for c in conds:
            text, st = answer(mem, cm, u, q, msgs, c, args)
            if text is None:
                row[c] = None
            else:
                recalled = [r["text"] for r in st.get("recalled", [])]
                leak_turns = sum(1 for r in st.get("recalled", []) if not r["doc_id"].startswith(cm.prefix))
                row[c] = {"answer": text, "correct": correct(q, text), "ttft_s": st["ttft_s"],
                          "prefilled": st["tokens_prefilled"], "restored": st.get("tokens_restored", 0),
                          "recomputed": st.get("tokens_recomputed", 0),
                          "evidence_found": all(any(e in r for r in recalled) for e in q["evidence"])
                          if q["evidence"] else None, "leak_turns": leak_turns,
                          "leak_value": any(v.casefold() in text.casefold() for v in q.get("others", []))}
            if bar is not None:
                bar.update(1)
        rows.append(row)
    if bar is not None:
        bar.close()
    disk = mem.require_store().disk_bytes()
    g = mem.geometry
    per_token = g.layers * 2 * g.kv_heads * g.head_dim * mem.kv_dtype.itemsize
    mem.close()
    if not args.store:                                 # a temporary store: raw blocks of short turns are big
        import shutil
        shutil.rmtree(work.parent, ignore_errors=True)
    return {"seed": seed, "args": vars(args), "machine": describe(), "history_tokens_per_user":
            hist_tokens / max(1, len(users)), "exchanges": len(writes),
            "write_ms": {"median": 1000 * statistics.median(writes), "p90": 1000 * _pct(writes, 0.9)},
            "write_model_calls": "one prefill per exchange, no generation", "kv_bytes_per_token": per_token,
            "disk_bytes_per_token": disk / max(1, hist_tokens), "store_layout": layout, "rows": rows,
            "summary": summarize(rows, conds)}


# A/B of what surrounds the recalled turns in a KV window (name: (graft their prelude, text after them))
KV_VARIANTS = {"kv-end": (False, "<|im_end|>\n"), "kv-head": (True, "<|im_end|>\n"), "kv-head0": (True, "")}


# conditions that change ChatMemory settings for one reply: kv-rF (recompute), kv-cutF / text-cutF (min_relevance,
# then -cover / -nocover), and both: kv-rF-cutF; then -rel / -time (ChatMemory.order), -topic / -notopic
# (ChatMemory.on_topic), -first / -nofirst (ChatMemory.topic_first), -open (ChatMemory.place "message" or "after"),
# -content / -allwords (ChatMemory.lexical), -newer / -nonewer (ChatMemory.newer), -supersede / -nosupersede
# (ChatMemory.supersede), -dense / -nodense (ChatMemory.dense), -additive / -noadditive (ChatMemory.additive);
# -guard / -noguard last (ChatMemory.guard)
TUNED = re.compile(r"(kv|text)(?:-r([0-9]*\.?[0-9]+))?(?:-cut([0-9]*\.?[0-9]+)(-cover|-nocover)?)?(-rel|-time)?(-topic|-notopic)?(-first|-nofirst)?(-open|-after)?(-content|-held|-allwords)?(-newer|-nonewer)?(-supersede|-nosupersede)?(-dense|-nodense)?(-additive|-noadditive)?(-guard|-noguard)?")
FRACTIONS = ("recompute", "min_relevance")
# TUNED's suffix groups -> (the ChatMemory attribute each sets, its value for each suffix)
SUFFIXES = {4: ("cover", {"-cover": True, "-nocover": False}), 5: ("order", {"-rel": "relevance", "-time": "time"}),
            6: ("on_topic", {"-topic": True, "-notopic": False}), 7: ("topic_first", {"-first": True, "-nofirst": False}),
            8: ("place", {"-open": "message", "-after": "after"}), 9: ("lexical", {"-content": "content", "-held": "held", "-allwords": "all"}),
            10: ("newer", {"-newer": True, "-nonewer": False}),
            11: ("supersede", {"-supersede": True, "-nosupersede": False}), 12: ("dense", {"-dense": True, "-nodense": False}),
            13: ("additive", {"-additive": True, "-noadditive": False}), 14: ("guard", {"-guard": True, "-noguard": False})}


def tuned(c: str) -> tuple[str, dict] | None:
    """A condition that recalls with other ChatMemory settings -> (recall as, {attribute: value}), else None."""
    if c in KV_VARIANTS:
        head, foot = KV_VARIANTS[c]
        return "kv", {"graft_head": head, "foot_text": foot}
    m = TUNED.fullmatch(c)
    if (m is None or not any(m.group(i) for i in (2, 3, *range(5, 15)))
            or (m.group(2) and m.group(1) != "kv")):     # -rF: KV's alone
        return None
    settings = {"recompute": float(m.group(2))} if m.group(2) else {}
    if m.group(3):
        settings["min_relevance"] = float(m.group(3))
    for g, (attr, values) in SUFFIXES.items():
        if m.group(g):
            settings[attr] = values[m.group(g)]
    return m.group(1), settings


def check_conditions(conds: list[str]) -> None:
    """Every condition is one answer() knows (an unknown name is refused before anything is built)."""
    for c in conds:
        t = tuned(c)
        ok = c in ("none", "text", "kv", "full", "oracle") or (
            t is not None and all(v <= 1.0 for a, v in t[1].items() if a in FRACTIONS))
        if not ok:
            raise SystemExit(f"--conditions: {c!r} is not none, text, kv, full, oracle, {', '.join(KV_VARIANTS)}, "
                             "kv-rF, kv-cutF, text-cutF or kv-rF-cutF (F in [0, 1]; a cut takes -cover or -nocover; "
                             "any of them, kv or text, then -rel or -time, -topic or -notopic, -guard or -noguard last)")


def answer(mem, cm, u, q, msgs, c, args):
    """(answer, stats) of question q under condition c, or (None, None) where it does not apply."""
    from kvmemory.chat_memory.window import QUOTE_HEAD
    t = tuned(c)
    if t is not None:                                  # the same recall, a setting changed for this reply
        base, settings = t
        saved = {a: getattr(cm, a) for a in settings}
        for a, v in settings.items():
            setattr(cm, a, v)
        try:
            return cm.reply(msgs, session="eval", max_new_tokens=args.max_new_tokens, as_=base, k=args.k,
                            remember=False)
        finally:
            for a, v in saved.items():
                setattr(cm, a, v)
    if c in ("none", "text", "kv"):
        return cm.reply(msgs, session="eval", max_new_tokens=args.max_new_tokens, as_=c, k=args.k, remember=False)
    if c == "full":
        history = [m for s in u["sessions"] for ex in s for m in ex]
        conv = history + msgs
    else:                                              # oracle: only the evidence, quoted
        ev = [m["content"] for s in u["sessions"] for ex in s for m in ex[:1] if m["content"] in q["evidence"]]
        conv = ([{"role": "system", "content": QUOTE_HEAD + "\n".join(f"user: {e}" for e in ev)}] if ev else []) + msgs
    ids = mem.tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
    if len(ids) + args.max_new_tokens > mem.geometry.max_positions:
        return None, None
    from kvmemory.integrations._common import chat_complete
    text, st = chat_complete(mem, conv, args.max_new_tokens)
    return text, {"ttft_s": st["timings_s"]["ttft"], "tokens_prefilled": st["tokens_prefilled"]}


def summarize(rows: list[dict], conds: list[str]) -> dict:
    out = {}
    kinds = sorted({r["kind"] for r in rows})
    for c in conds:
        got = [r for r in rows if r.get(c) is not None]
        if not got:
            out[c] = None
            continue
        acc = {}
        for k in kinds + ["all", "cross"]:
            sel = [r for r in got if (k == "all" or r["kind"] == k or (k == "cross" and r["cross"]))]
            n, kk = len(sel), sum(r[c]["correct"] for r in sel)
            acc[k] = {"n": n, "correct": kk, "accuracy": kk / n if n else 0.0, "ci95": wilson(kk, n)}
        ev = [r[c]["evidence_found"] for r in got if r[c]["evidence_found"] is not None]
        out[c] = {"accuracy": acc, "evidence_recall": sum(ev) / len(ev) if ev else None,
                  "ttft_median_s": statistics.median(r[c]["ttft_s"] for r in got),
                  "prefilled_mean": statistics.mean(r[c]["prefilled"] for r in got),
                  "restored_mean": statistics.mean(r[c]["restored"] for r in got),
                  "recomputed_mean": statistics.mean(r[c].get("recomputed", 0) for r in got),
                  "leak_turns": sum(r[c]["leak_turns"] for r in got),
                  "leak_values": sum(r[c]["leak_value"] for r in got if r["cross"]), "answered": len(got)}
    return out


def _pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def _bar(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc)


def table(res: dict) -> str:
    s = res["summary"]
    kinds = sorted(k for k in next(v for v in s.values() if v)["accuracy"] if k not in ("all",))
    head = "| condition | all | " + " | ".join(kinds) + " | recall@k | TTFT | prefilled (+ recomputed) | leaks |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c, v in s.items():
        if v is None:
            lines.append(f"| {c} | n/a (does not fit the window) |")
            continue
        a = v["accuracy"]
        cell = lambda k: f"{a[k]['correct']}/{a[k]['n']}"          # noqa: E731
        ev = "" if v["evidence_recall"] is None or not (c == "text" or c.startswith("kv")) else f"{v['evidence_recall']:.2f}"
        lines.append(f"| {c} | {cell('all')} ({a['all']['accuracy']:.2f} [{a['all']['ci95'][0]:.2f}, "
                     f"{a['all']['ci95'][1]:.2f}]) | " + " | ".join(cell(k) for k in kinds) +
                     f" | {ev} | {v['ttft_median_s']:.3f} s | {v['prefilled_mean']:.0f}"
                     + (f" (+ {v['recomputed_mean']:.0f})" if v.get("recomputed_mean") else "") + " | "
                     f"{v['leak_turns']} turns, {v['leak_values']} values |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    s = {c: v for c, v in res["summary"].items() if v}
    kinds = [k for k in next(iter(s.values()))["accuracy"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    w = 0.8 / len(s)
    for i, (c, v) in enumerate(s.items()):
        acc = [v["accuracy"][k]["accuracy"] for k in kinds]
        lo = [max(0.0, a - v["accuracy"][k]["ci95"][0]) for a, k in zip(acc, kinds)]
        hi = [max(0.0, v["accuracy"][k]["ci95"][1] - a) for a, k in zip(acc, kinds)]
        ax.bar([j + i * w for j in range(len(kinds))], acc, w, yerr=[lo, hi], capsize=2, label=c)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("accuracy (95% CI)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"chat memory: {res['args']['users']} users x {res['args']['sessions']} sessions "
                 f"(~{res['history_tokens_per_user']:.0f} tokens of history each), seed {res['seed']}")
    bx.bar(list(s), [v["ttft_median_s"] for v in s.values()], color="grey")
    bx.set_ylabel("median TTFT (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=50, help="sessions of history per user")
    ap.add_argument("--filler", type=int, default=2, help="filler exchanges per session (before the evidence)")
    ap.add_argument("--questions", type=int, default=None,
                    help="ask at most this many of the questions (a random subset; default: all of them)")
    ap.add_argument("--k", type=int, default=3, help="turns recalled per question")
    ap.add_argument("--layout", default=None, help="how recalled turns sit in the window: turns (default) or system")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--conditions", default="none,text,kv,full,oracle")
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh draw")
    ap.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per block of a new store (default: KVMEMORY_BLOCK_TOKENS or 256); a chat "
                         "turn fills one partial block, so small blocks pad less")
    ap.add_argument("--codec", choices=("none", "zstd", "lz4"), default=None,
                    help="KV codec of a new store (default: KVMEMORY_CODEC or none)")
    ap.add_argument("--out", default="benchmarks/results", help="where the JSON and PNG go")
    args = ap.parse_args()
    check_conditions(args.conditions.split(","))
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lay = res["store_layout"]
    stem = out / (f"chat-memory-{time.strftime('%Y-%m-%d')}-s{args.sessions}-{args.layout or 'default'}"
                  f"-b{lay['block_tokens']}-{lay['codec']}")
    write_json(stem.with_suffix(".json"), res)
    plot(res, stem.with_suffix(".png"))
    m = res["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; seed {res['seed']}")
    print(f"history: {res['history_tokens_per_user']:.0f} tokens per user, {res['exchanges']} exchanges remembered; "
          f"write {res['write_ms']['median']:.0f} ms median ({res['write_ms']['p90']:.0f} p90) per exchange, "
          f"{res['write_model_calls']}; {res['kv_bytes_per_token']} KV bytes per token "
          f"({res['disk_bytes_per_token']:.0f} on disk, preludes included; blocks of {res['store_layout']['block_tokens']} "
          f"tokens, codec {res['store_layout']['codec']})")
    print(table(res))
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
