"""Fresh random haystacks and questions for QA benchmarks (new draws every run).

Haystack text is real prose: paragraphs of docstrings from the Python standard library on
this machine, shuffled. Needles come in several shapes with random keys and values; each
key (city, person) is used once per haystack, so a question has exactly one right answer.
"""

from __future__ import annotations

import ast
import os
import random
import re
from collections import Counter
from dataclasses import dataclass

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tbilisi", "Quito", "Dakar", "Perth", "Riga", "Accra",
          "Bergen", "Cusco", "Tromso", "Zagreb", "Tunis", "Lyon", "Kyoto", "Porto", "Malmo", "Ghent", "Bilbao",
          "Krakow", "Sapporo", "Valencia", "Tallinn", "Windhoek", "Hobart", "Cordoba", "Mombasa", "Izmir", "Leeds",
          "Utrecht", "Aarhus", "Gdansk", "Salta", "Durban", "Pune", "Busan", "Cebu", "Fez", "Kazan", "Trieste",
          "Granada", "Dublin", "Vilnius", "Split", "Ohrid", "Bruges", "Seville", "Naples", "Turin", "Basel",
          "Geneva", "Bremen", "Leipzig", "Nantes", "Lille", "Bologna", "Verona", "Antwerp", "Graz", "Brno",
          "Arequipa", "Bamako", "Chiclayo", "Dundee", "Esbjerg", "Faro", "Galway", "Haifa", "Iquitos", "Jaipur",
          "Kigali", "Lusaka", "Maputo", "Nagoya", "Odense", "Palermo", "Rabat", "Sendai", "Tampere", "Uppsala",
          "Varna", "Wroclaw", "Yerevan", "Zurich", "Aveiro", "Bursa", "Cadiz", "Debrecen", "Erfurt", "Florence",
          "Gothenburg", "Harbin", "Innsbruck", "Jena", "Kaunas", "Linz", "Mendoza", "Nice", "Oulu", "Plovdiv",
          "Recife", "Siena", "Toulouse", "Ulm", "Vigo", "Wuhan", "Xalapa", "Yokohama", "Zadar", "Arusha", "Bergamo",
          "Calgary", "Darwin", "Essen", "Fukuoka", "Genoa", "Hamilton", "Ibadan", "Kobe", "Lublin", "Malaga",
          "Nis", "Oviedo", "Parma", "Regina"]
FIRST = ["Alice", "Bilal", "Chen", "Dara", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jana", "Kofi", "Lena", "Marco",
         "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wanda", "Yusuf"]
LAST = ["Moreno", "Haddad", "Wei", "Okafor", "Yilmaz", "Nasser", "Petrov", "Sato", "Kowalski", "Novak", "Mensah",
        "Fischer", "Rossi", "Dubois", "Silva", "Larsen", "Horvat", "Tanaka", "Costa", "Berg"]
COLOURS = ["crimson", "teal", "amber", "violet", "olive", "maroon", "indigo", "coral", "azure", "ochre"]
JOBS = ["baker", "nurse", "pilot", "carpenter", "librarian", "chemist", "tailor", "plumber"]
SHAPES = ("number", "passkey", "fact", "multi", "real")
NEEDLE_SHAPES = SHAPES[:4]


@dataclass(frozen=True)
class Question:
    shape: str
    needles: tuple[str, ...]     # sentences placed in the haystack
    question: str
    answers: tuple[str, ...]     # every one must appear in a correct reply
    distractors: tuple[str, ...] = ()   # sentences placed too that answer no question (same-shape records)
    gap: int = 0                 # > 0: the needles placed in order, this many prose paragraphs apart


def paragraphs(rng: random.Random, min_chars: int = 200, prose: str = "stdlib") -> list[str]:
    """Docstring paragraphs (real English prose), each once. prose="stdlib": the standard library's
    modules (~1,100 paragraphs, ~0.1M tokens); "site": those and every installed package's too
    (~55,000 paragraphs, ~5M tokens: for haystacks that must not repeat their text)."""
    files = sorted(os.path.join(os.path.dirname(os.__file__), f) for f in os.listdir(os.path.dirname(os.__file__)))
    if prose == "site":
        import site
        for root in (d for d in site.getsitepackages() if os.path.isdir(d)):
            files += sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs)
    elif prose != "stdlib":
        raise ValueError(f"prose is stdlib or site, got {prose!r}")
    out, seen = [], set()
    for path in files:
        if not path.endswith(".py"):
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                for p in (doc.split("\n\n") if doc else ()):
                    flat = " ".join(p.split())
                    # a docstring may hold control characters (a NUL in a package's test data): not
                    # prose, and a document with one is refused as binary (decode_text)
                    if any(ord(ch) < 32 or ord(ch) == 127 for ch in flat):
                        continue
                    if len(p) >= min_chars and flat not in seen:
                        seen.add(flat)
                        out.append(flat)
    rng.shuffle(out)
    return out


