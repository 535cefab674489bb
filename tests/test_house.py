"""The house rules a reader relies on, held by tests: no import circle between the project's modules
(imports inside functions included: they crept back once), no module past 500 lines, no module below
the facade that is handed the whole Memory, the packaging list complete."""

from __future__ import annotations

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"kvmemory": ROOT / "kvmemory", "kvmemory.index": ROOT / "index", "kvmemory.ops.cuda": ROOT / "cuda"}
MAX_LINES = 500
# the rooms Memory wires: each is handed the typed runtime (kvmemory/runtime.py), never the facade
BELOW_FACADE = ("ask", "rerank", "retrieve", "graft", "documents", "library", "compact", "audit", "states",
                "chat_memory.memory", "chat_memory.window", "runtime")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for p in root.rglob("*.py"):
            parts = [x for x in p.relative_to(root).with_suffix("").parts if x != "__init__"]
            out[".".join([pkg, *parts])] = p
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (module level or inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in n.names}      # `from pkg import module`
    resolved = set()
    for m in out:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            resolved.add(m)
    return resolved


def graph() -> dict[str, set[str]]:
    mods = modules()
    g = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    # importing a.b.c runs a/__init__ and a/b/__init__: a package is not its own children's circle
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert circles(graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_past_the_limit():
    big = {m: n for m, p in modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert big == {}


@pytest.mark.parametrize("room", BELOW_FACADE)
def test_no_room_below_the_facade_takes_a_memory(room):
    """A room is handed the runtime: it neither imports the facade nor names a parameter `mem`."""
    path = modules()[f"kvmemory.{room}"]
    assert "kvmemory.memory" not in imports(f"kvmemory.{room}", path, set(modules()))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    named = [f"{f.name}({a.arg})" for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for a in f.args.args + f.args.kwonlyargs if a.arg in ("mem", "memory")]
    assert named == []


def test_every_package_is_packaged():
    """pyproject's package list names every package of the tree (a wheel once shipped without one):
    setuptools' find cannot map the top-level index/ and cuda/ folders into kvmemory, so the list
    stays, held to the tree here."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m if p.name == "__init__.py" else m.rpartition(".")[0] for m, p in modules().items()}
    found |= set(PACKAGES)
    assert listed == found
