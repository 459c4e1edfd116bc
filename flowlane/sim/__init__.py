"""flowlane.sim: an event-driven, flow-level simulator of distributed-training iterations.

Public API::

    from flowlane.sim import Simulator, SimConfig, Workload, build_workload
    topo, wl = build_workload("gpt3-175b", gpus=1024)
    res = Simulator(topo, SimConfig()).run(wl, make_policy("fifo"))
    res.iteration_time, res.cct_by_ctype(), res.link_utilisation
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
