"""Logical residency of saved activations: bytes of saved-tensor storages alive, tracked with finalizers.

On CPU there is no ``max_memory_allocated``; the digest (A6, §2.5.1) recommends counting the bytes of saved-activation
storages alive, via ``weakref.finalize`` on ``UntypedStorage`` (the Python storage object is preserved for as long as
the storage lives, on torch 2.2 and 2.15). Each storage counts once, however many views of it were saved.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

_UID = itertools.count(1)


def storage_uid(st: torch.UntypedStorage) -> int:
    """A process-unique, monotonic id kept on the storage object (digest A1: never ``id()`` or data pointers,
    which are reused after a free; never wall-clock timestamps, which tie)."""
    uid = getattr(st, "_flowlane_uid", None)
    if uid is None:
        uid = next(_UID)
        st._flowlane_uid = uid  # type: ignore[attr-defined]
    return uid


class Residency:
    """Current and peak bytes of distinct storages registered with :meth:`add` and still alive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def add(self, st: torch.UntypedStorage) -> None:
        uid = storage_uid(st)
        n = st.nbytes()
        with self._lock:
            if uid in self._live:
                return
            self._live[uid] = n
            self.current += n
            self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._drop, uid)

    def _drop(self, uid: int) -> None:
        with self._lock:
            n = self._live.pop(uid, 0)
            self.current -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


def is_flattenable(t: torch.Tensor) -> bool:
    """A tensor subclass implementing PyTorch's wrapper-subclass protocol (``__tensor_flatten__`` /
    ``__tensor_unflatten__``: DTensor, torchao's float8 tensors): its data lives in plain inner tensors, which can be
    moved like any activation, and the subclass is rebuilt around them."""
    cls = type(t)
    return (
        cls is not torch.Tensor
        and hasattr(cls, "__tensor_flatten__")
        and hasattr(cls, "__tensor_unflatten__")
    )


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors holding ``t``'s data: ``[t]`` (a parameter's ``.data``), a flattenable subclass's inner
    tensors (recursively), or None for a subclass that cannot be flattened."""
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    if type(data) is torch.Tensor:
        return [data]
    if not is_flattenable(data):
        return None
    out: list[torch.Tensor] = []
    for name in data.__tensor_flatten__()[0]:
        inner = getattr(data, name)
        if isinstance(inner, torch.Tensor):  # DTensor also names its device mesh here
            sub = plain_tensors(inner)
            if sub is None:
                return None
            out += sub
    return out


def eligible(t: torch.Tensor, min_bytes: int, include_cpu: bool = True) -> bool:
    """A saved tensor the cache would consider: strided, not a parameter, >= min_bytes (Alg. 5.2 line 12)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
        return False
    if t.device.type == "cpu" and not include_cpu:
        return False
    if getattr(t.untyped_storage(), "_flowlane_param", False):
        return False
    return t.numel() * t.element_size() >= min_bytes


def mark_parameters(params: Iterable[torch.nn.Parameter]) -> None:
    """Tag parameter storages (and so every view of them, e.g. the ``W.t()`` a Linear saves; thesis §5.3.3); for a
    subclass parameter (DTensor) the storages of its plain inner tensors."""
    for p in params:
        for x in plain_tensors(p) or ():
            x.untyped_storage()._flowlane_param = True  # type: ignore[attr-defined]


@contextmanager
def track_saved_tensors(min_bytes: int, params: list | None = None) -> Iterator[Residency]:
    """Baseline tracker (no offload): count saved storages >= ``min_bytes`` that autograd keeps alive.

    Used for the "keep" and "recompute" columns of the benchmark; the tensor is returned unchanged.
    """
    if params is not None:
        mark_parameters(params)
    res = Residency()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            for x in plain_tensors(t) or ():
                if eligible(x, min_bytes):
                    res.add(x.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield res
