"""Chat memory on conversations the model really had: a user tells a fact in their own words, the model
replies (its own reply, useful or not, is what is remembered), other sessions pass, the memory is
closed and reopened, and the user asks for the fact in a new session, in another form.

Every assistant turn is the model's reply through ChatMemory.reply, the path users take. Facts come
in many phrasings: asked to be remembered, said in passing, corrected in a later session (the latest
value is right, the old one wrong), added to in a later session ("I also speak German": every value
right; --change, --kinds). Distractor sessions (small talk, the model replying) sit between,
and scripted sessions can pad a user's history to --history-tokens (the user pastes a paragraph of
real prose, a standard-library docstring, and asks about it; deposited with remember(), no
generation). --memories chooses what the histories are kept in (the first replies while they are
built): --memories user is a quarter of the deposits, for long histories.

Conditions, side by side on the same histories and questions:

    none            no memory: the question alone
    text-exchange   the recalled turns (the user's words and the reply) quoted as text in the system
                    message (text memory, as mem0-style memories quote)
    kv-exchange     the same turns grafted as KV (kvmemory's default before this benchmark)
    text-user       a remembered turn keeps the user's words alone (ChatMemory(keep="user")), quoted
    kv-user         ... grafted as KV
    kv-user-end     ... grafted as KV and closed with <|im_end|>
    oracle          the fact as the user last told it, quoted as text (the model's ceiling); oracle-open:
                    as a recalled turn opening the new message reads (the day: the run's)
    plain-user      text-user's recalled turns and words, computed as a text-RAG user would: one prefill
                    from nothing and a greedy decode with the model alone, no store, nothing saved (text-user
                    and the others save their window before the first token); plain-exchange: text-exchange's
                    turns the same way. Quoted where text-user quotes them by default, opening the new message:
                    a plain condition takes no suffix that moves them (-system, -messages, -inline, -after)

Variants of a kv condition are named by suffixes: -system (the turns deposited and grafted in the
"system" layout: inside a system message of their own, as text quotes them), -head (the prelude the
turns were computed behind, a system note and a user message's opening, grafted before them and the
message closed after them), -end (closed with <|im_end|>), -rF (F of the grafted tokens recomputed,
CacheBlend; default ChatMemory's), -guard / -noguard (the reply kept from opening as a remembered turn
reads, kvmemory/chat_memory/guard.py, or not; without either ChatMemory's default; text conditions take
it too), -inline (grafted inside the window's system message, where quoting puts the turns:
ChatMemory.place = "system"), -nl (text: the last
quoted turn keeps its newline, as the turns a system-placed graft holds do), -kN (N turns recalled;
default 3), -cutF (a turn recalled after the most relevant one needs F x its BM25 score:
ChatMemory.min_relevance; without it the default's, 0.75; -cut0: the k best turns), -cover / -nocover (under
the cut, a turn holding a word of the question no kept turn holds is kept at half the best's score, or
not: ChatMemory.cover; without either the default's), -rel / -time (the recalled turns in the window
the most relevant last, nearest the question, or oldest first: ChatMemory.order; without either the
default's), -topic / -notopic (after the most relevant turn, only turns holding a content word of the
question, or not: ChatMemory.on_topic; without either the default's), -first / -nofirst (with on_topic, a
most relevant turn holding no content word of the question gives way to the best that does, or not:
ChatMemory.topic_first; without either the default's), -open / -after (the turns opening the new user message,
where the turns layout computed them, the question's words after them: ChatMemory.place = "message"; or
grafted after the conversation, quoted in the system message: "after"; without either the default's), -content /
-held / -allwords (BM25 scores the question's content words alone, "what" and "my" dropped; or all its words,
ranking only the turns holding a content word of it; or all its words, every turn: ChatMemory.lexical),
-newer / -nonewer (a turn said after the most relevant one, holding a word of the question it holds, is kept
under the cut as its update, or not: ChatMemory.newer), -supersede / -nosupersede (of the kept turns holding the
same words of the question, the newest alone, or not: ChatMemory.supersede), -dense / -nodense (the dense
ranking's best turn kept too, room permitting, or not: ChatMemory.dense), -additive / -noadditive (with
supersede, a statement adding to what was told, "I also speak German", kept beside it, or not: ChatMemory.additive),
-lead / -nolead (a first message's first recalled turn restored as stored where it sits as computed, or prefilled
with the rest: ChatMemory.exact_lead), e.g. kv-user-system-r0.6,
kv-user-cut0.75-nocover.
--store DIR keeps the histories (the store and the probes) and reuses them: the conditions of several runs
are then paired on the same conversations.

Reports accuracy with Wilson 95% intervals, paired counts of kv against text, the share of answers
that continue remembered prose (opening as a remembered turn reads: "You replied", "the user said";
or, not answering, repeating the opening of words the window showed: a recalled message or reply;
continues_prose), of those opening as a remembered turn alone, the share of stale answers (naming the
value the user told before correcting it: answers, wrong, not continuations; the judge before
2026-12-06 counted them, continues_v2, shown beside), median TTFT. JSON + PNG. --rejudge FILE judges
an earlier result file's stored answers again with today's judge.

-messages (kv-user-messages, text-user-messages): the turns kept as the chat messages they were (the
user's words a user message of their own), grafted (kv) or quoted (text) before the new message.

    python benchmarks/bench_chat_recall.py --users 10 --facts 20
    python benchmarks/bench_chat_recall.py --store /tmp/recall --conditions text-user,kv-user,kv-user-system
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qa import greedy, wilson  # noqa: E402
from haystack import paragraphs  # noqa: E402
from common import add_common_args, finish, plot, seed_of, write_json  # noqa: E402

NAMES = ["Ingrid", "Tomas", "Aiko", "Mateo", "Leila", "Oskar", "Priya", "Jonas", "Freya", "Ravi", "Elena", "Nils",
         "Sofia", "Karim", "Hanna", "Diego", "Mira", "Lukas", "Amara", "Viktor", "Astrid", "Bruno", "Chiara", "Dmitri"]
PETS = ["Pixel", "Biscuit", "Mango", "Rocket", "Juniper", "Pepper", "Nugget", "Waffles", "Clover", "Ziggy"]
CITIES = ["Bergen", "Lisbon", "Krakow", "Porto", "Tallinn", "Ghent", "Turin", "Malmo", "Lyon", "Graz", "Split"]
CARS = ["Volvo", "Subaru", "Skoda", "Toyota", "Peugeot", "Mazda", "Kia", "Fiat"]
JOBS = ["nurse", "carpenter", "librarian", "pilot", "baker", "chemist", "architect", "plumber"]
COLOURS = ["teal", "amber", "violet", "crimson", "olive", "indigo", "coral", "ochre"]
FOODS = ["risotto", "dumplings", "paella", "lasagne", "falafel", "ramen", "goulash", "pierogi"]
MONTHS = ["January", "March", "April", "June", "August", "September", "October", "December"]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Polish", "Dutch", "Greek", "Turkish", "Swedish"]
INSTRUMENTS = ["cello", "banjo", "clarinet", "harp", "trumpet", "accordion", "oboe", "ukulele"]


def number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


# kind: (values, [ways to tell it], [ways to correct it] or [], [ways to ask for it])
FACTS = {
    "locker": (lambda r: number(r), ["Please remember this: my locker combination is {v}. Reply with OK.",
                                     "By the way, the code for my gym locker is {v}."],
               ["I changed my locker combination, it is {v} now."],
               ["What is my locker combination? Answer with the number.", "Which number opens my gym locker?"]),
    "bike": (lambda r: number(r, 4), ["My bike lock code is {v}, in case I forget.", "Note for later: bike lock {v}."],
             ["New bike lock, the code is {v} now."], ["What is the code of my bike lock?"]),
    "flat": (lambda r: number(r, 3), ["I live in flat {v}.", "Deliveries should go to flat {v}, that's mine."], [],
             ["What is my flat number?", "Which flat do I live in?"]),
    "sister": (lambda r: r.choice(NAMES), ["My sister is called {v}.", "I had lunch with my sister {v} today."], [],
               ["What is my sister's name?", "Who is my sister?"]),
    "brother": (lambda r: r.choice(NAMES), ["My younger brother {v} starts university next week."], [],
                ["What is my brother's name?"]),
    "manager": (lambda r: r.choice(NAMES), ["My manager {v} asked me to lead the new project."], [],
                ["Who is my manager?", "What is my manager called?"]),
    "friend": (lambda r: r.choice(NAMES), ["My best friend {v} is visiting this weekend."], [],
               ["Who is my best friend?"]),
    "dog": (lambda r: r.choice(PETS), ["My dog is called {v}.", "I adopted a puppy and named him {v}."], [],
            ["What is my dog's name?", "What did I name my puppy?"]),
    "cat": (lambda r: r.choice(PETS), ["Our cat {v} knocked a glass off the table again."], [],
            ["What is my cat called?"]),
    "city": (lambda r: r.choice(CITIES), ["I live in {v}.", "Since last year my home has been in {v}."],
             ["I have moved, I live in {v} now."], ["Which city do I live in?", "Where is my home now?"]),
    "hometown": (lambda r: r.choice(CITIES), ["I grew up in {v}."], [], ["Which town did I grow up in?"]),
    "car": (lambda r: r.choice(CARS), ["I drive a {v}.", "My {v} needs new tyres."],
            ["I sold my old car, I drive a {v} now."], ["What car do I drive?", "Which car do I have now?"]),
    "job": (lambda r: r.choice(JOBS), ["I work as a {v}.", "Long shift today, being a {v} is tiring."],
            ["I changed jobs, I am a {v} now."], ["What is my job?", "What do I do for a living?"]),
    "colour": (lambda r: r.choice(COLOURS), ["My favourite colour is {v}."], [], ["What is my favourite colour?"]),
    "food": (lambda r: r.choice(FOODS), ["Nothing beats {v}, it's my favourite food."], [],
             ["What is my favourite food?"]),
    "month": (lambda r: r.choice(MONTHS), ["I was born in {v}.", "My birthday is in {v}."], [],
              ["Which month was I born in?", "When is my birthday month?"]),
    "instrument": (lambda r: r.choice(INSTRUMENTS), ["I play the {v} in a small band."], [],
                   ["Which instrument do I play?"]),
    "allergy": (lambda r: r.choice(["peanuts", "shellfish", "pollen", "cats", "penicillin", "kiwi"]),
                ["Please remember that I am allergic to {v}."], [], ["What am I allergic to?"]),
    "team": (lambda r: r.choice(["Ajax", "Benfica", "Celtic", "Porto", "Lazio", "Sevilla"]),
             ["I support {v}, they won last night!"], [], ["Which football team do I support?"]),
    "language": (lambda r: r.choice(LANGUAGES), ["I speak {v}.", "I grew up speaking {v} at home."], [],
                 ["Which language do I speak?", "What language can I speak?"]),
    "pin": (lambda r: number(r, 4), ["The door code at work is {v}."], ["They reset the door code at work to {v}."],
            ["What is the door code at work?"]),
}
# kinds a later statement adds to, both values then right: kind: ([ways to add], [ways to ask for all]); of the
# ways to add, one a kind says it without the words English adds with ("also", "too", "another": rules.ADDING)
ADDS = {
    "language": (["I also speak {v}.", "I can speak {v} as well.", "Last year I became fluent in {v}."],
                 ["Which languages do I speak?", "What languages can I speak?"]),
    "allergy": (["I found out I am also allergic to {v}.", "Turns out I'm allergic to {v} too.",
                 "Add {v} to the list of things I'm allergic to."], ["What am I allergic to?", "What are my allergies?"]),
    "instrument": (["I play the {v} too.", "I have also started playing the {v}.", "My new hobby: I play the {v} on Sundays."],
                   ["Which instruments do I play?"]),
    "dog": (["We adopted a second dog, {v}.", "Our other dog is called {v}.", "My dog {v} is the younger one."],
            ["What are my dogs called?", "What are the names of my dogs?"]),
    "team": (["I also support {v}.", "{v} is my second team.", "I follow {v} in the cup games."],
             ["Which football teams do I support?"]),
}
NEW_KINDS = ("language",)           # kinds added with ADDS (2026-12-07); --no-additions draws without them
SMALL_TALK = ["Can you suggest a quick breakfast?", "How do I keep basil alive indoors?", "Tell me a fun fact about "
              "octopuses.", "Any tips for sleeping better?", "What is a haiku?", "Recommend a board game for two.",
              "Why is the sky blue?", "How long should I boil an egg?", "What should I pack for a day hike?",
              "How can I learn to juggle?", "What's a good stretch after running?", "How do I remove a coffee stain?"]
CONTINUES = ("you replied", "the user said", "on 20", "user said:", "you said:", "the user asked")
CONDITIONS = ("none", "text-exchange", "kv-exchange", "text-user", "kv-user", "kv-user-end", "oracle")


def opens_as_memory(answer: str) -> bool:
    """The answer opens as a remembered turn reads ("You replied: ...", "On 2026-..., the user said")."""
    a = answer.strip().casefold()
    return any(a.startswith(c) or c in a[:40] for c in CONTINUES)


def continues_prose(answer: str, shown: list[str], is_right: bool, stale: bool = False) -> bool:
    """An answer that continues remembered prose instead of answering: it opens as a remembered turn
    reads, or, not answering, repeats the opening (20 characters) of words the window showed it: a
    recalled user's message or reply (`shown`). An opening the model has without them (its habit: "I'm
    sorry for any confusion, ...") is not a repetition of memory, nor is an answer that quotes the
    user's own sentence with a value of the fact: the right one ("The door code at work is 8013."), or
    (stale) the one the user told before correcting it, a wrong answer but an answer (from 2026-12-06;
    the judge before counted those: continues_v2)."""
    return opens_as_memory(answer) or (not is_right and not stale and repeats(answer, shown))


def is_stale(p: dict, answer: str, is_right: bool) -> bool:
    """A wrong answer that names the value the user told before correcting it."""
    return not is_right and p["old"] is not None and p["old"].casefold() in answer.casefold()


def continues_v1(answer: str, replies: list[str]) -> bool:
    """The first judge (results before 2026-12-05-e): any of the user's remembered replies repeated,
    recalled or not, right or not (so the model's own habits counted too)."""
    return opens_as_memory(answer) or repeats(answer, replies)


def repeats(answer: str, texts: list[str]) -> bool:
    """The answer opens with the first 20 characters of one of `texts` (those of 20 or more)."""
    a = answer.strip().casefold()
    return any(len(r.strip()) >= 20 and a.startswith(r.strip().casefold()[:20]) for r in texts)


def make_probes(rng: random.Random, n: int, kinds=None, change: float = 0.35, additions: bool = True) -> list[dict]:
    """n facts of distinct kinds (of `kinds`, default all) for one user: how each is told and asked, and, with
    probability `change`, corrected later (a kind with corrections) or added to (a kind in ADDS). additions=False:
    the generator before 2026-12-07 (no additions, no language kind): a draw of then, again from its seed."""
    out = []
    pool = sorted(kinds or (FACTS if additions else [k for k in FACTS if k not in NEW_KINDS]))
    for kind in rng.sample(pool, min(n, len(pool))):
        draw, tells, fixes, asks = FACTS[kind]
        v, how = draw(rng), rng.choice(tells)
        p = {"kind": kind, "value": v, "phrasing": how, "tell": how.format(v=v), "ask": rng.choice(asks), "old": None}
        if (fixes or (additions and kind in ADDS)) and rng.random() < change:
            v2 = draw(rng)
            while v2 == v:
                v2 = draw(rng)
            if fixes:
                fix = rng.choice(fixes)
                p.update(old=v, value=v2, fix=fix.format(v=v2), fix_phrasing=fix)
            else:
                ways, asks_all = ADDS[kind]
                add = rng.choice(ways)
                p.update(also=v2, add=add.format(v=v2), add_phrasing=add, ask=rng.choice(asks_all))
        out.append(p)
    return out


def shape(p: dict) -> str:
    """How a probe's fact was told: once, corrected later, or added to later."""
    return "corrected" if p["old"] is not None else "added" if p.get("also") else "told"


def told_text(p: dict) -> str:
    """The fact as the user last told it (the oracle's text): the correction, or the telling and the addition."""
    if p.get("also"):
        return f"{p['tell']} {p['add']}"
    return p.get("fix") or p["tell"]


def values(p: dict) -> list[str]:
    return [p["value"]] + ([p["also"]] if p.get("also") else [])


def right(p: dict, answer: str) -> bool:
    """Every value the user told (an added one too) in the answer, the corrected one not."""
    a = answer.casefold()
    return all(v.casefold() in a for v in values(p)) and (p["old"] is None or p["old"].casefold() not in a)


# the memories a user's history is deposited in: (name suffix, keep, layout)
MEMORIES = {"exchange": ("", "exchange", "turns"), "user": ("#user", "user", "turns"),
            "user-system": ("#usersys", "user", "system"), "user-messages": ("#usermsg", "user", "messages")}


def condition(c: str) -> dict:
    """A condition's name -> {base, memory, end, recompute} (see the module's docstring)."""
    m = re.fullmatch(r"(none|oracle|text|kv|plain)(?:-(exchange|user))?(-system|-messages)?(-head)?(-end)?(?:-r([0-9.]+))?"
                     r"(-guard|-noguard)?(-inline)?(-nl)?(?:-k([1-9][0-9]*))?(?:-cut([0-9.]+))?(-cover|-nocover)?(-rel|-time)?(-topic|-notopic)?(-first|-nofirst)?(-open|-after)?(-content|-held|-allwords)?(-newer|-nonewer)?(-supersede|-nosupersede)?(-dense|-nodense)?(-additive|-noadditive)?(-lead|-nolead)?", c)
    if (m is None or (m.group(3) and (m.group(2) or "exchange") + m.group(3) not in MEMORIES)
            or (m.group(11) and not 0.0 <= float(m.group(11)) <= 1.0)):
        raise SystemExit(f"--conditions: {c!r} is not none, oracle or "
                         "(text|kv|plain)-(exchange|user)[-system|-messages][-head][-end][-rF][-guard|-noguard][-inline][-nl][-kN]"
                         f"[-cutF][-cover|-nocover][-rel|-time][-topic|-notopic][-first|-nofirst][-open|-after][-content|-held|-allwords]"
                         f"[-newer|-nonewer][-supersede|-nosupersede][-dense|-nodense][-additive|-noadditive][-lead|-nolead] (F of -cut in [0, 1]; memories: {', '.join(MEMORIES)})")
    if m.group(1) == "plain" and (m.group(3) or m.group(8) or m.group(16) == "-after"):
        raise SystemExit(f"--conditions: {c!r}: a plain condition quotes the turns opening the new message; it takes "
                         "no -system, -messages, -inline or -after")
    keep = m.group(2) or "exchange"
    return {"base": m.group(1), "memory": keep + (m.group(3) or ""), "head": bool(m.group(4)),
            "end": bool(m.group(5)), "recompute": float(m.group(6)) if m.group(6) else None,
            "guard": {"-guard": True, "-noguard": False}.get(m.group(7)), "inline": bool(m.group(8)), "nl": bool(m.group(9)),
            "k": int(m.group(10)) if m.group(10) else None, "cut": float(m.group(11)) if m.group(11) else None,
            "cover": {"-cover": True, "-nocover": False}.get(m.group(12)),
            "order": {"-rel": "relevance", "-time": "time"}.get(m.group(13)),
            "topic": {"-topic": True, "-notopic": False}.get(m.group(14)),
            "first": {"-first": True, "-nofirst": False}.get(m.group(15)), "place": {"-open": "message", "-after": "after"}.get(m.group(16)),
            "lexical": {"-content": "content", "-held": "held", "-allwords": "all"}.get(m.group(17)),
            "newer": {"-newer": True, "-nonewer": False}.get(m.group(18)),
            "supersede": {"-supersede": True, "-nosupersede": False}.get(m.group(19)),
            "dense": {"-dense": True, "-nodense": False}.get(m.group(20)),
            "additive": {"-additive": True, "-noadditive": False}.get(m.group(21)),
            "lead": {"-lead": True, "-nolead": False}.get(m.group(22))}


# condition keys -> the ChatMemory attribute each sets for one reply (None in a condition: the default's)
SETS = (("guard", "guard"), ("cut", "min_relevance"), ("cover", "cover"), ("order", "order"), ("topic", "on_topic"),
        ("first", "topic_first"), ("lexical", "lexical"), ("newer", "newer"),
        ("supersede", "supersede"), ("dense", "dense"), ("additive", "additive"), ("lead", "exact_lead"))


def told(cms, session: str, text: str, max_new_tokens: int) -> str:
    """The user says `text` in `session`; the model replies through the first memory (remembered
    there: "exchange" where it is kept); the same exchange is remembered by the others. Returns the reply."""
    first, *others = cms.values()
    reply, _ = first.reply([{"role": "user", "content": text}], session=session, max_new_tokens=max_new_tokens)
    for cm in others:
        cm.remember([{"role": "user", "content": text}, {"role": "assistant", "content": reply}], session)
    return reply


PAD_ASKS = ("Can you explain this to me?", "What does this mean?", "I read this today, thoughts?",
            "Summarise this for me please:", "Is this right?")


def history(rng, mem, name: str, probes: list[dict], args, bar, pad_text=()) -> tuple[dict, list[str]]:
    cms = {k: mem.chat_memory(name + MEMORIES[k][0], keep=MEMORIES[k][1], layout=MEMORIES[k][2])
           for k in args.memories.split(",")}
    replies, s = [], 0
    events = ([("tell", p) for p in probes] + [("fix", p) for p in probes if p["old"] is not None]
              + [("add", p) for p in probes if p.get("also")])
    rng.shuffle(events)
    events.sort(key=lambda e: e[0] != "tell")         # every correction and addition after every first telling
    for what, p in events:
        replies.append(told(cms, f"s{s}", p[what], args.reply_tokens))
        s += 1
        for _ in range(args.distractors):
            replies.append(told(cms, f"s{s}", rng.choice(SMALL_TALK), args.reply_tokens))
            s += 1
        if bar is not None:
            bar.update(1)
    # scripted sessions, remembered without generation: the user pastes a paragraph of real prose (the
    # standard library's docstrings) and asks about it; the reply is scripted
    first = next(iter(cms.values()))
    pad, i = sum(x["tokens"] for x in first.sessions()), 0
    while pad < args.history_tokens:
        ex = [{"role": "user", "content": f"{rng.choice(PAD_ASKS)} {rng.choice(pad_text)}"},
              {"role": "assistant", "content": "Happy to help with that."}]
        for cm in cms.values():
            added = cm.remember(ex, f"pad{i}")
            if cm is first:
                docs = mem.rt.store().manifest.docs
                pad += sum(docs[d].n_tokens for d in added)
        i += 1
    return cms, replies


def ask(mem, name: str, p: dict, c: str, args, replies: list[str]) -> dict:
    cond = condition(c)
    sfx, keep, layout = MEMORIES[cond["memory"]]
    cm = mem.chat_memory(name + sfx, keep=keep, layout=layout, recompute=cond["recompute"])
    base = cond["base"]
    msgs = [{"role": "user", "content": p["ask"]}]
    if base == "oracle" and cond["place"] == "message":      # as a recalled turn opening the message reads
        from kvmemory.chat_memory.turns import turn_text
        day = time.strftime("%Y-%m-%d", time.gmtime())
        msgs = [{"role": "user", "content": turn_text("user", day, told_text(p), "") + p["ask"]}]
        base = "none"
    elif base == "oracle":
        msgs = [{"role": "system", "content": "What this user said in earlier conversations:\n"
                 + told_text(p)}] + msgs
        base = "none"
    # (cm is this question's own object: mem.chat_memory makes a new one a call)
    if cond["end"] or cond["head"]:
        cm.foot_text = "<|im_end|>\n"
    if cond["head"]:          # the turns' own prelude grafted before them, their message closed after
        cm.graft_head = True
    for key, attr in SETS:
        if cond[key] is not None:
            setattr(cm, attr, cond[key])
    if cond["inline"]:        # grafted inside the window's system message, where quoting puts the turns
        cm.place = "system"
    if cond["place"]:         # opening the new user message, its words after them; or after the conversation
        cm.place = cond["place"]
    from kvmemory.chat_memory import window
    window.QUOTE_END = "\n" if cond["nl"] else ""
    try:
        if base == "plain":
            text, st = plain_reply(mem, cm, msgs, args.answer_tokens, cond["k"] or window.RECALL_TURNS)
        else:
            text, st = cm.reply(msgs, session="ask", max_new_tokens=args.answer_tokens, as_=base, remember=False,
                                k=cond["k"] or window.RECALL_TURNS)
    finally:
        window.QUOTE_END = ""
    shown = [m["content"] for h in st.get("recalled", []) for m in _messages(h["text"])]
    if cond["base"] == "oracle":
        shown = [told_text(p)]
    ok = right(p, text)
    stale = is_stale(p, text, ok)
    return {"answer": text, "right": ok, "continues": continues_prose(text, shown, ok, stale), "stale": stale,
            "continues_v2": continues_prose(text, shown, ok), "opens_as_memory": opens_as_memory(text),
            "continues_v1": continues_v1(text, replies),
            "ttft_s": st["ttft_s"], "restored": st.get("tokens_restored", 0), "recalled": len(st.get("recalled", [])),
            "recalled_tokens": sum(r["tokens"] for r in st.get("recalled", [])),
            "found": all(any(v in r["text"] for r in st.get("recalled", [])) for v in values(p))}


def plain_reply(mem, cm, msgs: list[dict], max_new_tokens: int, k: int) -> tuple[str, dict]:
    """What a text-RAG user pays for quoting the same turns: cm's recall, the turns opening the new message as
    text-user quotes them there, then bench_qa's text baseline (a prefill from nothing and a greedy decode with
    the model alone: no store, no state saved, no guard). -> (reply, stats as ChatMemory.reply gives them:
    ttft_s from the recall on, recalled)."""
    import torch

    from kvmemory import prompts
    t0 = time.perf_counter()
    hits = cm.recall(msgs[-1]["content"], k=k, exclude_session="ask")
    if hits:
        msgs = msgs[:-1] + [{"role": "user", "content": "".join(h.text for h in hits) + msgs[-1]["content"]}]
    ids = prompts.chat_ids(mem.tokenizer, msgs)
    before = time.perf_counter() - t0
    with torch.inference_mode():
        text, ttft, _ = greedy(mem.model, mem.tokenizer, ids, max_new_tokens)
    return text.strip(), {"ttft_s": before + ttft, "recalled": [{"text": h.text, "tokens": h.n_tokens} for h in hits]}


def _messages(turn: str) -> list[dict]:
    """A recalled turn's prose (kvmemory/chat_memory/turns.py) -> its user message and reply."""
    from kvmemory.chat_memory.turns import REPLIED, said
    out = [{"role": "user", "content": said(turn)}]
    if REPLIED in turn:
        out.append({"role": "assistant", "content": turn.split(REPLIED, 1)[1].rstrip("\n")})
    return out


def histories(args, seed: int) -> tuple[Path, dict]:
    """The users' conversations, built now (the model replying) or, with --store, reused from an earlier
    run: (the store's path, {users, replies, tokens, history_s, seed})."""
    import kvmemory
    root = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="kvm-recall-"))
    path, saved = root / "m.kvm", root / "histories.json"
    if saved.is_file():
        got = json.loads(saved.read_text())
        print(f"reusing the histories in {root} (seed {got['seed']})", file=sys.stderr)
        return path, got
    rng = random.Random(seed)
    kinds = args.kinds.split(",") if args.kinds else None
    users = {f"user-{i}-{rng.randrange(1 << 20):05x}": make_probes(rng, args.facts, kinds, args.change, args.additions)
             for i in range(args.users)}
    bar = _bar(sum(len(p) + sum(shape(x) != "told" for x in p) for p in users.values()), "conversations")
    replies: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    t0 = time.perf_counter()
    pad_text = paragraphs(random.Random(seed), min_chars=300) if args.history_tokens else ()
    with kvmemory.Memory(path) as mem:
        for name, probes in users.items():
            cms, replies[name] = history(rng, mem, name, probes, args, bar, pad_text)
            tokens[name] = sum(x["tokens"] for x in next(iter(cms.values())).sessions())
    if bar is not None:
        bar.close()
    got = {"users": users, "replies": replies, "tokens": tokens, "history_s": time.perf_counter() - t0, "seed": seed,
           "memories": args.memories}
    if args.store:
        write_json(saved, got)
    return path, got


