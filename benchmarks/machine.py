"""Describe the machine a benchmark ran on, and drop files from the page cache."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_gib, 1), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


def drop_from_page_cache(root: Path) -> str:
    """Evict root's files from the page cache. Returns the method that worked."""
    try:  # the whole cache, where permitted (root on a real kernel)
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in ([root] if root.is_file() else root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"
