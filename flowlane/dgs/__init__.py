"""DGS (seed 000 ch. 3, ICNP'22): explanation-guided node and feature sampling for distributed mini-batch GNNs.

The DGL-free core: the ``flowlane.dgs`` config, masks -> probabilities, the ε quota split and the picks inside it,
top-N_f column selection, byte accounting, and the explainer's mask training on the explanation graph (torch only).
The DistDGL parts (services, sampler, explainer process) are in ``dgl_plugin.dgs``. First calls::

    >>> import numpy as np
    >>> from flowlane.dgs import DGSConfig, node_probabilities, pick, pull_bytes, quota_split, top_columns
    >>> cfg = DGSConfig.from_dict({"n_f": 0.5, "epsilon": 0.2})  # a recipe's ``flowlane.dgs`` section, validated
    >>> # fanout 5 for two nodes with (2 local, 6 remote) and (1, 5) neighbours: split in proportion, then
    >>> # round(ε · 5) = 1 pick moves from the remote quota to the local one
    >>> quota_split(np.array([2, 1]), np.array([6, 5]), fanout=5, epsilon=cfg.epsilon)  # (local, remote)
    (array([2, 1]), array([3, 4]))
    >>> # that hop's candidates, CSR by node: ids < 10 are local (weight 1), remote ones weigh 𝒮𝒩 + floor
    >>> offsets, nbr = np.array([0, 8, 14]), np.array([1, 2, 10, 11, 12, 13, 14, 15, 3, 16, 17, 18, 19, 20])
    >>> local, weight = nbr < 10, np.ones(nbr.size)
    >>> weight[~local] = node_probabilities(np.array([0.9, 0.1, 0.8, 0.05, 0.3, 0.6, 0.2, 0.7, 0.4, 0.1, 0.5]))
    >>> keep = pick(offsets, nbr, local, weight, fanout=5, epsilon=cfg.epsilon, rng=np.random.default_rng(0))
    >>> [nbr[a:b][keep[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])]  # within the quotas above
    [[1, 2, 12, 14, 15], [3, 16, 17, 19, 20]]
    >>> # feature sampling: remote rows bring only the top n_f of the columns by 𝒮ℱ, ceil(0.5 · 8) = 4 of 8
    >>> top_columns(np.array([0.1, 0.9, 0.5, 0.9, 0.2, 0.7, 0.05, 0.3]), cfg.n_f).tolist()
    [1, 2, 3, 5]
    >>> pull_bytes(100, 4, 4, 8), pull_bytes(100, 8, 4, 8)  # (request, response) bytes of 100 fp32 rows: 4 vs 8 cols
    ((832, 1600), (800, 3200))
"""

from flowlane.dgs.config import DGSConfig
from flowlane.dgs.explain import Explanation, pooled_target, star_edges, train_masks
from flowlane.dgs.sampling import (
    SN_TRANSFORMS,
    ByteLedger,
    labor_inclusion,
    node_probabilities,
    pick,
    pull_bytes,
    quota_split,
    sampling_bytes,
    shared_uniform,
    top_columns,
)

__all__ = [
    "SN_TRANSFORMS",
    "ByteLedger",
    "DGSConfig",
    "Explanation",
    "labor_inclusion",
    "node_probabilities",
    "pick",
    "pooled_target",
    "pull_bytes",
    "quota_split",
    "sampling_bytes",
    "shared_uniform",
    "star_edges",
    "top_columns",
    "train_masks",
]
