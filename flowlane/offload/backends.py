"""I/O backends of the tensor cache: posix (default), kvikio (GPUDirect Storage), pinned CPU memory, null.

The thesis writes with kvikio/GDS (§5.3.1, §5.4.1) and has a pinned-host CPU offloader (Table in §5.3.1); it does not
specify file layout, naming, O_DIRECT or cleanup (digest §2.2.9, A11). Here: one file per offloaded storage, round
robin over target directories, files 0600 in a per-run 0700 directory that is removed at exit (atexit, SIGTERM) and,
after a crash (SIGKILL, segfault), by the next run on the same host (stale pid check).

All backends move 1-D uint8 tensors (whole storages, see cache.py). A failed write raises ``OSError`` (ENOSPC for a
full disk or an exhausted pinned pool); the cache turns that into an in-memory fallback or a clear error.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import mmap
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlane.offload.config import OffloadConfig

RUN_PREFIX = "flowlane-ssd"
_ALIGN = 4096  # O_DIRECT alignment (logical block size of common NVMe/ext4/xfs)
_CHUNK = 8 * 1024 * 1024  # bounce-buffer size for O_DIRECT


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine (the message says why and what to use instead)."""


# --------------------------------------------------------------------------------------------------- run dirs
def _proc_start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime) counted after the comm field
    except (OSError, IndexError):
        return "0"


def _host() -> str:
    """This host and PID namespace: containers sharing a hostname (host networking) and an offload folder see
    each other's run directories but not each other's pids, so each sweeps only its own namespace's."""
    name = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40] or "host"
    try:
        return f"{name}_pidns{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return name


_RUN_RE = re.compile(rf"^{RUN_PREFIX}-(?P<host>.+)-(?P<pid>\d+)-(?P<start>\d+)-(?P<tok>[0-9a-f]+)$")


def cleanup_stale(target: str | os.PathLike) -> list[Path]:
    """Remove run directories under ``target`` left by dead processes of this host (a crash skips atexit).

    A directory is stale when its pid is gone or the pid now belongs to a process with another start time.
    Returns the removed paths.
    """
    removed: list[Path] = []
    host = _host()
    try:
        entries = list(os.scandir(target))
    except OSError:
        return removed
    for e in entries:
        m = _RUN_RE.match(e.name)
        if not m or m["host"] != host or not e.is_dir(follow_symlinks=False):
            continue
        pid = int(m["pid"])
        alive = True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if alive and _proc_start_time(pid) != m["start"]:
            alive = False
        if not alive:
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
    return removed


_LIVE_RUN_DIRS: set[str] = set()
_SIGTERM_INSTALLED = False


def _remove_live_run_dirs() -> None:
    for d in list(_LIVE_RUN_DIRS):
        shutil.rmtree(d, ignore_errors=True)
        _LIVE_RUN_DIRS.discard(d)


def _on_sigterm(signum: int, frame: Any) -> None:  # pragma: no cover - exercised in a subprocess test
    _remove_live_run_dirs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_exit_cleanup() -> None:
    global _SIGTERM_INSTALLED
    if _SIGTERM_INSTALLED:
        return
    atexit.register(_remove_live_run_dirs)
    # SIGTERM skips atexit; take it over only when nobody else did and we can (main thread)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)
    _SIGTERM_INSTALLED = True


def make_run_dir(target: str | os.PathLike) -> Path:
    """Create a private (0700) per-run directory under ``target`` after sweeping stale ones. ``target`` must exist:
    a mistyped ``offload.dirs`` entry is an error, never a new directory somewhere else."""
    t = Path(target)
    if not t.is_dir():
        raise ValueError(
            f"offload.dirs entry {str(target)!r} is not an existing folder; create it first or fix the path"
        )
    cleanup_stale(t)
    pid = os.getpid()
    d = t / f"{RUN_PREFIX}-{_host()}-{pid}-{_proc_start_time(pid)}-{os.urandom(4).hex()}"
    os.mkdir(d, 0o700)
    os.chmod(d, 0o700)
    _LIVE_RUN_DIRS.add(str(d))
    _install_exit_cleanup()
    return d


