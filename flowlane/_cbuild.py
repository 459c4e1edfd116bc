"""Build-on-first-use for flowlane's small C kernels (``plan/_spst.c``, ``sim/_waterfill.c``).

A kernel is compiled with the system C compiler (``$CC``, default ``cc``) into ``$FLOWLANE_CACHE`` (default
``~/.cache/flowlane``) as ``<stem>_<hash>.so``, the hash covering the source and the flags, and loaded with ctypes (no
Python headers needed). Flags must stay portable (no ``-march=native``): the cache key does not include the CPU the
library was built on. Compiling goes to a temporary file renamed into place, so concurrent first uses are safe.

Loading a library runs its code, so only one this user could have built is loaded: the cache folder is created 0700,
and the folder and the library must be owned by this user and not writable by group or others (and the library a
regular file, not a link). Otherwise loading is refused with the reason, and the caller falls back to Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
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
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache, os.stat(cache))
    if not os.path.lexists(so):
        cc = os.environ.get("CC", "cc")
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            tmp_path = tmp.name
        try:
            subprocess.run(
                [cc, *flags, "-o", tmp_path, str(src)], check=True, capture_output=True, timeout=120
            )
            os.chmod(tmp_path, 0o700)
            os.replace(tmp_path, so)
        finally:
            if os.path.exists(tmp_path):
                os.unlink(tmp_path)
    st = os.lstat(so)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"refusing to load {so}: not a regular file; remove it (it is rebuilt on next use)")
    _check_private(so, st)
    return ctypes.CDLL(str(so))


def _check_private(path: Path, st: os.stat_result) -> None:
    """Only this user can have written ``path``: owned by this user, not writable by group or others."""
    fix = (
        "remove it (it is rebuilt on next use)"
        if path.suffix == ".so"
        else "make it private (chmod 700) or set FLOWLANE_CACHE to a folder only you can write"
    )
    if st.st_uid != os.getuid():
        raise OSError(
            f"refusing to load {path}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); {fix}"
        )
    if st.st_mode & 0o022:
        raise OSError(
            f"refusing to load {path}: writable by group or others (mode {oct(st.st_mode & 0o777)}); {fix}"
        )


class CKernel:
    """One kernel, built and loaded on first :meth:`load`; ``declare`` sets the functions' ctypes signatures. When it
    cannot be built, :meth:`load` warns once (``"<what> unavailable (<reason>); <fallback>"``) and returns None from
    then on, and the caller runs its Python implementation. ``lib`` is False until the first try."""

    def __init__(
        self,
        src: Path,
        stem: str,
        flags: tuple[str, ...],
        declare: Callable[[ctypes.CDLL], None],
        what: str,
        fallback: str,
    ) -> None:
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
