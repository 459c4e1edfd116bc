"""Run a SYNDICATE plan and its enforced order in :mod:`flowlane.sim`'s flow-level engine, at cluster scale.

``optSched`` scores plans with the alpha-beta-delta cost model. This bridge replays a chosen plan in the fluid
simulator, where flows share links max-min fairly over a leaf-spine fabric (and its incast model applies):

* every motif becomes one coflow. Ring all-reduce motifs use ring flows and tree motifs the double binary tree.
  Reduce-scatter and all-gather motifs use ring flows. An all-to-all or all-gather motif becomes a matrix over its
  destination offsets (splining);
* each path is a simulator *stream*, so a path's motifs run one at a time (non-preemptive). Motifs are added in the
  schedule's launch order, and the FIFO policy breaks ties by node id, so every stream serves its motifs in the
  enforced order;
* compute tasks run on one executor per GPU, in program order.

Several paths (seed 004 §4.3, the physical plan): the plan's first path in ``path_order`` (default: the sorted
path names, so ``F`` before ``S``) is the cluster fabric. Every other path gets a fabric of its own: one endpoint
per GPU (``<path>-nic<r>``) on one non-blocking switch, each link at the path's bandwidth (``1 / beta`` of the cost
model: seed 004 Fig. 18's front-end NICs and PCIe). A motif on that path moves its flows between those endpoints,
so it shares no link with the first fabric, and it runs on that path's stream. Compute and the dependencies stay
with the GPUs. A path's alpha and the incast penalty are not modelled there (the flow engine has its own latency
and incast models). The per-motif overhead ``delta`` is charged as the engine's ``launch_overhead``, the first
path's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flowlane.policy import CoflowMeta
from flowlane.syndicate.cost import CostModel, Option
from flowlane.syndicate.optsched import Comm, Compute, Schedule, TrainingDAG


def to_workload(
    dag: TrainingDAG,
    plan: Mapping[str, Option],
    schedule: Schedule,
    bandwidth_gbps: float = 100.0,
    topology: object | None = None,
    path_bandwidth: Mapping[str, float] | None = None,
    path_order: Sequence[str] | None = None,
) -> tuple[object, object]:
    """``(topology, workload)`` for ``flowlane.sim.Simulator``: ``dag`` under ``plan``, motifs in ``schedule``'s
    launch order. Every comm-op must span the same ``ranks`` (the GPUs simulated). ``path_bandwidth`` (bytes/s per
    endpoint link) is needed for every path after the first (see the module docstring)."""
    from flowlane.sim import SimSpecError, Workload
    from flowlane.sim.workloads import cluster

    used = {plan[c.name].path for c in dag.comms}
    order = list(path_order) if path_order is not None else sorted(used)
    if not used <= set(order):
        raise SimSpecError(f"plan paths {sorted(used - set(order))} are not in path_order {order}")
    sizes = {c.op.ranks for c in dag.comms}
    if len(sizes) != 1:
        raise SimSpecError(
            f"every comm-op must span the same ranks to map onto GPUs, got group sizes {sorted(sizes)}"
        )
    n = sizes.pop()
    topo = topology or cluster(n, bandwidth_gbps)
    devices, offset = _path_fabrics(topo, n, [p for p in order if p in used or p == order[0]], path_bandwidth)
    w = Workload(devices, name=f"{dag.name}@{n}")
    ranks = np.arange(n)
    steps = {s.name: (k, s) for k, s in enumerate(dag.steps)}
    events: list[tuple[float, int, int, tuple]] = []
    for it, name, s, _ in schedule.compute:
        events.append((s, 0, steps[name][0], (it, name)))
    for m in schedule.motifs:
        events.append((m.start, 1, m.position, (m.iteration, m.op, m.index)))
    events.sort(key=lambda e: (e[0], e[1], e[2]))  # topological: a task starts after its predecessors finish
    ends: dict[tuple[int, str], list[int]] = {}
    motif_ids: dict[tuple[int, str, int], int] = {}
    comp_ids: dict[tuple[int, str], list[int]] = {}
    motifs_of = {c.name: plan[c.name].motifs(c.op) for c in dag.comms}
    for _, kind, _, key in events:
        it, name = key[0], key[1]
        step = steps[name][1]
        pred_names = list(step.deps) + ([a for a, b in dag.carry if b == name] if it > 0 else [])
        pred_its = [it] * len(step.deps) + [it - 1] * (len(pred_names) - len(step.deps))
        if kind == 0:
            assert isinstance(step, Compute)
            ids = []
            for r in range(n):
                deps = []
                for p, pit in zip(pred_names, pred_its, strict=True):
                    if isinstance(steps[p][1], Compute):
                        deps.append(comp_ids[(pit, p)][r])
                    else:
                        deps += ends[(pit, p)]
                ids.append(w.compute(f"g{r}", step.seconds, deps, name, "compute"))
            comp_ids[(it, name)] = ids
            ends[(it, name)] = ids
            continue
        assert isinstance(step, Comm)
        j = key[2]
        m = motifs_of[name][j]
        deps = [d for p, pit in zip(pred_names, pred_its, strict=True) for d in ends[(pit, p)]]
        deps += [motif_ids[(it, name, a)] for a in m.after]
        opt = plan[name]
        endpoints = ranks + offset[opt.path]  # the motif's path's own devices
        cid = _emit_motif(w, f"{name}#{j}", m, step, opt, endpoints, deps, it)
        motif_ids[(it, name, j)] = cid
        ends.setdefault((it, name), []).append(cid)
    w.info.update(
        iteration_end=[
            w.join([i for (it2, _), ids in ends.items() if it2 == it for i in ids])
            for it in range(dag.iterations)
        ]
    )
    return topo, w


def _path_fabrics(
    topo: Any, n: int, paths: Sequence[str], path_bandwidth: Mapping[str, float] | None
) -> tuple[list[str], dict[str, int]]:
    """The devices the motifs run on: the first path is the topology's first ``n`` GPUs, every later one a fabric of
    its own (a switch and a NIC per rank at ``path_bandwidth[path]``). Returns the device list and each path's offset
    into it."""
    from flowlane.sim import SimSpecError

    devices = list(topo.gpus[:n])
    offset = {paths[0]: 0}
    for p in paths[1:]:
        bw = (path_bandwidth or {}).get(p)
        if bw is None or not bw > 0:
            raise SimSpecError(
                f"path {p!r} needs its per-endpoint bandwidth (bytes/s) in path_bandwidth to get a fabric of "
                f"its own; got {path_bandwidth!r}"
            )
        offset[p] = len(devices)
        topo.add_device(f"{p}-sw", "switch")
        for r in range(n):
            topo.add_device(f"{p}-nic{r}", "host", server=r)
            topo.add_link(f"{p}-nic{r}", f"{p}-sw", float(bw), 1e-6, kind="nic")
            devices.append(f"{p}-nic{r}")
    return devices, offset


def _emit_motif(
    w: Any, label: str, m: Any, step: Comm, opt: Option, endpoints: np.ndarray, deps: list[int], it: int
) -> int:
    """One motif as the simulator's collective of its kind on its path's endpoints; a reduce-scatter or all-gather
    motif of an all-reduce is that half of it, an all-gather of its own an all-to-all of its destinations."""
    from flowlane.sim import SimSpecError
    from flowlane.sim import collectives as C

    n = len(endpoints)
    ctype = "dp" if step.op.kind in ("all_reduce", "reduce_scatter") else "ep"
    meta = CoflowMeta(ctype, iteration=it)
    if m.kind == "all_reduce":
        algo = "tree" if opt.algo == "tree" else "ring"
        return C.all_reduce(w, endpoints, float(m.nbytes), meta, deps, algo=algo, stream=opt.path, name=label)
    if m.kind == "reduce_scatter" and step.op.kind == "all_reduce":
        return C.reduce_scatter(w, endpoints, float(m.nbytes), meta, deps, stream=opt.path, name=label)
    if m.kind == "all_gather" and step.op.kind == "all_reduce":
        return C.all_gather(w, endpoints, float(m.nbytes), meta, deps, stream=opt.path, name=label)
    if m.kind in ("all_to_all", "all_gather"):
        ranks = np.arange(n)
        mat = np.zeros((n, n))
        for t in m.dests:
            if t % n:
                mat[ranks, (ranks + t) % n] = m.nbytes
        return C.all_to_all(w, endpoints, mat, meta, deps, stream=opt.path, name=label)
    raise SimSpecError(f"{step.name}: motif kind {m.kind!r} has no flow-level model here")


def simulate(
    dag: TrainingDAG,
    plan: Mapping[str, Option],
    schedule: Schedule,
    cost: CostModel,
    bandwidth_gbps: float = 100.0,
) -> float:
    """The steady-state iteration time the flow-level engine gives ``plan`` in ``schedule``'s order (seconds)."""
    from flowlane.policies import make_policy
    from flowlane.sim import SimConfig, Simulator

    names = sorted(cost.paths)
    bw = {p: 1.0 / cost.path(p).beta for p in names}
    topo, w = to_workload(dag, plan, schedule, bandwidth_gbps, path_bandwidth=bw, path_order=names)
    res = Simulator(topo, SimConfig(launch_overhead=cost.path(names[0]).delta)).run(w, make_policy("fifo"))  # type: ignore[arg-type]
    return res.iteration_time