def remove_run_dir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)
    _LIVE_RUN_DIRS.discard(str(d))


# --------------------------------------------------------------------------------------------------- interface
class IOBackend(ABC):
    """Moves whole storages (1-D uint8 tensors) to a tier and back."""

    name: str = "?"
    #: True when written data stays referenced in process memory (null, pinned_cpu): offloading frees no host RAM
    keeps_host_memory: bool = False

    @abstractmethod
    def write(self, key: str, data: torch.Tensor) -> Any:
        """Store ``data`` (uint8, 1-D, contiguous, CPU or CUDA); return a handle. Raise OSError on failure."""

    @abstractmethod
    def read(self, handle: Any, nbytes: int, device: torch.device) -> torch.Tensor:
        """Return a new uint8 tensor of ``nbytes`` on ``device`` with the stored bytes."""

    @abstractmethod
    def delete(self, handle: Any) -> None:
        """Forget a stored object (remove its file)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for memory backends
        """Release every resource (run directories)."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}


def _host_staging(data: torch.Tensor) -> torch.Tensor:
    """A CPU view of ``data``: the tensor itself on CPU, a (pinned) host copy of a CUDA tensor.

    The cache already waited on the producer's CUDA event (digest A4) and runs the copy on the worker's own stream.
    """
    if data.device.type == "cpu":
        return data
    host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(data, non_blocking=False)
    return host


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=False)