def run(args, seed: int) -> dict:
    import kvmemory
    conds = args.conditions.split(",")
    saved = Path(args.store) / "histories.json" if args.store else None
    # the memories the histories are kept in: a kept store's (all of them for one kept before --memories)
    kept = (json.loads(saved.read_text()).get("memories", ",".join(MEMORIES)) if saved and saved.is_file()
            else args.memories).split(",")
    if not kept or any(k not in MEMORIES for k in kept):
        raise SystemExit(f"--memories: {','.join(kept)!r} is not a list of {', '.join(MEMORIES)}")
    for c in conds:                                   # before any history is built
        cond = condition(c)
        if cond["base"] in ("text", "kv", "plain") and cond["memory"] not in kept:
            raise SystemExit(f"--conditions: {c!r} needs the memory {cond['memory']!r}; the histories keep "
                             f"{', '.join(kept)} (--memories)")
    path, h = histories(args, seed)
    users, replies, tokens, history_s = h["users"], h["replies"], h["tokens"], h["history_s"]
    rows = []
    bar = _bar(sum(len(p) for p in users.values()) * len(conds), "questions")
    forgotten = 0
    with kvmemory.Memory(path) as mem:                # reopened: what a restart sees
        for name, probes in users.items():
            for p in probes:
                row = {"user": name, **p}
                for c in conds:      # (a later text condition may restore the window an earlier one quoted: "restored")
                    row[c] = ask(mem, name, p, c, args, replies[name])
                    if bar is not None:
                        bar.update(1)
                rows.append(row)
            # the user's question states go as soon as the user is done (at ~100K tokens a user they
            # are gigabytes a run: a quoted window's prefix is saved for each text answer)
            forgotten += undo_questions(mem, [name], kept)
    if bar is not None:
        bar.close()
    return {"users": len(users), "probes": len(rows), "question_states_removed": forgotten, "histories_seed": h["seed"], "phrasings": len({r["phrasing"] for r in rows} | {r["fix_phrasing"] for r in rows if r["old"]}
                                                                                                  | {r["add_phrasing"] for r in rows if r.get("also")}),
            "history_tokens_per_user": statistics.mean(tokens.values()), "history_s": history_s,
            "replies": {n: r[:40] for n, r in replies.items()}, "rows": rows, "summary": summarize(rows, conds)}


