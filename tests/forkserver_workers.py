"""A rank function for the fork-server tests in tests/test_launch_faults.py, in a module that imports neither torch
nor pytest: their launcher runs in a fresh process, and its fork server preloads this module too."""

import os
from pathlib import Path


def mark_started(rank: int, world: int, marker: str) -> int:
    Path(marker).write_text(str(os.getpid()))
    return rank
