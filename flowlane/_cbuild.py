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
import warnings
from collections.abc import Callable
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


class CKernel:
    """One kernel, built and loaded on first :meth:`load`; ``declare`` sets the functions' ctypes signatures. When it
    cannot be built, :meth:`load` warns once (``"<what> unavailable (<reason>); <fallback>"``) and returns None from
    then on, and the caller runs its Python implementation. ``lib`` is False until the first try."""

    def __init__(self, src: Path, stem: str, flags: tuple[str, ...], declare: Callable[[ctypes.CDLL], None],
                 what: str, fallback: str) -> None:
        self.src, self.stem, self.flags, self.declare = src, stem, flags, declare
        self.what, self.fallback = what, fallback
        self.lib: ctypes.CDLL | None | bool = False

    def load(self) -> ctypes.CDLL | None:
        if self.lib is not False:
            return self.lib  # type: ignore[return-value]
        self.lib = None
        try:
            lib = build_and_load(self.src, self.stem, self.flags)
        except (OSError, subprocess.SubprocessError) as e:
            warnings.warn(f"{self.what} unavailable ({e}); {self.fallback}", stacklevel=3)
            return None
        self.declare(lib)
        self.lib = lib
        return lib