def undo_questions(mem, users, kept=tuple(MEMORIES)) -> int:
    """Forget the states the questions saved (each reply saves its conversation, session "ask") and gc
    their bytes: a later run on the same --store starts from the histories alone (quoting's prefixes
    are not restored from an earlier run, and ~12 MB a reply does not pile up). Returns the states."""
    n = 0
    for name in users:
        for sfx, keep, layout in (MEMORIES[k] for k in kept):
            n += mem.chat_memory(name + sfx, keep=keep, layout=layout).forget(session="ask").states
    mem.gc(grace_s=0)
    return n


def summarize(rows: list[dict], conds: list[str]) -> dict:
    out = {}
    for c in conds:
        n = len(rows)
        k = sum(r[c]["right"] for r in rows)
        lo, hi = wilson(k, n)
        out[c] = {"right": k, "n": n, "accuracy": k / n, "wilson95": [lo, hi],
                  "continues": sum(r[c]["continues"] for r in rows) / n,
                  "opens_as_memory": sum(r[c].get("opens_as_memory", False) for r in rows) / n,
                  "continues_v1": sum(r[c].get("continues_v1", r[c]["continues"]) for r in rows) / n,
                  "continues_v2": sum(r[c].get("continues_v2", r[c]["continues"]) for r in rows) / n,
                  "stale": sum(r[c].get("stale", False) for r in rows) / n,
                  "ttft_median_s": statistics.median(r[c]["ttft_s"] for r in rows),
                  "evidence_recalled": sum(r[c]["found"] for r in rows) / n,
                  # for each way a fact was told: [right, probes, every value recalled]
                  "shapes": {sh: [sum(r[c]["right"] for r in rows if shape(r) == sh), sum(shape(r) == sh for r in rows),
                                  sum(r[c]["found"] for r in rows if shape(r) == sh)] for sh in ("told", "corrected", "added")},
                  # for each kind of fact (job, city, locker, ...): [right, probes, every value recalled]
                  "kinds": {kd: _kind_counts(rows, c, kd) for kd in sorted({r["kind"] for r in rows})}}
    for kv in conds:                                  # each kv condition against quoting the same turns
        cond = condition(kv)
        if cond["base"] != "kv":
            continue
        # against quoting the same turns in the system message (text-<keep>), and against quoting them
        # in the same form (text-<memory>: the same window prefilled) where that differs
        quoting, same = "text-" + cond["memory"].split("-")[0], "text-" + cond["memory"]
        pairs = {f"paired_{kv}": quoting, **({f"paired_{kv}/same-form": same} if same != quoting else {})}
        for key, text in pairs.items():
            if text in conds:
                out[key] = {"against": text, "kv_only": sum(r[kv]["right"] and not r[text]["right"] for r in rows),
                            "text_only": sum(r[text]["right"] and not r[kv]["right"] for r in rows)}
    return out


