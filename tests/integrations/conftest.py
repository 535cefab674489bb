"""A Memory on the real default model holding a few documents with facts drawn fresh each run."""

import random
import subprocess
import sys

import pytest

import kvmemory
from tests.conftest import SEED

FILLER = ["The tide tables are posted at the harbour every Monday.", "Gulls nest on the old pier in spring.",
          "The market opens early on Saturdays.", "Fishing boats leave before dawn in the summer months.",
          "The town library lends maps of the coast.", "Rain is common in the autumn along this shore."]
ITEMS = ["lantern", "compass", "anchor", "barometer", "sextant", "telescope", "chronometer", "spyglass"]


def make_corpus(rng: random.Random) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Three documents of filler with one planted fact each: (docs, [(doc_id, question, answer)])."""
    docs, facts = {}, []
    for d, item in enumerate(rng.sample(ITEMS, 3)):
        code = str(rng.randrange(1000, 9999))
        fact = f"The {item} is kept in locker number {code}."
        body = [rng.choice(FILLER) for _ in range(70)]
        body.insert(rng.randrange(10, 60), fact)
        doc_id = f"log-{d}"
        docs[doc_id] = " ".join(body)
        facts.append((doc_id, f"In which locker is the {item} kept?", code))
    return docs, facts


@pytest.fixture(scope="package")
def corpus():
    return make_corpus(random.Random(SEED))


@pytest.fixture(scope="package")
def real_mem(tmp_path_factory, real_model, corpus):
    docs, _ = corpus
    with kvmemory.Memory(tmp_path_factory.mktemp("integrations") / "m.kvm", model=real_model) as mem:
        for doc_id, text in docs.items():
            mem.add(text, doc_id=doc_id, source=f"/data/{doc_id}.txt")
        yield mem


def import_error_without(hidden: list[str], module: str) -> str:
    """The message of the error importing `module` in a fresh interpreter where the `hidden`
    packages cannot be imported; fails unless it is a kvmemory.MissingDependencyError."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({hidden!r}))\n"
            f"try:\n import {module}\nexcept ImportError as e:\n"
            " import kvmemory; assert isinstance(e, kvmemory.MissingDependencyError), type(e); print(e)\n"
            "else:\n raise SystemExit('imported')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
