"""Run by `make wheel-check` with the installed wheel (the base install: no extra), from outside the
source tree: every subpackage is importable, the server too (it is part of the base install), the
kernel sources are in the wheel, and an adapter whose framework is not installed fails with
MissingDependencyError naming its extra."""

import kvmemory
import kvmemory.index
import kvmemory.integrations
import kvmemory.ops
import kvmemory.ops.cuda_ext as cuda_ext
import kvmemory.pager
import kvmemory.cli
import kvmemory.states
import kvmemory.store.location
import kvmemory.chat_memory

assert "site-packages" in kvmemory.__file__, f"kvmemory imported from {kvmemory.__file__}, not the wheel"
from pathlib import Path
web = Path(kvmemory.__file__).parent / "server" / "web"
assert all((web / f).is_file() for f in ("index.html", "app.js", "style.css")), f"the page is missing from {web}"
missing = [f for f in cuda_ext.SOURCES if not (cuda_ext.source_dir() / f).is_file()]
assert not missing, f"kernel sources missing from the wheel: {missing}"
import kvmemory.server.app  # noqa: E402,F401  (the base install serves)
assert (Path(kvmemory.__file__).parent / "py.typed").is_file(), "py.typed is missing from the wheel"
for module, extra in [("integrations.langchain", "langchain"), ("integrations.llama_index", "llamaindex")]:
    try:
        __import__(f"kvmemory.{module}")
    except kvmemory.MissingDependencyError as e:
        assert f"kvmemory[{extra}]" in str(e), e
    else:
        raise AssertionError(f"kvmemory.{module} imported without its framework installed")
print("wheel: packages, the server, kernel sources, py.typed and the page present; adapters without their "
      "framework name their extra")