def make_questions(rng: random.Random, n: int) -> list[Question]:
    """n needle questions cycling through NEEDLE_SHAPES, with keys unique within the draw."""
    cities = rng.sample(CITIES, len(CITIES))
    people = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], len(FIRST) * len(LAST))
    city, person = iter(cities), iter(people)
    out = []
    for i in range(n):
        shape = NEEDLE_SHAPES[i % len(NEEDLE_SHAPES)]
        if shape == "number":
            v, c = str(rng.randrange(1_000_000, 9_999_999)), next(city)
            out.append(Question(shape, (f"The special magic number for {c} is {v}.",),
                                f"What is the special magic number for {c}?", (v,)))
        elif shape == "passkey":
            v, who = f"{rng.choice(COLOURS)}-{rng.randrange(100, 999)}", next(person)
            out.append(Question(shape, (f"The pass key of {who} is {v}. Remember it.",),
                                f"What is the pass key of {who}?", (v,)))
        elif shape == "fact":
            who, c = next(person), next(city)
            out.append(Question(shape, (f"{who} moved to {c} last year and works there as a {rng.choice(JOBS)}.",),
                                f"Which city did {who} move to?", (c,)))
        else:   # two facts about one person, stated apart: both are needed
            who, c = next(person), next(city)
            v = str(rng.randrange(100, 999))
            out.append(Question(shape, (f"{who} lives in {c}.", f"The locker number of {who} is {v}."),
                                f"Where does {who} live, and what is the locker number of {who}?", (c, v)))
    return out


GENERATORS = ("mixed", "records", "paraphrase", "span", "real")
RECORD_COLOURS = ["purple", "orange", "green", "yellow", "silver", "golden", "scarlet", "turquoise", "beige",
                  "magenta", "lavender", "navy", "pink", "brown", "grey", "white", "black", "cyan", "bronze", "ivory"]
BIRDS = ["herons", "swans", "cranes", "storks", "gulls", "ducks", "geese", "egrets", "pelicans", "terns",
         "coots", "grebes", "plovers", "curlews", "ibises", "cormorants"]
