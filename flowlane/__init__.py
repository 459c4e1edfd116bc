"""flowlane: communication-efficient distributed training — the common core.

The core imports no training framework (no megatron, deepspeed or dgl): topology and cost models, recorded
communication, traces, the local launcher, and (in sub-packages) the simulator, planners, schedulers and the
offload cache.
"""

__version__ = "0.1.0"
