"""Progress bars: tqdm where a person watches (stderr is a terminal), nothing elsewhere."""

from __future__ import annotations


def bar(progress: bool, desc: str, total: int | None = None, unit: str = "tok"):
    """A tqdm bar when asked for and stderr is a terminal; None otherwise."""
    import sys
    if not progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True)