LAKES = ["Lake Ohrid", "Lake Bled", "Lake Como", "Lake Garda", "Lake Constance", "Lake Balaton", "Lake Geneva",
         "Lake Annecy", "Lake Vanern", "Lake Saimaa"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
INSTRUMENTS = ["cello", "oboe", "banjo", "harp", "trumpet", "accordion", "clarinet", "mandolin", "bassoon", "sitar"]
FLOWERS = ["tulips", "peonies", "lilies", "dahlias", "orchids", "marigolds", "irises", "camellias", "poppies"]


def records(rng: random.Random, n: int, per_family: int = 12) -> list[Question]:
    """Same-shape records that differ in one attribute: a dozen lockers told apart by colour, a
    dozen bird counts at one lake told apart by the bird, a dozen appointments told apart by the
    person. n of them are asked about; every record of a family is in the haystack (the others as
    distractors of the first question), so each question has eleven near-twins."""
    out: list[Question] = []
    while len(out) < n:
        kind = ("locker", "birds", "date")[(len(out) // per_family) % 3]
        recs = []
        if kind == "locker":
            for c in rng.sample(RECORD_COLOURS, per_family):
                v = str(rng.randrange(1000, 9999))
                recs.append((f"The {c} locker holds the number {v}.", f"What number does the {c} locker hold?", (v,)))
        elif kind == "birds":
            lake = rng.choice(LAKES)
            for b in rng.sample(BIRDS, per_family):
                v = str(rng.randrange(11, 499))
                recs.append((f"At the {lake} survey, the count of {b} was {v}.",
                             f"How many {b} were counted at the {lake} survey?", (v,)))
        else:
            people = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], per_family)
            for who in people:
                m, d = rng.choice(MONTHS), str(rng.randrange(2, 29))
                recs.append((f"The dentist appointment of {who} is on {m} {d}.",
                             f"On which date is the dentist appointment of {who}?", (m, d)))
        take = min(n - len(out), per_family)
        asked, rest = recs[:take], recs[take:]
        for i, (needle, q, a) in enumerate(asked):
            out.append(Question("records", (needle,), q, a, tuple(r[0] for r in rest) if i == 0 else ()))
    return out


def paraphrased(rng: random.Random, n: int) -> list[Question]:
    """Questions that share the person's name with their passage and few other words."""
    people = iter(rng.sample([f"{f} {l}" for f in FIRST for l in LAST], len(FIRST) * len(LAST)))
    cities = iter(rng.sample(CITIES, len(CITIES)))
    out = []
    for i in range(n):
        who = next(people)
        k = i % 5
        if k == 0:
            c = next(cities)
            out.append(Question("paraphrase", (f"{who} was born in the harbour town of {c}.",),
                                f"Where is the birthplace of {who}?", (c,)))
        elif k == 1:
            c = next(cities)
            out.append(Question("paraphrase", (f"Every winter, {who} takes the train to see relatives in {c}.",),
                                f"Which place does {who} visit family in during the cold season?", (c,)))
        elif k == 2:
            v = str(rng.randrange(120, 990))
            out.append(Question("paraphrase", (f"The bakery owned by {who} sells {v} loaves on an ordinary morning.",),
                                f"How much bread does the shop of {who} make per day?", (v,)))
        elif k == 3:
            v = rng.choice(INSTRUMENTS)
            out.append(Question("paraphrase", (f"{who} learned to play the {v} from a neighbour at age nine.",),
                                f"Which musical instrument does {who} know?", (v,)))
        else:
            v = rng.choice(FLOWERS)
            out.append(Question("paraphrase", (f"The garden behind the house of {who} is full of {v}.",),
                                f"What plants grow in the backyard of {who}?", (v,)))
    return out


def spanning(rng: random.Random, n: int) -> list[Question]:
    """Two facts about one person a prose paragraph apart (most often in adjacent blocks): both needed."""
    people = iter(rng.sample([f"{f} {l}" for f in FIRST for l in LAST], len(FIRST) * len(LAST)))
    cities = iter(rng.sample(CITIES, len(CITIES)))
    out = []
    for _ in range(n):
        who, c, v = next(people), next(cities), str(rng.randrange(100, 999))
        out.append(Question("span", (f"{who} rented a flat in {c} this spring.",
                                     f"The door code of that flat of {who} is {v}."),
                            f"In which city is the flat of {who}, and what is its door code?", (c, v), gap=1))
    return out


def generated(rng: random.Random, generator: str, n: int) -> list[Question]:
    """n needle questions of a generator (GENERATORS; "mixed": make_questions' four shapes; "real"
    has no needles: real_questions draws them from the haystack's text)."""
    if generator == "mixed":
        return make_questions(rng, n)
    if generator == "records":
        return records(rng, n)
    if generator == "paraphrase":
        return paraphrased(rng, n)
    if generator == "span":
        return spanning(rng, n)
    if generator == "real":
        return []
    raise ValueError(f"generator is one of {GENERATORS}, got {generator!r}")


def haystack(rng: random.Random, tokenizer, n_tokens: int, questions: list[Question], prose: str = "stdlib") -> str:
    """n_tokens (give or take a paragraph) of shuffled prose with every needle at a random depth
    (a paragraph boundary). The prose is cut to size before the needles go in, so none is lost.
    Past the end of `prose`'s paragraphs they repeat (stdlib: past ~0.1M tokens; "site": ~5M)."""
    paras = paragraphs(rng, prose=prose)
    needles = [nd for q in questions for nd in q.needles + q.distractors]
    room = n_tokens - sum(len(tokenizer(nd, add_special_tokens=False)["input_ids"]) + 1 for nd in needles)
    chosen, total, i = [], 0, 0
    while True:
        p = paras[i % len(paras)]
        n = len(tokenizer("\n\n" + p, add_special_tokens=False)["input_ids"])
        if total + n > room:
            break
        chosen.append(p)
        total += n
        i += 1
    for q in questions:
        units = list(q.distractors)
        if q.gap:                   # the needles in order, q.gap prose paragraphs apart, as one unit
            parts = [q.needles[0]]
            for nd in q.needles[1:]:
                parts += [chosen.pop(rng.randrange(len(chosen))) for _ in range(q.gap)] + [nd]
            units.append("\n\n".join(parts))
        else:
            units += q.needles
        for u in units:
            chosen.insert(rng.randrange(len(chosen) + 1), u)
    return "\n\n".join(chosen)


_SENTENCE = re.compile(r"(?<![\w.])[A-Z][A-Za-z0-9 ,;:'-]{30,300}[.!?](?=\s)")   # prose, not code
_WORD = re.compile(r"[A-Za-z]{6,}")


def real_questions(rng: random.Random, text: str, n: int) -> list[Question]:
    """Questions about the haystack's own prose, not inserted needles: a sentence of the text is
    quoted with one word blanked out, and the word is the answer. The sentence occurs once, and
    the word (6+ letters) occurs nowhere else in the text: only that sentence answers it."""
    low = Counter(re.findall(r"\w+", text.lower()))      # \bword\b's matches, counted once for the text
    counts: dict[str, int] = {}
    for m in _SENTENCE.finditer(text):
        counts[m.group(0)] = counts.get(m.group(0), 0) + 1
    pool = []
    for sent, c in counts.items():
        if c != 1 or not 8 <= len(sent.split()) <= 40:
            continue
        words = [w for w in _WORD.findall(sent[1:]) if low[w.lower()] == 1]
        if words:
            pool.append((sent, rng.choice(words)))
    rng.shuffle(pool)
    out = []
    for sent, word in pool[:n]:
        blank = re.sub(rf"\b{word}\b", "___", sent, count=1)
        out.append(Question("real", (sent,), f'Which word is missing here: "{blank}"', (word,)))
    return out