def rejudge(res: dict) -> dict:
    """A result file's rows judged again: a stale answer (is_stale) no longer continues prose (the judge
    before counted it: continues_v2, kept). Exact from the stored fields: the judge changed only there."""
    conds = [c for c in res["summary"] if not c.startswith("paired_")]
    for r in res["rows"]:
        for c in conds:
            x = r[c]
            x.setdefault("continues_v2", x["continues"])
            x["stale"] = is_stale(r, x["answer"], x["right"])
            x["continues"] = x["continues_v2"] and (x["opens_as_memory"] or not x["stale"])
    return {**res, "summary": summarize(res["rows"], conds)}


def _bar(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc)


def table(res: dict) -> str:
    lines = ["| condition | right | accuracy (Wilson 95%) | continues prose (opens as memory) | stale (judge before) "
             "| evidence recalled | median TTFT | told once / corrected / added |", "|---|---|---|---|---|---|---|---|"]
    for c, s in res["summary"].items():
        if c.startswith("paired_"):
            continue
        lo, hi = s["wilson95"]
        lines.append(f"| {c} | {s['right']}/{s['n']} | {s['accuracy']:.1%} ({lo:.1%}-{hi:.1%}) | {s['continues']:.1%} "
                     f"({s['opens_as_memory']:.1%}) | {s.get('stale', 0):.1%} ({s.get('continues_v2', s['continues']):.1%}) "
                     f"| {s['evidence_recalled']:.1%} | {s['ttft_median_s']:.3f} s | "
                     + " / ".join(f"{x[0]}/{x[1]}" for x in s.get("shapes", {}).values()) + " |")
    for c, p in res["summary"].items():
        if c.startswith("paired_"):
            lines.append(f"\npaired, {c[7:]} against {p['against']}: {c[7:]} alone right {p['kv_only']}, "
                         f"{p['against']} alone right {p['text_only']}")
    return "\n".join(lines) + "\n\n" + kinds_table(res)


