"""Fresh random haystacks and questions for QA benchmarks (new draws every run).

Haystack text is real prose: paragraphs of docstrings from the Python standard library on
this machine, shuffled. Needles come in several shapes with random keys and values; each
key (city, person) is used once per haystack, so a question has exactly one right answer.
"""

from __future__ import annotations

import ast
import os
import random
from dataclasses import dataclass

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tbilisi", "Quito", "Dakar", "Perth", "Riga", "Accra",
          "Bergen", "Cusco", "Tromso", "Zagreb", "Tunis", "Lyon", "Kyoto", "Porto", "Malmo", "Ghent", "Bilbao",
          "Krakow", "Sapporo", "Valencia", "Tallinn", "Windhoek", "Hobart", "Cordoba", "Mombasa", "Izmir", "Leeds",
          "Utrecht", "Aarhus", "Gdansk", "Salta", "Durban", "Pune", "Busan", "Cebu", "Fez", "Kazan", "Trieste",
          "Granada", "Dublin", "Vilnius", "Split", "Ohrid", "Bruges", "Seville", "Naples", "Turin", "Basel",
          "Geneva", "Bremen", "Leipzig", "Nantes", "Lille", "Bologna", "Verona", "Antwerp", "Graz", "Brno"]
FIRST = ["Alice", "Bilal", "Chen", "Dara", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jana", "Kofi", "Lena", "Marco",
         "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wanda", "Yusuf"]
LAST = ["Moreno", "Haddad", "Wei", "Okafor", "Yilmaz", "Nasser", "Petrov", "Sato", "Kowalski", "Novak", "Mensah",
        "Fischer", "Rossi", "Dubois", "Silva", "Larsen", "Horvat", "Tanaka", "Costa", "Berg"]
COLOURS = ["crimson", "teal", "amber", "violet", "olive", "maroon", "indigo", "coral", "azure", "ochre"]
JOBS = ["baker", "nurse", "pilot", "carpenter", "librarian", "chemist", "tailor", "plumber"]
SHAPES = ("number", "passkey", "fact", "multi")


@dataclass(frozen=True)
class Question:
    shape: str
    needles: tuple[str, ...]     # sentences placed in the haystack
    question: str
    answers: tuple[str, ...]     # every one must appear in a correct reply


def paragraphs(rng: random.Random, min_chars: int = 200) -> list[str]:
    """Docstring paragraphs of standard-library modules (real English prose)."""
    root = os.path.dirname(os.__file__)
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    out += [" ".join(p.split()) for p in doc.split("\n\n") if len(p) >= min_chars]
    rng.shuffle(out)
    return out


def make_questions(rng: random.Random, n: int) -> list[Question]:
    """n questions cycling through SHAPES, with keys unique within the draw."""
    cities = rng.sample(CITIES, len(CITIES))
    people = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], len(FIRST) * len(LAST))
    city, person = iter(cities), iter(people)
    out = []
    for i in range(n):
        shape = SHAPES[i % len(SHAPES)]
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


def haystack(rng: random.Random, tokenizer, n_tokens: int, questions: list[Question]) -> str:
    """About n_tokens of shuffled prose with every needle at a random depth (a paragraph boundary)."""
    paras = paragraphs(rng)
    chosen, total, i = [], 0, 0
    while total < n_tokens:
        p = paras[i % len(paras)]
        i += 1
        chosen.append(p)
        total += len(p) // 4      # ~4 characters a token; trimmed below
    for q in questions:
        for nd in q.needles:
            chosen.insert(rng.randrange(len(chosen) + 1), nd)
    text = "\n\n".join(chosen)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > n_tokens:       # trim from the end, keeping every needle
        cut = tokenizer.decode(ids[:n_tokens])
        if all(nd in cut for q in questions for nd in q.needles):
            text = cut
    return text
