"""PyTorch-Direct feature store: a host feature table pinned in place and gathered by GPU zero-copy reads.

Seed 003 ch. 4 (digest research/003 §3): the thesis' "unified tensor" needs a rebuilt PyTorch; flowlane follows the
recommendations of digest §3.6 instead (B1: no new device type, a pinned CPU tensor + a GPU gather op; B3: pin the
existing table in place with ``cudaHostRegister`` rather than copying it into ``cudaMallocHost`` memory; B4: DGL's
per-row 128-B alignment, see :mod:`flowlane.direct.kernels`).

Two paths, chosen per store (:func:`choose_path`):

- ``zero-copy``: a Triton kernel on the GPU reads the rows straight from host memory through the table's UVA address.
- ``cpu-gather``: ``torch.index_select`` on the CPU into a pinned buffer, then ``.to(device, non_blocking=True)``
  (the thesis' "Py" baseline, §4.5.1); used when there is no CUDA device, no Triton, or an unsupported dtype.

Both return exactly ``table[idx]`` (``table[idx][:, cols]`` with a column selection): a gather copies bits.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from flowlane.direct.config import LINE_BYTES, DirectConfig

#: dtypes the zero-copy kernel is built and tested for (issue 39); others take the cpu-gather path
ZERO_COPY_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
#: lanes per tile the launcher aims for (rows_per_program x block), and the widest column block
_TILE_ELEMS = 4096
_MAX_BLOCK = 1024

Columns = slice | range | torch.Tensor | None


@dataclass(frozen=True)
class PathChoice:
    """Which gather path a store uses and why."""

    path: str
    """'zero-copy' or 'cpu-gather'."""
    reason: str
    """One line: what made the choice (shown by ``flowlane doctor`` and in errors)."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``; CI's way to test kernels)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=1)
def triton_status() -> tuple[bool, str]:
    """(importable, version or the import error). Imports Triton once, on first call (never on import)."""
    try:
        import triton
    except Exception as e:  # noqa: BLE001 - any import failure means no zero-copy kernel
        return False, f"Triton does not import ({type(e).__name__}: {str(e)[:100]})"
    return True, f"Triton {triton.__version__}"


def choose_path(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    pinned: bool = True,
    requested: str = "auto",
) -> PathChoice:
    """Pick the gather path for a table of ``dtype`` gathered onto ``device`` (pure, apart from probing CUDA/Triton).

    Zero-copy needs a CUDA target device, CUDA available, Triton importable, ``pinned`` (the store may read the table
    pinned: ``DirectConfig.pin``) and a dtype in :data:`ZERO_COPY_DTYPES`. On a CPU device it runs only under the
    Triton interpreter (tests). ``requested`` is ``DirectConfig.path``; asking for 'zero-copy' where it cannot run
    raises ``RuntimeError`` with the reason.
    """
    if requested not in ("auto", "zero-copy", "cpu-gather"):
        raise ValueError(f"direct.path={requested!r} is not one of ('auto', 'zero-copy', 'cpu-gather')")
    if requested == "cpu-gather":
        return PathChoice("cpu-gather", "requested (direct.path='cpu-gather')")
    dev = torch.device(device)
    why = None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "no usable CUDA device"
        elif interpreting():
            why = "TRITON_INTERPRET=1 runs kernels on the CPU, not the GPU"
        elif not pinned:
            why = "direct.pin=false: the store neither pins the table nor reads it zero-copy"
    elif dev.type == "cpu":
        if not interpreting():
            why = "the target device is the CPU (zero-copy needs CUDA; TRITON_INTERPRET=1 runs it on CPU for tests)"
    else:
        why = f"target device {dev} is neither cuda nor cpu"
    if why is None and dtype not in ZERO_COPY_DTYPES:
        why = f"dtype {dtype} is not one of {[str(d) for d in ZERO_COPY_DTYPES]}"
    if why is None:
        ok, detail = triton_status()
        if not ok:
            why = detail
    if why is None:
        where = "interpreted on CPU" if dev.type == "cpu" else "GPU reads pinned host memory (UVA)"
        return PathChoice("zero-copy", f"{where}, {triton_status()[1]}")
    if requested == "zero-copy":
        raise RuntimeError(f"direct.path='zero-copy' cannot run here: {why}; use path='auto' or 'cpu-gather'")
    return PathChoice("cpu-gather", why)


