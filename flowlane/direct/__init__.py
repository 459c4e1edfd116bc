"""PyTorch-Direct (seed 003 ch. 4): GPU zero-copy gathers of feature rows from a pinned host table.

On a GPU machine ``FeatureStore(features)`` pins ``features`` in place (no second copy) and gathers onto the current
CUDA device by zero-copy. With a CPU target (as here, so that the output is the same everywhere) it falls back to the
CPU gather and says why::

    >>> import torch
    >>> from flowlane.direct import DirectConfig, FeatureStore, choose_path
    >>> print(choose_path("cpu", torch.float32).reason)  # the path an fp32 table takes to a CPU target, and why
    the target device is the CPU (zero-copy needs CUDA; TRITON_INTERPRET=1 runs it on CPU for tests)
    >>> features, idx = torch.arange(80.0).reshape(10, 8), torch.tensor([7, 2, 2, 9])
    >>> store = FeatureStore(features, DirectConfig(path="auto"), device="cpu")  # the store asks choose_path too
    >>> store.path
    'cpu-gather'
    >>> x = store.gather(idx)
    >>> tuple(x.shape), torch.equal(x, features[idx])
    ((4, 8), True)
    >>> torch.equal(store.gather(idx, cols=range(0, 3)), features[idx][:, :3])  # some columns (DGS feature sampling)
    True
    >>> store.close()  # unpins the table if the store pinned it; later gathers are refused

Also: :func:`choose_path` (which path and why), :func:`place` (Table 4.2 placement rules), :func:`request_counts`
(128-B request model, Figs. 4.4-4.5), :func:`group_columns_` (one-time in-place column permutation, so that sampled
feature columns form a range a masked gather reads with few requests). Nothing happens on import; Triton is imported
only when a path is chosen for a CUDA target (or under ``TRITON_INTERPRET=1``). The DGL adapter is
``dgl_plugin.direct``.
"""

from flowlane.direct.config import LINE_BYTES, PATHS, DirectConfig
from flowlane.direct.placement import OPERANDS, Placement, place
from flowlane.direct.requests import SCHEMES, mean_requests, request_counts
from flowlane.direct.store import (
    ZERO_COPY_DTYPES,
    FeatureStore,
    PathChoice,
    check_indices,
    choose_path,
    cpu_gather,
    default_choice,
    group_columns_,
    interpreting,
    launch_shape,
    zero_copy_gather,
)

__all__ = [
    "LINE_BYTES",
    "OPERANDS",
    "PATHS",
    "SCHEMES",
    "ZERO_COPY_DTYPES",
    "DirectConfig",
    "FeatureStore",
    "PathChoice",
    "Placement",
    "check_indices",
    "choose_path",
    "cpu_gather",
    "default_choice",
    "group_columns_",
    "interpreting",
    "launch_shape",
    "mean_requests",
    "place",
    "request_counts",
    "zero_copy_gather",
]
