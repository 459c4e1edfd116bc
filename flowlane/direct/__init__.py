"""PyTorch-Direct (seed 003 ch. 4): GPU zero-copy gathers of feature rows from a pinned host table.

Public API::

    from flowlane.direct import DirectConfig, FeatureStore
    store = FeatureStore(features)            # pins `features` in place when CUDA is present (no second copy)
    x = store.gather(input_nodes)             # == features[input_nodes], on the GPU; zero-copy or cpu-gather
    x_top = store.gather(input_nodes, cols=range(0, 64))   # only some feature columns (DGS feature sampling)
    print(store.path, store.choice.reason); store.close()

Also: :func:`choose_path` (which path and why), :func:`place` (Table 4.2 placement rules), :func:`request_counts`
(128-B request model, Figs. 4.4-4.5), :func:`group_columns_` (one-time in-place column permutation, so that sampled
feature columns form a range a masked gather reads with few requests). Triton is imported only when a zero-copy gather runs; nothing happens on import.
The DGL adapter is ``dgl_plugin.direct``.
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