def default_choice() -> PathChoice:
    """The choice for an fp32 table gathered onto a GPU on this machine (for ``flowlane doctor``)."""
    return choose_path("cuda", torch.float32, pinned=True)


# ------------------------------------------------------------------------------------------------ checks
def check_indices(idx: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Return ``idx`` as a 1-D int64 tensor; refuse other dtypes/shapes and any index outside ``[0, n_rows)``,
    naming the first bad index and its position."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor of int64 (or int32), got {type(idx).__name__}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"indices dtype {idx.dtype} is not allowed; use torch.int64 (or torch.int32)")
    if idx.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
    idx = idx.long()
    if idx.numel():
        lo, hi = torch.aminmax(idx)
        if int(lo) < 0 or int(hi) >= n_rows:
            bad = ((idx < 0) | (idx >= n_rows)).nonzero()[0, 0]
            raise IndexError(
                f"index {int(idx[bad])} at position {int(bad)} is out of range for a feature table of "
                f"{n_rows} rows (allowed: 0..{n_rows - 1})"
            )
    return idx


def _columns(cols: Columns, n_cols: int) -> tuple[int, int] | torch.Tensor | None:
    """None (all columns), (start, count) for a contiguous range, or a sorted int64 CPU tensor of column indices."""
    if cols is None:
        return None
    if isinstance(cols, slice | range):
        r = range(n_cols)[cols] if isinstance(cols, slice) else cols
        if r.step != 1:
            raise ValueError(
                f"column selection {cols!r} must have step 1 (or pass a tensor of column indices)"
            )
        if len(r) and not (r.start >= 0 and r.stop <= n_cols):
            raise IndexError(
                f"column range {r.start}..{r.stop - 1} is out of range for {n_cols} columns "
                f"(allowed: 0..{n_cols - 1})"
            )
        return (r.start if len(r) else 0, len(r))
    if not isinstance(cols, torch.Tensor) or cols.dtype not in (torch.int64, torch.int32) or cols.dim() != 1:
        raise TypeError(
            f"columns must be None, a slice/range with step 1, or a 1-D int64 tensor, got {cols!r}"
        )
    c = cols.detach().to("cpu", torch.int64)
    if c.numel():
        lo, hi = torch.aminmax(c)
        if int(lo) < 0 or int(hi) >= n_cols:
            bad = ((c < 0) | (c >= n_cols)).nonzero()[0, 0]
            raise IndexError(
                f"column {int(c[bad])} at position {int(bad)} is out of range for {n_cols} columns "
                f"(allowed: 0..{n_cols - 1})"
            )
        if c.numel() > 1 and bool((c[1:] - c[:-1] == 1).all()):
            return (int(c[0]), int(c.numel()))  # contiguous: the aligned range kernel applies
    return c


# ------------------------------------------------------------------------------------------------ the two paths
def cpu_gather(
    table: torch.Tensor, idx: torch.Tensor, device: torch.device | str, cols: Columns = None
) -> torch.Tensor:
    """``table[idx]`` (``[:, cols]``) by CPU ``index_select`` into a pinned buffer and a non_blocking copy to ``device``.

    ``table`` is a 2-D CPU tensor and ``idx`` already checked (:func:`check_indices`). On a CPU ``device`` the buffer
    is the result (no pinning, no copy).
    """
    dev = torch.device(device)
    idx = idx.to("cpu")
    sel = _columns(cols, table.shape[1])
    pin = dev.type == "cuda"
    n_sel = table.shape[1] if sel is None else (sel[1] if isinstance(sel, tuple) else sel.numel())
    buf = torch.empty((idx.numel(), n_sel), dtype=table.dtype, pin_memory=pin)
    if sel is None:
        torch.index_select(table, 0, idx, out=buf)
    elif isinstance(sel, tuple):
        torch.index_select(table[:, sel[0] : sel[0] + sel[1]], 0, idx, out=buf)
    else:
        buf.copy_(table[idx[:, None], sel[None, :]])
    return buf.to(dev, non_blocking=True) if dev.type != "cpu" else buf


class _UVA:
    """What a Triton launch needs of a pointer argument: the pinned host table's address (valid on the GPU under UVA)
    and its dtype. A plain CPU tensor would make Triton treat the launch as a CPU one."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self._ptr, self.dtype = t.data_ptr(), dtype or t.dtype

    def data_ptr(self) -> int:
        return self._ptr


def launch_shape(
    n_cols: int, elem_bytes: int, aligned: bool, rows_per_program: int = 0
) -> tuple[int, int, int]:
    """(BLOCK, n_chunks, ROWS) for a row window of ``n_cols`` elements.

    Aligned rows need up to ``LINE/elem - 1`` extra leading lanes. BLOCK is the power of two (64..1024) with the fewest
    lanes in all (ties: the larger block, fewer loop trips); ROWS fills a tile of about 4096 lanes.
    """
    span = n_cols + (LINE_BYTES // elem_bytes - 1 if aligned else 0)
    best = None
    b = 64
    while b <= _MAX_BLOCK:
        chunks = -(-span // b)
        key = (chunks * b, -b)
        if best is None or key < best[0]:
            best = (key, b, chunks)
        b *= 2
    _, block, chunks = best  # type: ignore[misc]
    rows = rows_per_program or max(1, min(64, _TILE_ELEMS // block))
    return block, chunks, rows


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_bytes(table: torch.Tensor, col0: int, width: int) -> int:
    """The widest word (8, 4, 2 or 1 B) that evenly divides the table's address, its row stride, and the window's
    first column and width, all in bytes. A gather only copies bits, so a row window moves as such words: a 2-KiB
    bf16 row is 256 int64 loads per row instead of 1024 two-byte ones (same lines read, 4x fewer load instructions)."""
    elem = table.element_size()
    for w in (8, 4, 2, 1):
        if w >= elem and all(
            v % w == 0 for v in (table.data_ptr(), table.stride(0) * elem, col0 * elem, width * elem)
        ):
            return w
    return elem


def zero_copy_gather(
    table: torch.Tensor,
    idx: torch.Tensor,
    device: torch.device | str,
    cols: Columns = None,
    aligned: bool = True,
    rows_per_program: int = 0,
    widen: bool = True,
    sort_indices: bool = False,
    num_warps: int = 4,
) -> torch.Tensor:
    """``table[idx]`` (``[:, cols]``) gathered by the Triton kernel reading ``table`` in place.

    ``table``: 2-D contiguous CPU tensor, pinned when ``device`` is CUDA (the caller's duty: :class:`FeatureStore`);
    ``idx``: checked int64 indices. On a CPU ``device`` this needs ``TRITON_INTERPRET=1``. ``widen``: a contiguous
    column window is copied as the widest integer words that fit it (:func:`word_bytes`); a column list is not.
    ``sort_indices``: read the rows in address order (one sort of ``idx`` on the device), each written to its place.

    On CUDA it all runs under ``torch.cuda.device(device)``: Triton launches on the *current* device and its current
    stream, which need not be ``device`` (a store on cuda:1, or DGL's prefetch thread, which starts on device 0).
    """
    dev = torch.device(device)
    guard = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with guard:
        return _zero_copy_gather(
            table, idx, dev, cols, aligned, rows_per_program, widen, sort_indices, num_warps
        )


def _zero_copy_gather(
    table: torch.Tensor,
    idx: torch.Tensor,
    dev: torch.device,
    cols: Columns,
    aligned: bool,
    rows_per_program: int,
    widen: bool,
    sort_indices: bool,
    num_warps: int,
) -> torch.Tensor:
    from flowlane.direct import kernels

    idx = idx.to(dev)
    n, n_cols = idx.numel(), table.shape[1]
    pos = idx  # not read unless permuted
    if sort_indices and n > 1:
        idx, pos = torch.sort(idx)
    permuted = pos is not idx
    sel = _columns(cols, n_cols)
    elem = table.element_size()
    src: Any = _UVA(table) if dev.type == "cuda" else table
    if isinstance(sel, torch.Tensor):
        out = torch.empty((n, sel.numel()), dtype=table.dtype, device=dev)
        if n and sel.numel():
            block, chunks, rows = launch_shape(sel.numel(), elem, False, rows_per_program)
            kernels.gather_cols_kernel[(-(-n // rows),)](
                src,
                idx,
                pos,
                sel.to(dev),
                out,
                n,
                sel.numel(),
                table.stride(0),
                out.stride(0),
                chunks,
                ROWS=rows,
                BLOCK=block,
                PERMUTED=permuted,
                num_warps=num_warps,
            )
        return out
    col0, width = (0, n_cols) if sel is None else sel
    word = word_bytes(table, col0, width) if widen else elem
    k = word // elem  # table elements per word: the kernel counts in words
    wdtype = table.dtype if k == 1 else _WORD_DTYPES[word]
    if k > 1:
        src = _UVA(table, wdtype) if dev.type == "cuda" else table.view(wdtype)
    out = torch.empty((n, width // k), dtype=wdtype, device=dev)
    if n and width:
        block, chunks, rows = launch_shape(width // k, word, aligned, rows_per_program)
        base_off = (table.data_ptr() % LINE_BYTES) // word
        kernels.gather_rows_kernel[(-(-n // rows),)](
            src,
            idx,
            pos,
            out,
            n,
            width // k,
            table.stride(0) // k,
            out.stride(0),
            col0 // k,
            base_off,
            chunks,
            LINE_ELEMS=LINE_BYTES // word,
            ALIGNED=aligned,
            ROWS=rows,
            BLOCK=block,
            PERMUTED=permuted,
            num_warps=num_warps,
        )
    return out if k == 1 else out.view(table.dtype)


def group_columns_(table: torch.Tensor, first: torch.Tensor, chunk_rows: int = 65536) -> torch.Tensor:
    """Reorder the columns of a 2-D ``table`` in place so that columns ``first`` (in that order) come first, the others
    after them in their old order; returns ``perm`` with ``new_table[:, j] == old_table[:, perm[j]]``.

    A column-masked gather saves PCIe requests only when its columns are contiguous (a random 128 of 512 fp32
    columns still touch ~all 16 lines of a row; results/direct/request_model.json): this one-time permutation
    makes DGS's top-N_f columns the range ``0..N_f-1`` (wave2-anchors §4(d)). Extra memory: ``chunk_rows`` rows.
    """
    if table.dim() != 2:
        raise ValueError(f"group_columns_ needs a 2-D table, got shape {tuple(table.shape)}")
    n_cols = table.shape[1]
    sel = _columns(first, n_cols)
    first = (
        torch.arange(sel[0], sel[0] + sel[1])
        if isinstance(sel, tuple)
        else (sel if sel is not None else torch.arange(n_cols))
    )
    if first.unique().numel() != first.numel():
        raise ValueError(f"columns to group must be distinct, got {first.tolist()}")
    rest = torch.ones(n_cols, dtype=torch.bool)
    rest[first] = False
    perm = torch.cat([first, rest.nonzero().flatten()])
    for s in range(0, table.shape[0], chunk_rows):
        blk = table[s : s + chunk_rows]
        blk.copy_(blk[:, perm])
    return perm


# ------------------------------------------------------------------------------------------------ pinning
def _register(t: torch.Tensor) -> None:
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if rc != 0:
        raise RuntimeError(
            f"cudaHostRegister of the {t.numel() * t.element_size():,}-byte feature table failed with "
            f"cudaError {rc} (712 = already registered: pin it once, or pass a pinned tensor)"
        )


def _unregister(ptr: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(ptr)


#: start address -> [bytes, open stores] of each range a FeatureStore registered. A store on the range or on a view
#: inside it takes a reference, and the last one to close unpins it (closing one must not unpin it under another's
#: reads); cudaHostRegister cannot pin a range that partly overlaps a registered one, so such a table is refused.
_PINS: dict[int, list[int]] = {}
_PINS_LOCK = threading.Lock()


def _hold_pin(t: torch.Tensor, pinned: bool) -> int | None:
    """Take a reference on the registered range holding ``t``'s bytes, registering them when they are not pinned yet;
    returns the range's start for :func:`_release_pin`, or None for the caller's own pinned memory (never unpinned by
    a store)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    with _PINS_LOCK:
        for start, held in _PINS.items():
            end = start + held[0]
            if start <= lo and hi <= end:
                held[1] += 1
                return start
            if lo < end and start < hi:
                raise RuntimeError(
                    f"the feature table's bytes [{lo:#x}, {hi:#x}) ({hi - lo:,} B) partly overlap the range "
                    f"[{start:#x}, {end:#x}) ({held[0]:,} B) that an open FeatureStore pinned; overlapping ranges "
                    f"cannot be pinned twice: build the store on the enclosing table first (stores on views inside "
                    f"it share its pin), or close the stores on the other range"
                )
        if pinned:
            return None
        _register(t)  # in place: the table's own pages become pinned and mapped (UVA)
        _PINS[lo] = [hi - lo, 1]
        return lo


def _release_pin(start: int, last_gather: list[Any]) -> None:
    """Drop a store's reference on the range at ``start``; the last one unpins it. Waits first for the store's last
    zero-copy kernel (``last_gather[0]``, a CUDA event): launches are asynchronous, and a one-line
    ``FeatureStore(t).gather(idx)`` is collected while its kernel may still read the pages."""
    if last_gather[0] is not None:
        last_gather[0].synchronize()
    with _PINS_LOCK:
        held = _PINS[start]
        held[1] -= 1
        if held[1]:
            return
        del _PINS[start]
        _unregister(start)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Where a store's gathers land: ``device``, with a bare ``cuda`` made ``cuda:<current device>`` (as DGL's
    DataLoader does, so the two compare equal); None: the current CUDA device when available, else CPU. A CUDA device
    is refused when CUDA is not usable here (instead of a driver error at the first gather)."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={str(device)!r}: CUDA is not available here; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device={str(device)!r}: there are {torch.cuda.device_count()} CUDA device(s) here "
                f"(allowed: cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    return dev


class FeatureStore:
    """A host feature table gathered onto ``device`` by the chosen path; ``store.gather(idx) == table[idx]`` bitwise.

    Parameters
    ----------
    table : torch.Tensor
        Contiguous CPU tensor ``[rows, ...]``; trailing dimensions are flattened into one row and restored on output.
        When CUDA is present and ``config.pin`` it is pinned **in place** (``cudaHostRegister``, no second copy) and
        unpinned by :meth:`close` (or when the store is garbage-collected) of the last store on it or on a view inside
        it, after that store's last zero-copy kernel. A table that is already pinned otherwise is used as is. With
        ``config.pin=False`` the store neither pins nor reads zero-copy, even a table pinned already.
    config : DirectConfig, optional
        Path, alignment, pinning and index checks.
    device : torch.device or str, optional
        Where gathered rows land (default: the current CUDA device when available, else CPU); ``"cuda"`` means the
        current CUDA device. A CUDA device is refused where CUDA is not usable.

    Examples
    --------
    >>> import torch
    >>> from flowlane.direct import FeatureStore, DirectConfig
    >>> feats = torch.arange(12.0).reshape(4, 3)
    >>> store = FeatureStore(feats, DirectConfig(path="cpu-gather"), device="cpu")
    >>> store.gather(torch.tensor([2, 0, 2])).tolist()
    [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]
    >>> store.close()
    """

    def __init__(
        self,
        table: torch.Tensor,
        config: DirectConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config or DirectConfig()
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"table must be a torch.Tensor, got {type(table).__name__}")
        if table.device.type != "cpu":
            raise ValueError(
                f"table is on {table.device}; a FeatureStore holds a host (CPU) table. A table already in "
                f"GPU memory needs no zero-copy: use table[idx]"
            )
        if table.dim() < 1 or not table.is_contiguous():
            raise ValueError(
                f"table must be a contiguous tensor of >= 1 dimension (got shape {tuple(table.shape)}, "
                f"contiguous={table.is_contiguous()}); pinning in place needs one contiguous range, and "
                f".contiguous() would make the second copy this store avoids"
            )
        self.table = table
        self.row_shape = tuple(table.shape[1:])
        self._flat = table if table.dim() == 2 else table.view(table.shape[0], math.prod(self.row_shape))
        self.device = resolve_device(device)
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        #: the event recorded after the last zero-copy launch, waited for before the table is unpinned
        self._last_gather: list[Any] = [None]
        pinned = table.is_pinned() if torch.cuda.is_available() else False
        # config.pin=False: no zero-copy even on a table pinned already (the config's documented meaning)
        self.choice = choose_path(
            self.device,
            table.dtype,
            pinned=self.config.pin and (pinned or torch.cuda.is_available()),
            requested=self.config.path,
        )
        zero_copy = self.choice.path == "zero-copy" and self.device.type == "cuda" and table.numel()
        if zero_copy:
            with torch.cuda.device(self.device):  # registered from the device whose kernels read it
                start = _hold_pin(table, pinned)
            if start is not None:
                self._finalizer = weakref.finalize(self, _release_pin, start, self._last_gather)

    @property
    def path(self) -> str:
        """'zero-copy' or 'cpu-gather'."""
        return self.choice.path

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def gather(self, idx: torch.Tensor, cols: Columns = None) -> torch.Tensor:
        """Rows ``idx`` of the table on ``self.device``: ``table[idx]``, or ``table[idx][:, cols]`` for a 2-D table.

        ``cols`` selects feature columns (DGS feature sampling): a slice/range with step 1, or an int64 tensor of column
        indices (a contiguous run takes the aligned range kernel). Out-of-range indices raise ``IndexError``.
        """
        if self._closed:
            raise RuntimeError("this FeatureStore is closed (its table may be unpinned); build a new one")
        if self.config.check_indices:
            idx = check_indices(idx, self.num_rows)
        elif idx.dtype != torch.int64:
            idx = idx.long()
        if cols is not None and self.table.dim() != 2:
            raise ValueError(
                f"a column selection needs a 2-D table; this one has shape {tuple(self.table.shape)}"
            )
        if self.path == "zero-copy":
            c = self.config
            out = zero_copy_gather(
                self._flat,
                idx,
                self.device,
                cols,
                c.aligned,
                c.rows_per_program,
                sort_indices=c.sort_indices,
                num_warps=c.num_warps,
            )
            if self._finalizer is not None:
                if self._last_gather[0] is None:
                    self._last_gather[0] = torch.cuda.Event()
                self._last_gather[0].record(torch.cuda.current_stream(self.device))
        else:
            out = cpu_gather(self._flat, idx, self.device, cols)
        return out if cols is not None or self.table.dim() == 2 else out.reshape(-1, *self.row_shape)

    def close(self) -> None:
        """Release the table (idempotent): unpinned, once this store's last zero-copy kernel is done, if a store pinned
        it and no other store on it is open; later gathers are refused."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"FeatureStore(rows={self.num_rows}, row_shape={self.row_shape}, dtype={self.table.dtype}, "
            f"device={self.device}, path={self.path!r}: {self.choice.reason})"
        )
