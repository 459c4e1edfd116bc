"""flowlane.sim: an event-driven, flow-level simulator of distributed-training iterations.

Public API: a named workload on its fabric (``flowlane.sim.workloads``: the LLM presets of seed 000 table 5.5,
``dlrm``, data-parallel CNNs; or a :class:`Workload` built by hand), run under a scheduling policy by name
(``flowlane.policies``). DLRM on 16 GPUs at 25 Gbps, issue order against Hermod's: the all-to-alls (``ep``) finish
sooner when they go first, the data-parallel all-reduces (``dp``) and the iteration are unchanged::

    >>> from flowlane.sim import SimConfig, Simulator
    >>> from flowlane.sim.workloads import build_workload
    >>> from flowlane.policies import make_policy
    >>> topo, wl = build_workload("dlrm", gpus=16, bandwidth_gbps=25)
    >>> for name in ("fifo", "hermod"):
    ...     res = Simulator(topo, SimConfig()).run(wl, make_policy(name))
    ...     cct = {ctype: round(c["mean_s"] * 1e3, 3) for ctype, c in res.cct_by_ctype().items()}
    ...     print(f"{name}: iteration {res.iteration_time * 1e3:.1f} ms, mean coflow time (ms) {cct}")
    fifo: iteration 95.2 ms, mean coflow time (ms) {'dp': 41.22, 'ep': 6.03}
    hermod: iteration 95.2 ms, mean coflow time (ms) {'dp': 41.22, 'ep': 5.317}

``res.link_utilisation`` and the per-coflow and per-task start and end arrays hold the rest; ``flowlane sim --workload
dlrm --gpus 16 --bandwidth 25 --policy fifo,hermod`` runs the same from the command line.
"""

from flowlane.sim.engine import ROUTING, SimConfig, SimResult, Simulator
from flowlane.sim.graph import Coflow, ComputeTask, PhasedAllToAll, SimSpecError, Workload
from flowlane.sim.network import IncastModel, allocate, waterfill

__all__ = [
    "ROUTING",
    "Coflow",
    "ComputeTask",
    "IncastModel",
    "PhasedAllToAll",
    "SimConfig",
    "SimResult",
    "SimSpecError",
    "Simulator",
    "Workload",
    "allocate",
    "waterfill",
]
