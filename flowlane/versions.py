"""Version pins for the framework-private functions the plugins wrap: one check, one message (stdlib only)."""

from __future__ import annotations

import re
from importlib.metadata import version


def check_version_range(dist: str, versions: tuple[tuple[int, int], tuple[int, int]], what: str) -> str:
    """The installed version of ``dist``; raises RuntimeError naming it and the allowed ``[first, last)`` range of
    (major, minor) when it is outside. ``what`` names the caller in the message."""
    v = version(dist)
    parts = tuple(int(x) for x in re.findall(r"\d+", v)[:2])
    lo, hi = versions
    if not lo <= parts < hi:
        raise RuntimeError(
            f"{what}: {dist} {v} is not supported (it wraps private functions checked on "
            f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1}); pin {dist} to that range"
        )
    return v
