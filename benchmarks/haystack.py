"""Fresh random haystacks and needles for QA benchmarks (new draws every run).

Haystack text is real prose: paragraphs of docstrings from the Python standard library on
this machine, shuffled. Needles come in several shapes with random keys and values.
"""

from __future__ import annotations

import ast
import os
import random
from dataclasses import dataclass

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tbilisi", "Quito", "Dakar", "Perth", "Riga", "Accra",
          "Bergen", "Cusco", "Tromso", "Zagreb", "Tunis", "Lyon", "Kyoto", "Porto", "Malmo"]
NAMES = ["Alice Moreno", "Bilal Haddad", "Chen Wei", "Dara Okafor", "Elif Yilmaz", "Farah Nasser", "Goran Petrov",
         "Hana Sato", "Ivan Kowalski", "Jana Novak", "Kofi Mensah", "Lena Fischer"]
COLOURS = ["crimson", "teal", "amber", "violet", "olive", "maroon", "indigo", "coral"]


@dataclass(frozen=True)
class Needle:
    shape: str
    text: str
    question: str
    answer: str


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


def make_needles(rng: random.Random, n: int) -> list[Needle]:
    cities, names = rng.sample(CITIES, len(CITIES)), rng.sample(NAMES, len(NAMES))
    out = []
    for i in range(n):
        shape = ("number", "passkey", "fact")[i % 3]
        if shape == "number":
            v = str(rng.randrange(1_000_000, 9_999_999))
            c = cities[i % len(cities)]
            out.append(Needle(shape, f"The special magic number for {c} is {v}.",
                              f"What is the special magic number for {c}?", v))
        elif shape == "passkey":
            v = f"{rng.choice(COLOURS)}-{rng.randrange(100, 999)}"
            who = names[i % len(names)]
            out.append(Needle(shape, f"The pass key of {who} is {v}. Remember it.",
                              f"What is the pass key of {who}?", v))
        else:
            who, c = names[(i + 5) % len(names)], cities[(i + 7) % len(cities)]
            out.append(Needle(shape, f"{who} moved to {c} last year and works there as a baker.",
                              f"Which city did {who} move to?", c))
    return out


def haystack(rng: random.Random, tokenizer, n_tokens: int, needles: list[Needle]) -> str:
    """About n_tokens of shuffled prose with each needle at a random depth (a paragraph boundary)."""
    paras = paragraphs(rng)
    chosen, total, i = [], 0, 0
    while total < n_tokens:
        p = paras[i % len(paras)]
        i += 1
        chosen.append(p)
        total += len(p) // 4      # ~4 characters a token; trimmed below
    for nd in needles:
        chosen.insert(rng.randrange(len(chosen) + 1), nd.text)
    text = "\n\n".join(chosen)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > n_tokens:       # trim from the end, keeping every needle
        cut = tokenizer.decode(ids[:n_tokens])
        if all(nd.text in cut for nd in needles):
            text = cut
    return text
