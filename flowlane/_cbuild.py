"""Build-on-first-use for flowlane's small C kernels (``plan/_spst.c``, ``sim/_waterfill.c``).

A kernel is compiled with the system C compiler (``$CC``, default ``cc``) into ``$FLOWLANE_CACHE`` (default
``~/.cache/flowlane``) as ``<stem>_<hash>.so``, the hash covering the source and the flags, and loaded with ctypes (no
Python headers needed). Flags must stay portable (no ``-march=native``): the cache key does not include the CPU the
library was built on. Compiling goes to a temporary file renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


def build_and_load(src: Path, stem: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel at ``src`` as a loaded library; raises OSError or subprocess.SubprocessError when it cannot be
    built (no compiler, compile error) or loaded. Callers catch those and fall back to their Python implementation."""
    code = src.read_bytes()
    tag = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("FLOWLANE_CACHE", Path.home() / ".cache" / "flowlane"))
    so = cache / f"{stem}_{tag}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            tmp_path = tmp.name
        try:
            subprocess.run([cc, *flags, "-o", tmp_path, str(src)], check=True, capture_output=True, timeout=120)
            os.replace(tmp_path, so)
        finally:
            if os.path.exists(tmp_path):
                os.unlink(tmp_path)
    return ctypes.CDLL(str(so))
