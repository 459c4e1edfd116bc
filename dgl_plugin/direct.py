"""PyTorch-Direct for DGL dataloaders (seed 003 ch. 4; issue 39): input features gathered from a host table pinned in
place, by GPU zero-copy reads (flowlane.direct), inside DGL's own ``dgl.dataloading.DataLoader``.

It attaches through two documented DGL extension points, leaving sampling and the training loop alone:

- a ``dgl.storages.FeatureStorage`` (:class:`DirectFeatureStorage`: ``fetch(indices, device, pin_memory)``) registered
  with ``DataLoader.attach_data(name, storage)``;
- a ``dgl.dataloading.Sampler`` (:class:`DirectSampler`) whose samples end with ``LazyFeature(name, input_nodes)``:
  the DataLoader's prefetcher replaces it by ``storage.fetch(input_nodes, loader.device, ...)``.

Usage (the path is a config option, ``DirectConfig`` or a mapping such as a Hydra ``flowlane.direct`` group)::

    sampler = DirectSampler(dgl.dataloading.NeighborSampler([10, 10]), name="feat")
    loader = dgl.dataloading.DataLoader(g, train_nids, sampler, batch_size=1024, device="cuda")
    attach_direct_features(loader, g.ndata["feat"], {"path": "auto"}, name="feat")
    for input_nodes, output_nodes, blocks, x in loader:   # x == g.ndata["feat"][input_nodes], on loader.device
        ...

Zero-copy applies only to a CUDA loader (``device="cuda"``), and DGL moves the sampled blocks there, which needs a CUDA
build of DGL: PyPI's dgl wheels (dgl 2.1.0, the gnn lane's pin) are CPU-only, so :func:`attach_direct_features`
refuses a CUDA loader on such a build, naming it. With a CPU loader the features are gathered on the CPU (the
cpu-gather path: index_select, DGL's own semantics) and zero-copy never applies. (DGL's own UVA path,
``g.pin_memory_()`` + ``use_uva=True``, needs a CUDA build of DGL as well.)

Heterogeneous graphs: pass ``{ntype: table}``; each table is its own store (pinned in place, path chosen per table)
and a typed mini-batch (``input_nodes`` a ``{ntype: ids}`` dict) gets ``{ntype: features}`` for the types that have
a table, as ``blocks[0].srcdata[...]`` has for DGL's own prefetch (types without features are left out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dgl
import torch
from dgl.dataloading import Sampler
from dgl.frame import LazyFeature
from dgl.storages import FeatureStorage

from flowlane.direct import DirectConfig, FeatureStore


def direct_config(config: DirectConfig | Mapping[str, Any] | None) -> DirectConfig:
    """A :class:`DirectConfig` from a config object, a plain/Hydra mapping (unknown keys refused), or None."""
    if isinstance(config, DirectConfig):
        return config
    if config is not None and not isinstance(config, Mapping):
        try:  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
        except Exception:  # noqa: BLE001
            raise TypeError(
                f"direct config must be a DirectConfig or a mapping, got {type(config).__name__}"
            ) from None
    return DirectConfig.from_dict(config)  # type: ignore[arg-type]


class DirectFeatureStorage(FeatureStorage):
    """A DGL feature storage backed by :class:`flowlane.direct.FeatureStore` (zero-copy or cpu-gather): one table,
    or one per node type (``{ntype: table}``) for heterogeneous graphs."""

    def __init__(
        self,
        features: torch.Tensor | Mapping[str, torch.Tensor],
        config: DirectConfig | Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        cfg = direct_config(config)
        self.stores: dict[str, FeatureStore] | None = None
        if isinstance(features, Mapping):
            if not features:
                raise ValueError("features={} names no node type; pass a tensor or {ntype: tensor}")
            bad = {nt: type(t).__name__ for nt, t in features.items() if not isinstance(t, torch.Tensor)}
            if bad:
                raise TypeError(f"features must map node types to tensors; got {bad}")
            self.stores = {}
            try:
                for nt, table in features.items():
                    self.stores[nt] = FeatureStore(table, cfg, device=device)
            except BaseException:
                self.close()  # unpin what was pinned before the failing table
                raise
            self.store = next(iter(self.stores.values()))
        else:
            self.store = FeatureStore(features, cfg, device=device)

    def fetch(self, indices: Any, device: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        """``features[indices]`` on ``device`` (DGL's FeatureStorage contract), per node type when ``indices`` is a
        ``{ntype: ids}`` dict; ``pin_memory`` is DGL's hint for its own CPU path and is not needed here (the
        cpu-gather path always stages through pinned memory)."""
        if torch.device(device) != self.store.device:
            raise ValueError(
                f"the DataLoader fetches onto {torch.device(device)} but this storage gathers onto "
                f"{self.store.device}; build it with device=loader.device (attach_direct_features does)"
            )
        if self.stores is None:
            if isinstance(indices, Mapping):
                raise ValueError(
                    f"this storage holds one node feature table (homogeneous graphs) but the mini-batch has "
                    f"types {sorted(indices)}; pass {{ntype: table}} for a heterogeneous graph"
                )
            return self.store.gather(indices)
        if not isinstance(indices, Mapping):
            raise ValueError(
                f"this storage holds tables for node types {sorted(self.stores)} but the mini-batch's input nodes "
                f"are untyped ({type(indices).__name__}); use it on the heterogeneous graph it was built for"
            )
        return {nt: self.stores[nt].gather(ids) for nt, ids in indices.items() if nt in self.stores}

    def close(self) -> None:
        """Unpin the feature tables the stores pinned."""
        # self.stores is {} (and self.store unset) when the first of several tables is refused
        for store in (self.stores if self.stores is not None else {"": self.store}).values():
            store.close()


class DirectSampler(Sampler):
    """Wraps a DGL sampler whose samples start with the input node IDs (``NeighborSampler`` and other block samplers:
    ``(input_nodes, output_nodes, blocks)``) and appends ``LazyFeature(name, input_nodes)`` to each sample."""

    def __init__(self, sampler: Sampler, name: str = "feat") -> None:
        super().__init__()
        if not hasattr(sampler, "sample"):
            raise TypeError(f"sampler must be a dgl.dataloading.Sampler, got {type(sampler).__name__}")
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"name={name!r} must be a non-empty string (the name given to attach_direct_features)"
            )
        self.sampler, self.name = sampler, name

    def sample(self, g: Any, indices: Any) -> tuple:
        out = self.sampler.sample(g, indices)
        first = out[0] if isinstance(out, tuple | list) and out else None
        if not (
            isinstance(first, torch.Tensor)
            or (isinstance(first, Mapping) and all(isinstance(v, torch.Tensor) for v in first.values()))
        ):
            raise TypeError(
                f"{type(self.sampler).__name__}.sample returned {type(out).__name__} whose first item is "
                f"not the input node IDs (a tensor, or {{ntype: tensor}}); DirectSampler wraps samplers returning "
                f"(input_nodes, output_nodes, blocks)"
            )
        return (*out, LazyFeature(self.name, out[0]))


def attach_direct_features(
    loader: Any,
    features: torch.Tensor | Mapping[str, torch.Tensor],
    config: DirectConfig | Mapping[str, Any] | None = None,
    name: str = "feat",
) -> DirectFeatureStorage:
    """Register ``features`` (a table, or ``{ntype: table}`` for a heterogeneous graph) under ``name`` on a
    ``dgl.dataloading.DataLoader`` (its ``attach_data``), gathered onto ``loader.device`` by the configured path.
    Returns the storage (``storage.store.path`` says which path runs). A CUDA loader needs a CUDA build of DGL
    (refused otherwise); on a CPU loader the features take the cpu-gather path."""
    if not hasattr(loader, "attach_data"):
        raise TypeError(
            f"loader must be a dgl.dataloading.DataLoader (it has attach_data), got {type(loader).__name__}"
        )
    if not isinstance(loader.graph_sampler, DirectSampler) or loader.graph_sampler.name != name:
        raise ValueError(
            f"the loader's sampler must be DirectSampler(..., name={name!r}) so that its samples ask for "
            f"{name!r}; got {type(loader.graph_sampler).__name__}"
        )
    dev = torch.device(loader.device)
    if dev.type == "cuda":
        from dgl_plugin.fullgraph import dgl_has_cuda

        if not dgl_has_cuda():
            # DGL itself would fail at the first batch ("Device API cuda is not enabled") moving the blocks there
            raise ValueError(
                f"the DataLoader's device={dev} needs a CUDA build of DGL, and this DGL build ({dgl.__version__}) "
                f"has no CUDA support (PyPI's dgl wheels are CPU-only): install a CUDA build of DGL, or use "
                f"device='cpu' (then the features take the cpu-gather path; zero-copy needs a CUDA loader)"
            )
    if isinstance(features, Mapping):
        ntypes = list(loader.graph.ntypes)
        unknown = sorted(set(features) - set(ntypes))
        if unknown:
            raise ValueError(f"features name node types {unknown} the graph does not have; it has {ntypes}")
        rows = {nt: t.shape[0] for nt, t in features.items() if t.shape[0] != loader.graph.num_nodes(nt)}
        if rows:
            need = {nt: loader.graph.num_nodes(nt) for nt in rows}
            raise ValueError(f"feature tables need one row per node: got {rows} rows for {need} nodes")
    elif isinstance(features, torch.Tensor) and features.shape[0] != loader.graph.num_nodes():
        raise ValueError(
            f"the feature table needs one row per node: got {features.shape[0]} rows for "
            f"{loader.graph.num_nodes()} nodes"
        )
    storage = DirectFeatureStorage(features, config, device=loader.device)
    loader.attach_data(name, storage)
    return storage
