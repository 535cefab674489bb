"""Adapters for Python LLM frameworks, over Memory.retrieve and Memory.ask.

    kvmemory.integrations.langchain     pip install 'kvmemory[langchain]'
    kvmemory.integrations.llama_index   pip install 'kvmemory[llamaindex]'

Each module imports its framework at import time and raises kvmemory.MissingDependencyError
(an ImportError) naming the extra when it is not installed.
"""

from __future__ import annotations

import importlib

from kvmemory.errors import MissingDependencyError


def require(modules: list[str], extra: str, who: str) -> None:
    """Import `modules` or raise MissingDependencyError naming the extra that installs them."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise MissingDependencyError(
                f"{who} needs the {name.split('.')[0]!r} package, which is not installed: "
                f"pip install 'kvmemory[{extra}]'") from e
