"""DGS (seed 000 ch. 3, ICNP'22): explanation-guided node and feature sampling for distributed mini-batch GNNs.

The DGL-free core: the ``flowlane.dgs`` config, masks -> probabilities, the ε quota split and the picks inside it,
top-N_f column selection, byte accounting, and the explainer's mask training on the explanation graph (torch only).
The DistDGL parts (services, sampler, explainer process) are in ``dgl_plugin.dgs``. Public API::

    from flowlane.dgs import DGSConfig, pick, quota_split, top_columns, train_masks
    cfg = DGSConfig.from_dict({"n_f": 0.85, "epsilon": 0.1, "t_ex": 30})
    keep = pick(offsets, nbr, local, weight, fanout=10, epsilon=cfg.epsilon, rng=np.random.default_rng(0))
    cols = top_columns(sf, cfg.n_f)
"""

from flowlane.dgs.config import DGSConfig
from flowlane.dgs.explain import Explanation, pooled_target, star_edges, train_masks
from flowlane.dgs.sampling import (
    ByteLedger,
    node_probabilities,
    pick,
    pull_bytes,
    quota_split,
    sampling_bytes,
    shared_uniform,
    top_columns,
)

__all__ = [
    "ByteLedger",
    "DGSConfig",
    "Explanation",
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
