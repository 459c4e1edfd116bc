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

The engine has one fabric, so a plan whose motifs use more than one path is refused. A path is an interconnect the
fabric does not have. The per-motif overhead ``delta`` is charged as the engine's ``launch_overhead``.
"""

from __future__ import annotations

from collections.abc import Mapping

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
) -> tuple[object, object]:
    """``(topology, workload)`` for ``flowlane.sim.Simulator``: ``dag`` under ``plan``, motifs in ``schedule``'s
    launch order. Every comm-op must span the same ``ranks`` (the GPUs simulated)."""
    from flowlane.sim import SimSpecError, Workload
    from flowlane.sim import collectives as C
    from flowlane.sim.workloads import cluster

    paths = sorted({plan[c.name].path for c in dag.comms})
    if len(paths) != 1:
        raise SimSpecError(
            f"the flow-level simulator has one fabric; this plan uses paths {paths} (evaluate "
            f"multi-path plans with opt_sched)"
        )
    sizes = {c.op.ranks for c in dag.comms}
    if len(sizes) != 1:
        raise SimSpecError(
            f"every comm-op must span the same ranks to map onto GPUs, got group sizes {sorted(sizes)}"
        )
    n = sizes.pop()
    topo = topology or cluster(n, bandwidth_gbps)
    w = Workload(topo.gpus[:n], name=f"{dag.name}@{n}")  # type: ignore[attr-defined]
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
        opt = plan[name]
        deps = [d for p, pit in zip(pred_names, pred_its, strict=True) for d in ends[(pit, p)]]
        deps += [motif_ids[(it, name, a)] for a in m.after]
        ctype = "dp" if step.op.kind in ("all_reduce", "reduce_scatter") else "ep"
        meta = CoflowMeta(ctype, iteration=it)
        label = f"{name}#{j}"
        if m.kind == "all_reduce":
            cid = C.all_reduce(
                w,
                ranks,
                float(m.nbytes),
                meta,
                deps,
                algo="tree" if opt.algo == "tree" else "ring",
                stream=opt.path,
                name=label,
            )
        elif m.kind == "reduce_scatter" and step.op.kind == "all_reduce":
            cid = C.reduce_scatter(w, ranks, float(m.nbytes), meta, deps, stream=opt.path, name=label)
        elif m.kind == "all_gather" and step.op.kind == "all_reduce":
            cid = C.all_gather(w, ranks, float(m.nbytes), meta, deps, stream=opt.path, name=label)
        elif m.kind in ("all_to_all", "all_gather"):
            mat = np.zeros((n, n))
            for t in m.dests:
                if t % n:
                    mat[ranks, (ranks + t) % n] = m.nbytes
            cid = C.all_to_all(w, ranks, mat, meta, deps, stream=opt.path, name=label)
        else:
            raise SimSpecError(f"{name}: motif kind {m.kind!r} has no flow-level model here")
        motif_ids[(it, name, j)] = cid
        ends.setdefault((it, name), []).append(cid)
    w.info.update(
        iteration_end=[
            w.join([i for (it2, _), ids in ends.items() if it2 == it for i in ids])
            for it in range(dag.iterations)
        ]
    )
    return topo, w


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

    topo, w = to_workload(dag, plan, schedule, bandwidth_gbps)
    path = next(iter({plan[c.name].path for c in dag.comms}))
    res = Simulator(topo, SimConfig(launch_overhead=cost.path(path).delta)).run(w, make_policy("fifo"))  # type: ignore[arg-type]
    return res.iteration_time