# --------------------------------------------------------------------------------------------------- posix
def probe_o_direct(d: Path) -> bool:
    """Whether O_DIRECT open + aligned write works in ``d`` (tmpfs on older kernels says EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    p = d / ".o_direct_probe"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    buf = mmap.mmap(-1, _ALIGN)  # page-aligned, as O_DIRECT needs
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(p)


@dataclass(frozen=True)
class PosixHandle:
    path: str
    nbytes: int
    o_direct: bool


class _Bounce(threading.local):
    buf: mmap.mmap | None = None
    view: torch.Tensor | None = None


class PosixBackend(IOBackend):
    """Plain file I/O: ``os.pwrite``/``os.preadv`` straight from/to tensor memory, or O_DIRECT through an aligned
    bounce buffer where the filesystem supports it. Several target directories are used round-robin."""

    name = "posix"

    def __init__(self, dirs: tuple[str, ...] = (), o_direct: str = "auto", rank: int = 0) -> None:
        targets = [Path(d) for d in (dirs or (tempfile.gettempdir(),))]
        self.rank = rank
        self.run_dirs: list[Path] = [make_run_dir(t) for t in targets]
        probes = [probe_o_direct(d) if o_direct != "off" else False for d in self.run_dirs]
        if o_direct == "on" and not all(probes):
            bad = [str(t) for t, ok in zip(targets, probes, strict=True) if not ok]
            self.close()
            raise ValueError(
                f"offload.o_direct='on' but O_DIRECT is not supported in {bad}; use 'auto' or 'off'"
            )
        self.o_direct = probes
        self._rr = itertools.cycle(range(len(self.run_dirs)))
        self._rr_lock = threading.Lock()
        self._bounce = _Bounce()
        # unlinking a file whose pages sit in the page cache costs milliseconds: keep it off the backward path
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="flowlane-unlink")
        self.direct_writes = 0
        self.direct_fallbacks = 0

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "dirs": [str(d) for d in self.run_dirs],
            "o_direct": list(self.o_direct),
            "block_writes_o_direct": self.direct_writes,
            "block_writes_o_direct_refused": self.direct_fallbacks,
        }

    def _bounce_buf(self) -> tuple[mmap.mmap, torch.Tensor]:
        b = self._bounce
        if b.buf is None:
            b.buf = mmap.mmap(-1, _CHUNK)  # page-aligned anonymous memory
            b.view = torch.frombuffer(b.buf, dtype=torch.uint8)
        return b.buf, b.view  # type: ignore[return-value]

    def write(self, key: str, data: torch.Tensor) -> PosixHandle:
        with self._rr_lock:
            i = next(self._rr)
        path = self.run_dirs[i] / f"r{self.rank}-{key}.bin"
        host = _host_staging(data)
        n = host.numel()
        direct = self.o_direct[i]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if direct:
                buf, view = self._bounce_buf()
                off = 0
                while off < n:
                    m = min(_CHUNK, n - off)
                    view[:m].copy_(host[off : off + m])
                    padded = (m + _ALIGN - 1) // _ALIGN * _ALIGN
                    _full_pwrite(fd, memoryview(buf)[:padded], off)
                    off += m
                os.ftruncate(fd, n)
            else:
                _full_pwrite(fd, memoryview(host.numpy()), 0)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        return PosixHandle(str(path), n, direct)

    def read(self, handle: PosixHandle, nbytes: int, device: torch.device) -> torch.Tensor:
        pin = device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        fd = os.open(handle.path, os.O_RDONLY | (os.O_DIRECT if handle.o_direct else 0))
        try:
            if handle.o_direct:
                buf, view = self._bounce_buf()
                off = 0
                while off < nbytes:
                    m = min(_CHUNK, nbytes - off)
                    padded = (m + _ALIGN - 1) // _ALIGN * _ALIGN
                    got = os.preadv(fd, [memoryview(buf)[:padded]], off)
                    if got < m:
                        raise OSError(
                            errno.EIO, f"short read from {handle.path}: {off + got} of {nbytes} bytes"
                        )
                    host[off : off + m].copy_(view[:m])
                    off += m
            else:
                mv = memoryview(host.numpy())
                off = 0
                while off < nbytes:
                    got = os.preadv(fd, [mv[off:]], off)
                    if got <= 0:
                        raise OSError(errno.EIO, f"short read from {handle.path}: {off} of {nbytes} bytes")
                    off += got
        finally:
            os.close(fd)
        return _to_device(host, device)

    def delete(self, handle: PosixHandle) -> None:
        self._janitor.submit(_unlink, handle.path)

    def write_block(self, key: str, buf: torch.Tensor, nbytes: int) -> PosixHandle:
        """Write ``buf[:nbytes]`` (a host-pool block: 4 KiB-aligned start, ``nbytes`` a multiple of 4 KiB) with one
        O_DIRECT ``pwrite`` straight from it, no bounce copy. Where O_DIRECT is off or refuses the buffer (EINVAL),
        a buffered write is used and ``direct_fallbacks`` counts it (``describe()`` reports it)."""
        with self._rr_lock:
            i = next(self._rr)
        path = self.run_dirs[i] / f"r{self.rank}-{key}.bin"
        mv = memoryview(buf.numpy())[:nbytes]
        direct = self.o_direct[i] and nbytes % _ALIGN == 0 and buf.data_ptr() % _ALIGN == 0
        for attempt_direct in (True, False) if direct else (False,):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if attempt_direct else 0)
            fd = os.open(path, flags, 0o600)
            try:
                _full_pwrite(fd, mv, 0)
            except OSError as e:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                if attempt_direct and e.errno == errno.EINVAL:
                    self.direct_fallbacks += 1
                    continue
                raise
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            os.close(fd)
            if attempt_direct:
                self.direct_writes += 1
            return PosixHandle(str(path), nbytes, attempt_direct)
        raise AssertionError("unreachable")

    def read_block(self, handle: PosixHandle, buf: torch.Tensor, nbytes: int) -> None:
        """Read a block written by :meth:`write_block` into ``buf[:nbytes]`` (O_DIRECT when it was written so)."""
        mv = memoryview(buf.numpy())[:nbytes]
        direct = handle.o_direct and buf.data_ptr() % _ALIGN == 0
        fd = os.open(handle.path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            off = 0
            while off < nbytes:
                got = os.preadv(fd, [mv[off:]], off)
                if got <= 0:
                    raise OSError(errno.EIO, f"short read from {handle.path}: {off} of {nbytes} bytes")
                off += got
        finally:
            os.close(fd)

    def close(self) -> None:
        self._janitor.shutdown(wait=True)
        for d in self.run_dirs:
            remove_run_dir(d)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _full_pwrite(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    n = len(mv)
    while done < n:
        w = os.pwrite(fd, mv[done:], offset + done)
        if w <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += w


# --------------------------------------------------------------------------------------------------- kvikio
@dataclass(frozen=True)
class KvikioHandle:
    path: str
    nbytes: int


class KvikioBackend(IOBackend):
    """GPUDirect Storage through kvikio (thesis §5.3.1). kvikio cannot do any file I/O without libcuda, even in
    compat mode (research/environment.md §7), so this backend refuses to start without CUDA."""

    name = "kvikio"

    def __init__(self, dirs: tuple[str, ...] = (), compat_mode: str = "auto", rank: int = 0) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "offload.backend='kvikio' needs a CUDA driver: kvikio cannot do file I/O without libcuda, even in "
                "compat mode; use backend='posix' (or 'auto') on this machine"
            )
        _set_kvikio_compat_env(compat_mode)
        try:
            import kvikio  # noqa: PLC0415 - optional dependency, import-guarded
            import kvikio.defaults  # noqa: PLC0415,F401 - not imported by ``import kvikio`` (26.10)
        except Exception as e:  # noqa: BLE001 - ImportError, or a RuntimeError when libcufile cannot be loaded
            raise BackendUnavailableError(
                f"offload.backend='kvikio' but kvikio is not usable ({type(e).__name__}: {e}); install "
                "kvikio-cu12/cu13 (and libcufile) or use backend='posix'"
            ) from e
        self._kvikio = kvikio
        running = self._compat_mode()
        if compat_mode != "auto" and running not in (None, compat_mode.upper()):
            raise BackendUnavailableError(
                f"offload.kvikio_compat_mode={compat_mode!r}, but kvikio was imported earlier in this process with "
                f"compat mode {running} (KVIKIO_COMPAT_MODE is read once, at import); set "
                f"KVIKIO_COMPAT_MODE={compat_mode.upper()} in the job's environment"
            )
        self.rank = rank
        targets = [Path(d) for d in (dirs or (tempfile.gettempdir(),))]
        self.run_dirs = [make_run_dir(t) for t in targets]
        self._rr = itertools.cycle(range(len(self.run_dirs)))
        self._rr_lock = threading.Lock()
        self._janitor = ThreadPoolExecutor(1, thread_name_prefix="flowlane-unlink")

    def _compat_mode(self) -> str | None:
        """kvikio's compat mode as ON / OFF / AUTO; None where this kvikio version does not say."""
        with contextlib.suppress(Exception):  # the API differs across kvikio versions
            return str(self._kvikio.defaults.get("compat_mode")).rsplit(".", 1)[-1].upper()  # CompatMode.ON
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "dirs": [str(d) for d in self.run_dirs],
            "compat_mode": self._compat_mode(),
        }

    def write(self, key: str, data: torch.Tensor) -> KvikioHandle:
        with self._rr_lock:
            i = next(self._rr)
        path = self.run_dirs[i] / f"r{self.rank}-{key}.bin"
        # create private, then let kvikio write
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        try:
            f = self._kvikio.CuFile(str(path), "r+")
            try:
                n = f.pwrite(data).get()
            finally:
                f.close()
            if n != data.numel():
                raise OSError(errno.EIO, f"kvikio wrote {n} of {data.numel()} bytes to {path}")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return KvikioHandle(str(path), data.numel())

    def read(self, handle: KvikioHandle, nbytes: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if out.is_cuda:  # kvikio writes outside stream order: the reused block's earlier work must be done
            torch.cuda.current_stream(out.device).synchronize()
        f = self._kvikio.CuFile(handle.path, "r")
        try:
            n = f.pread(out).get()
        finally:
            f.close()
        if n != nbytes:
            raise OSError(errno.EIO, f"kvikio read {n} of {nbytes} bytes from {handle.path}")
        return out

    def delete(self, handle: KvikioHandle) -> None:
        self._janitor.submit(_unlink, handle.path)

    def close(self) -> None:
        self._janitor.shutdown(wait=True)
        for d in self.run_dirs:
            remove_run_dir(d)


# --------------------------------------------------------------------------------------------------- pinned / null
class PinnedCpuBackend(IOBackend):
    """The thesis' CPU offloader (§5.3.1): copies into (pinned) host memory, bounded by ``pool_bytes``."""

    name = "pinned_cpu"
    keeps_host_memory = True

    def __init__(self, pool_bytes: int = 0) -> None:
        self.pool_bytes = pool_bytes
        self.used = 0
        self._lock = threading.Lock()

    def write(self, key: str, data: torch.Tensor) -> torch.Tensor:
        n = data.numel()
        with self._lock:
            if self.pool_bytes and self.used + n > self.pool_bytes:
                raise OSError(
                    errno.ENOSPC,
                    f"pinned_cpu pool full: {self.used} + {n} > {self.pool_bytes} bytes "
                    "(raise offload.pinned_pool_bytes)",
                )
            self.used += n
        host = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.copy_(data)
        weakref.finalize(host, self._free, n)
        return host

    def _free(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def read(self, handle: torch.Tensor, nbytes: int, device: torch.device) -> torch.Tensor:
        return handle if device.type == "cpu" else handle.to(device)

    def delete(self, handle: torch.Tensor) -> None:
        pass  # the cache drops its handle; the finalizer returns the bytes to the pool


class NullBackend(IOBackend):
    """Accounting only: nothing is written; the data stays referenced in memory, so gradients stay exact.
    Use it to count bytes that would be offloaded and to measure the cache's own overhead."""

    name = "null"
    keeps_host_memory = True

    def write(self, key: str, data: torch.Tensor) -> torch.Tensor:
        return data

    def read(self, handle: torch.Tensor, nbytes: int, device: torch.device) -> torch.Tensor:
        return handle

    def delete(self, handle: torch.Tensor) -> None:
        pass


def _set_kvikio_compat_env(compat_mode: str) -> None:
    """kvikio reads KVIKIO_COMPAT_MODE once, when it is first imported: set it before any import of ours."""
    if "kvikio" not in sys.modules and compat_mode != "auto":
        os.environ["KVIKIO_COMPAT_MODE"] = compat_mode.upper()


def kvikio_usable(compat_mode: str = "auto") -> tuple[bool, str]:
    """(usable, reason) for the kvikio backend on this machine, without doing any I/O. ``compat_mode``: the mode
    kvikio is to start in, should this probe be its first import."""
    if not torch.cuda.is_available():
        return False, "no CUDA driver (kvikio cannot do file I/O without libcuda, even in compat mode)"
    _set_kvikio_compat_env(compat_mode)
    try:
        import kvikio  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001 - ImportError, or a RuntimeError when libcufile cannot be loaded
        return False, f"kvikio not usable: {type(e).__name__}: {e}"
    return True, "ok"


def make_backend(cfg: OffloadConfig, rank: int = 0) -> IOBackend:
    """Build the backend named by ``cfg.backend`` ('auto' = kvikio when usable, else posix)."""
    name = cfg.backend
    if name == "auto":
        name = "kvikio" if kvikio_usable(cfg.kvikio_compat_mode)[0] else "posix"
    if name in ("posix", "kvikio"):
        cfg.check_dirs()
    if name == "posix":
        return PosixBackend(cfg.dirs, cfg.o_direct, rank)
    if name == "kvikio":
        return KvikioBackend(cfg.dirs, cfg.kvikio_compat_mode, rank)
    if name == "pinned_cpu":
        return PinnedCpuBackend(cfg.pinned_pool_bytes)
    if name == "null":
        return NullBackend()
    raise ValueError(
        f"offload.backend={cfg.backend!r} is not one of {('posix', 'kvikio', 'pinned_cpu', 'null', 'auto')}"
    )
