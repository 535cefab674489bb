"""The README and the docs hold to what runs: the README stays short, its links resolve, the extras it
names exist, its Python and OpenAI-client quickstarts execute (the real default model, a live server),
and the environment reference lists every variable the code reads."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_the_readme_is_a_short_front_door_whose_links_resolve():
    assert len(README.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links and [x for x in links if not x.startswith("http") and not (ROOT / x).exists()] == []


def test_the_install_commands_name_extras_and_files_that_exist():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    named = {e for group in re.findall(r"\./kvmemory\[([a-z,]+)\]", README) for e in group.split(",")}
    named |= set(re.findall(r"`\[([a-z]+)\]`", README))
    assert named and named <= extras, named - extras
    for f in re.findall(r"kvmemory/(models\.txt|constraints\.txt)", README):
        assert (ROOT / f).is_file()
    make = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^    make (\w+)", README, re.M):
        assert re.search(rf"^{target}:", make, re.M), target


def test_the_support_matrix_is_the_conformance_suites_families():
    """Every family the suite builds has its row in the README, and the README names no tested family
    the suite does not build."""
    from kvmemory.model.families import FAMILIES
    section = README.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in re.findall(r"^\| ([^|]+) \| ([^|]+) \|", section, re.M) if r[0] not in ("family", "---")]
    assert len(rows) == len(FAMILIES)
    for label in FAMILIES.values():
        head = label.split(" (")[0]
        assert any(head.split(" /")[0] in r[0] for r in rows), label


def test_the_environment_reference_lists_every_variable():
    from kvmemory.settings import ENV
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    assert [v for v in ENV if f"`{v}`" not in page] == []


@pytest.mark.real_model
def test_the_python_quickstart_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (code,) = blocks("python")[:1]
    exec(compile(code, "README.md", "exec"), {})            # noqa: S102 -- the README's own snippet
    out = capsys.readouterr().out
    assert "handbook" in out and (tmp_path / "notes.kvm").is_dir()


@pytest.mark.real_model
def test_the_openai_quickstart_runs_against_a_live_server(tmp_path):
    import kvmemory
    from tests.server.test_server import serving
    code = next(b for b in blocks("python") if "from openai import OpenAI" in b)
    with serving(kvmemory.Memory(tmp_path / "notes.kvm")) as url:
        scope: dict = {}
        exec(compile(code.replace("http://127.0.0.1:8000", url), "README.md", "exec"), scope)   # noqa: S102
        recalled = scope["later"].model_extra["kvmemory"]["recalled"]
        assert any("52917" in r["text"] for r in recalled)        # the told turn came back, as KV
        assert scope["said"].choices[0].message.content