def kinds_table(res: dict) -> str:
    """Right answers for each kind of fact (rows) under each condition (columns): right/probes, and in brackets
    the probes whose every value was recalled (a condition recalling nothing: none)."""
    conds = [c for c in res["summary"] if not c.startswith("paired_")]
    kinds = sorted({r["kind"] for r in res["rows"]})
    lines = ["| kind of fact | " + " | ".join(conds) + " |", "|---" * (len(conds) + 1) + "|"]
    for kd in kinds:
        cells = []
        for c in conds:
            right, n, found = _kind_counts(res["rows"], c, kd)
            cells.append(f"{right}/{n}" + (f" ({found})" if res["summary"][c]["evidence_recalled"] else ""))
        lines.append(f"| {kd} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kind_counts(rows: list[dict], c: str, kd: str) -> list[int]:
    """[right, probes, every value recalled] of condition c on the probes of kind kd."""
    mine = [r for r in rows if r["kind"] == kd]
    return [sum(r[c]["right"] for r in mine), len(mine), sum(r[c]["found"] for r in mine)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--facts", type=int, default=20, help=f"facts a user tells (at most {len(FACTS)} kinds)")
    ap.add_argument("--distractors", type=int, default=1, help="small-talk sessions after each telling")
    ap.add_argument("--kinds", default=None, metavar="K,K",
                    help=f"the kinds of fact drawn (default all: {', '.join(sorted(FACTS))})")
    ap.add_argument("--change", type=float, default=0.35,
                    help="the chance a fact is corrected later (a kind with corrections) or added to (a kind with "
                         f"additions: {', '.join(ADDS)})")
    ap.add_argument("--no-additions", dest="additions", action="store_false",
                    help="draw no additions and no kind added with them: the generator before 2026-12-07, so an "
                         "earlier result's histories seed draws its probes again")
    ap.add_argument("--history-tokens", type=int, default=0,
                    help="pad each user's history to this many tokens with scripted sessions (the user "
                         "pastes a paragraph of real prose and asks about it)")
    ap.add_argument("--memories", default=",".join(MEMORIES),
                    help=f"the memories each history is kept in (of {', '.join(MEMORIES)}; the first replies): "
                         "fewer is faster to build")
    ap.add_argument("--reply-tokens", type=int, default=32, help="the model's replies in the history")
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma-separated; kv variants take -system, -end, -rF suffixes (see above)")
    ap.add_argument("--store", default=None, metavar="DIR",
                    help="keep the histories here, or reuse them if DIR holds them (default: a temp dir, built anew)")
    ap.add_argument("--rejudge", default=None, metavar="FILE",
                    help="judge a result file's stored answers again with today's judge (continues_prose) and "
                         "print its table; nothing is run")
    add_common_args(ap)
    args = ap.parse_args()
    if args.rejudge:
        print(table(rejudge(json.loads(Path(args.rejudge).read_text()))))
        return 0
    if args.kinds and (bad := [k for k in args.kinds.split(",") if k not in FACTS]):
        ap.error(f"--kinds: {', '.join(bad)} not among {', '.join(sorted(FACTS))}")
    if not 0.0 <= args.change <= 1.0:
        ap.error(f"--change is a chance in [0, 1], got {args.change}")
    seed = seed_of(args)
    res = run(args, seed)
    print(table(res))
    out = finish(res, seed, args, f"chat-recall-{res['probes']}")
    conds = [c for c in res["summary"] if not c.startswith("paired_")]

    def draw(fig):
        axes = fig.subplot_mosaic([["right", "ttft"], ["kinds", "kinds"]])
        ax1, ax2, ax3 = axes["right"], axes["ttft"], axes["kinds"]
        s = res["summary"]
        ax1.bar(conds, [s[c]["accuracy"] for c in conds])
        ax1.set_ylabel("answered right")
        ax1.tick_params(axis="x", rotation=45)
        ax2.bar(conds, [s[c]["ttft_median_s"] for c in conds])
        ax2.set_ylabel("median TTFT (s)")
        ax2.tick_params(axis="x", rotation=45)
        kinds = sorted({r["kind"] for r in res["rows"]})
        width = 0.8 / len(conds)
        for i, c in enumerate(conds):                 # each kind of fact: the share answered, per condition
            shares = [right / n for right, n, _ in (_kind_counts(res["rows"], c, kd) for kd in kinds)]
            ax3.bar([j + i * width for j in range(len(kinds))], shares, width, label=c)
        ax3.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds, rotation=45)
        ax3.set_ylabel("answered right, by kind")
        ax3.set_ylim(0, 1.2)
        ax3.legend(fontsize="small", ncols=min(4, len(conds)), loc="upper center")
        fig.suptitle(f"chat recall on the model's own conversations: {res['probes']} probes, seed {seed}")
    plot(out, draw, size=(12, 8.5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
