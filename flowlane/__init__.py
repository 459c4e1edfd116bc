"""flowlane: communication-efficient distributed training — the common core.

The core imports no training framework (no megatron, deepspeed or dgl), and nothing in it runs on import. Where
each research system lives (the framework plugins translate a framework's events into these calls; the README has
the full map with tests, benchmarks and results):

========================  ============================================================================================
``flowlane.hermod``       Hermod (seed 000 ch.5): coflow keys and order, wire classes, BvN-matched all-to-all (pure)
``flowlane.sched``        Hermod's runtime on real communicators (torch)
``flowlane.sim``          the flow-level simulator of training iterations, policies from ``flowlane.policies``
``flowlane.offload``      SSDTrain (seed 003 ch.5): the activation tensor cache, its I/O tiers and byte budget
``flowlane.syndicate``    SYNDICATE (seed 004): motifs, joint plan/order search, the launch-order enforcer
``flowlane.aleph``        ALEPH (seed 002): worker clustering and hierarchical gradient aggregation
``flowlane.plan``         DGCL (seed 001): communication plans for embedding exchange, and their executor
``flowlane.dgs``          DGS (seed 000 ch.3): explanation-guided node and feature sampling
``flowlane.direct``       PyTorch-Direct (seed 003 ch.4): zero-copy GPU gathers from pinned host features
``flowlane.hector``       Hector (seed 003 ch.3): relational-GNN operators without per-edge weight copies
========================  ============================================================================================

Each package's docstring opens with a runnable example (checked by ``tests/test_doctests.py``). Shared pieces:
``topology`` and ``comm`` (fabrics, recorded communication), ``launch`` (the local launcher), ``trace``,
``configs`` (config dataclasses and their argparse/Hydra mirrors), ``patching`` (the plugins' close-order-safe
patches), ``testing`` (netem and workload tools).
"""

__version__ = "0.1.0"
