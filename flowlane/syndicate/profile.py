"""From a recorded FIFO iteration to a plan: the profile, its training DAG, a fitted cost model and the search.

Seed 004 §5.1 (interface A) has the optimizer take a profiled iteration (the comm-ops as submitted, the compute
between them) and return an execution plan and order; §5.2's enforcer runs it. The enforcer records one steady FIFO
iteration as a *profile* (``flowlane.syndicate.profile/1``, written beside a recipe run as
``syndicate_profile.json``)::

    {"format": "flowlane.syndicate.profile/1", "iteration": 5, "iteration_s": 0.84, "ranks": [0, 1],
     "ops": [{"kind": "all_reduce", "numel": 1048576, "dtype": "float32", "ranks": [0, 1],
              "submit_s": 0.31, "done_s": 0.35}, ...],
     "provenance": {...}}

``ops`` are in submission order; ``submit_s`` is when an op was submitted and ``done_s`` when its ``wait()``
returned (an upper bound on its completion; ``null`` if not observed), both in seconds since the iteration began.
``provenance`` may be left out (``flowlane.syndicate.enforcer.Enforcer.profile()`` returns the rest).

* :func:`load_profile` checks the format, naming the field and what is allowed.
* :func:`dag_from_profile` builds the iteration in program order (seed 004 §5.1's DAG; digest §2.4.4): the time
  between two submissions is compute, each comm-op follows the compute before it, and a tail (the last submission to
  the iteration's end: the rest of the backward, the optimizer step) follows every comm-op. A wait that returned
  before a later submission is a *submission-precedence* edge (digest §5 item 9): the compute after it depends on
  that op, so no order can hold the op behind one submitted later (the enforcer would fall back to FIFO there; on
  DeepSpeed, which waits for each bucket, it is what keeps a plan's ops in submission order). The program is assumed
  to have waited at once: the time from a gap's start to the last wait returning in it is the wait, not compute.
* :func:`fit_cost` fits one path's alpha-beta-delta (digest §5 item 6, :func:`~flowlane.syndicate.cost.fit_path_cost`)
  from the ops the profile saw *alone* (no other op submitted or in flight between its submission and its wait), or
  takes the link's figures from the user when those samples cannot pin it down.
* :func:`plan_from_profile` runs :func:`~flowlane.syndicate.search.mcmc_search` and returns the plan with a report:
  optSched's prediction for the recorded FIFO policy and for the plan, beside the measured iteration. The plan's
  order is the one optSched generated under the list-scheduling rule the search chose (``SearchResult.pick``, which
  the command prints; :mod:`flowlane.syndicate.search`).

Paths: the plugins (``megatron_plugin.syndicate``, ``deepspeed_plugin.syndicate``) make one clone of the
data-parallel group per path name a plan uses, so the planner offers ``paths`` clones named ``clone0``,
``clone1``, ... (default one: the plugins' FIFO mode runs on a single group). A clone is modelled as a path of its own
at the link's figures; clones of one group share its links unless the backend spreads them, so with ``paths > 1`` a
predicted gain from overlap is an upper bound. Options are the ones the enforcer runs
(:data:`flowlane.syndicate.enforcer.RUNNABLE_ALGOS`: ring for all-reduce and reduce-scatter, direct for all-to-all
and all-gather), cut into 1, 2 or 4 segments and (all-to-all, all-gather) splines.

``flowlane syndicate-plan PROFILE`` (:func:`add_parser`, :func:`run`) writes the plan JSON that
``--syndicate-plan``, ``dp_collective.plan`` and DeepSpeed's ``"syndicate": {"plan": ...}`` take. Pure Python (numpy
for the fit); no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flowlane.syndicate.cost import CostModel, Option, PathCost, fit_path_cost, option_space
from flowlane.syndicate.motif import CommOp, MotifError
from flowlane.syndicate.optsched import Comm, Compute, OrderError, TrainingDAG, opt_sched
from flowlane.syndicate.plan import PlanError, SyndicatePlan, element_size
from flowlane.syndicate.replan import plan_from_search, unrolled_order
from flowlane.syndicate.search import SearchConfig, SearchResult, mcmc_search

FORMAT = "flowlane.syndicate.profile/1"
#: The kinds the enforcer runs (``flowlane.syndicate.enforcer._KINDS``; pinned by tests/test_syndicate_profile.py).
KINDS: tuple[str, ...] = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")
#: Per kind, the algorithm the enforcer runs it with (:data:`flowlane.syndicate.enforcer.RUNNABLE_ALGOS`): the
#: backend's own collective on each segment (ring) or one message per destination (direct, which splines).
ALGO_OF: dict[str, str] = {
    "all_reduce": "ring",
    "reduce_scatter": "ring",
    "all_to_all": "direct",
    "all_gather": "direct",
}
SEGMENTS: tuple[int, ...] = (1, 2, 4)
SPLINES: tuple[int, ...] = (1, 2, 4)
_TOP = ("format", "iteration", "iteration_s", "ranks", "ops", "provenance")
_OP = ("kind", "numel", "dtype", "ranks", "submit_s", "done_s")
PREDICTED = "predicted (optSched on the fitted cost model)"
PREDICTED_GIVEN = "predicted (optSched on the cost model of the given link figures)"


class ProfileError(ValueError):
    """A profile breaks the format, or cannot give what was asked of it; the message names the field and what is
    allowed (or which figures to give)."""


@dataclass(frozen=True)
class ProfileOp:
    """One comm-op as recorded: its signature (the plan op's), its group's ranks, and its times."""

    kind: str
    numel: int
    dtype: str
    ranks: tuple[int, ...]
    submit_s: float
    done_s: float | None

    def comm_op(self, name: str) -> CommOp:
        es = element_size(self.dtype)
        return CommOp(name, self.kind, self.numel * es, len(self.ranks), align=es)


@dataclass(frozen=True)
class Profile:
    """A validated profile (:func:`load_profile`)."""

    iteration: int
    iteration_s: float
    ranks: tuple[int, ...]
    ops: tuple[ProfileOp, ...]
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def op_name(i: int) -> str:
        return f"op{i}"


def _number(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ProfileError(f"{where} must be a finite number of seconds, got {v!r}")
    if v < 0:
        raise ProfileError(f"{where} must be >= 0 (seconds since the iteration began), got {v!r}")
    return float(v)


def _ranks(v: object, where: str) -> tuple[int, ...]:
    if (
        not isinstance(v, list)
        or not v
        or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in v)
        or len(set(v)) != len(v)
    ):
        raise ProfileError(f"{where} must be a non-empty list of distinct ranks (integers >= 0), got {v!r}")
    return tuple(v)


def _keys(d: object, allowed: tuple[str, ...], where: str, optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be an object with keys {list(allowed)}, got {type(d).__name__}")
    unknown = sorted(set(d) - set(allowed))
    missing = [k for k in allowed if k not in d and k not in optional]
    if unknown or missing:
        raise ProfileError(
            f"{where}: "
            + "; ".join(
                ([f"unknown keys {unknown}"] if unknown else [])
                + ([f"missing keys {missing}"] if missing else [])
            )
            + f" ({FORMAT} has {list(allowed)})"
        )
    return d


def load_profile(source: str | os.PathLike | Mapping[str, Any] | Profile) -> Profile:
    """The profile at ``source`` (a JSON file's path, or the parsed dict), checked against :data:`FORMAT`; a
    :class:`ProfileError` names the field at fault and what is allowed."""
    if isinstance(source, Profile):
        return source
    if isinstance(source, str | os.PathLike):
        p = Path(source)
        try:
            text = p.read_text()
        except OSError as e:
            raise ProfileError(f"cannot read the profile {str(p)!r}: {e.strerror or e}") from None
        try:
            d: object = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{str(p)!r} is not JSON ({e}); expected a {FORMAT} profile") from None
    else:
        d = dict(source)
    # provenance: the recipe adds it to the file; Enforcer.profile()'s own dict has none
    d = _keys(d, _TOP, "profile", optional=("provenance",))
    d.setdefault("provenance", {})
    if d["format"] != FORMAT:
        raise ProfileError(f"profile format {d['format']!r} is not {FORMAT!r}")
    it = d["iteration"]
    if isinstance(it, bool) or not isinstance(it, int) or it < 0:
        raise ProfileError(f"profile iteration must be an integer >= 0, got {it!r}")
    iteration_s = _number(d["iteration_s"], "profile iteration_s")
    if iteration_s <= 0:
        raise ProfileError(
            f"profile iteration_s must be > 0 (the iteration's length), got {d['iteration_s']!r}"
        )
    ranks = _ranks(d["ranks"], "profile ranks")
    if not isinstance(d["provenance"], dict):
        raise ProfileError(f"profile provenance must be an object, got {type(d['provenance']).__name__}")
    if not isinstance(d["ops"], list) or not d["ops"]:
        raise ProfileError(
            f"profile ops must be a non-empty list of comm-ops (nothing to plan), got {d['ops']!r}"[:200]
        )
    ops: list[ProfileOp] = []
    for i, o in enumerate(d["ops"]):
        w = f"ops[{i}]"
        o = _keys(o, _OP, w)
        if o["kind"] not in KINDS:
            raise ProfileError(
                f"{w}.kind {o['kind']!r} is not one of {list(KINDS)} (the kinds the enforcer runs)"
            )
        numel = o["numel"]
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ProfileError(f"{w}.numel must be an integer >= 1, got {numel!r}")
        try:
            element_size(o["dtype"])
        except PlanError as e:  # "dtype 'x' is not one of [...]"
            raise ProfileError(f"{w}.{e}") from None
        op_ranks = _ranks(o["ranks"], f"{w}.ranks")
        submit = _number(o["submit_s"], f"{w}.submit_s")
        done = None if o["done_s"] is None else _number(o["done_s"], f"{w}.done_s")
        if submit > iteration_s:
            raise ProfileError(
                f"{w}.submit_s={submit!r} is after the iteration's end, iteration_s={iteration_s!r}"
            )
        if done is not None and done < submit:
            raise ProfileError(
                f"{w}.done_s={done!r} is before its submit_s={submit!r} (a wait returns after it)"
            )
        if done is not None and done > iteration_s:
            raise ProfileError(
                f"{w}.done_s={done!r} is after the iteration's end, iteration_s={iteration_s!r}: a wait that returns "
                "in the next iteration does not belong to this one"
            )
        if ops and submit < ops[-1].submit_s:
            raise ProfileError(
                f"{w}.submit_s={submit!r} is before ops[{i - 1}].submit_s={ops[-1].submit_s!r}: ops must be in "
                "submission order"
            )
        if ops and op_ranks != ops[0].ranks:
            raise ProfileError(
                f"{w}.ranks {list(op_ranks)} differ from ops[0].ranks {list(ops[0].ranks)}: a plan covers one group's "
                "ops (one enforcer); record each group's profile apart"
            )
        op = ProfileOp(o["kind"], numel, o["dtype"], op_ranks, submit, done)
        try:
            op.comm_op(Profile.op_name(i))
        except MotifError as e:
            raise ProfileError(f"{w}: {e}") from None
        ops.append(op)
    return Profile(it, iteration_s, ranks, tuple(ops), d["provenance"])


def path_names(paths: int | Sequence[str]) -> tuple[str, ...]:
    """``paths`` clones of the group, as the plugins make them (one per plan path name): ``clone0``, ``clone1``..."""
    if isinstance(paths, int):
        if isinstance(paths, bool) or paths < 1:
            raise ProfileError(f"paths must be an integer >= 1, got {paths!r}")
        return tuple(f"clone{k}" for k in range(paths))
    names = tuple(paths)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ProfileError(f"paths must be distinct non-empty names, got {list(names)!r}")
    return names


def runnable_options(op: CommOp, cost: CostModel) -> tuple[Option, ...]:
    """``op``'s options the enforcer can run, the first being the recorded run's (whole, on the first path)."""
    return option_space(op, cost, algos=(ALGO_OF[op.kind],), segments=SEGMENTS, splines=SPLINES)


def dag_from_profile(
    profile: Profile | Mapping[str, Any] | str | os.PathLike,
    options_per_op: Callable[[CommOp], Sequence[Option]],
    iterations: int = 2,
) -> TrainingDAG:
    """The recorded iteration as a :class:`~flowlane.syndicate.optsched.TrainingDAG` in program order, unrolled
    ``iterations`` times (seed 004 §5.1: two). Steps: ``compute0`` (the iteration's start to the first submission),
    ``op0``, ``compute1`` (the gap to the next submission), ``op1``, ..., ``tail`` (the last submission to the
    iteration's end), with ``options_per_op(op)`` as each comm-op's option space (first: the recorded run's).
    ``op<k>`` depends on ``compute<k>``; a gap in which the waits of ops ``W`` returned depends on ``W`` and counts
    as compute only from the last of those returns (the program is assumed to have waited at once: digest §5 item
    9); the tail depends on every op; the next iteration's ``compute0`` follows the previous ``tail``."""
    prof = load_profile(profile)
    n = len(prof.ops)
    starts = [0.0] + [o.submit_s for o in prof.ops]  # gap k runs [starts[k], ends[k]); gap n is the tail
    ends = [o.submit_s for o in prof.ops] + [prof.iteration_s]
    waits: list[list[int]] = [[] for _ in range(n + 1)]
    for i, o in enumerate(prof.ops):
        if o.done_s is not None:
            # the first gap after op i that ends at or after the wait returned (ties: the earlier gap, the stricter)
            g = next((k for k in range(i + 1, n) if o.done_s <= ends[k]), n)
            waits[g].append(i)
    steps: list[Compute | Comm] = []
    for k in range(n + 1):
        start = max([starts[k], *(prof.ops[i].done_s or 0.0 for i in waits[k])])
        seconds = max(ends[k] - start, 0.0)
        if k == n:
            steps.append(Compute("tail", seconds, tuple(Profile.op_name(i) for i in range(n))))
            break
        steps.append(Compute(f"compute{k}", seconds, tuple(Profile.op_name(i) for i in waits[k])))
        op = prof.ops[k].comm_op(Profile.op_name(k))
        steps.append(Comm(op, (f"compute{k}",), tuple(options_per_op(op))))
    return TrainingDAG(
        f"profile iteration {prof.iteration}", steps, carry=[("tail", "compute0")], iterations=iterations
    )


def _steps_wire(op: CommOp, option: Option) -> tuple[float, float]:
    """One motif's message steps and wire bytes under the cost model's own formulas (probed with unit costs)."""
    m = option.motifs(op)[0]
    probe = replace(option, path="probe")
    steps = CostModel({"probe": PathCost(1.0, 0.0)}).motif_time(op, m, probe)
    wire = CostModel({"probe": PathCost(0.0, 1.0)}).motif_time(op, m, probe)
    return steps, wire


def alone_samples(
    profile: Profile | Mapping[str, Any] | str | os.PathLike,
) -> list[tuple[int, int, float, float]]:
    """``(op index, steps, wire bytes, seconds)`` of the ops observed alone: ``done_s`` recorded, and no other op
    submitted or still waited for between its submission and its wait's return (so ``done_s - submit_s`` is its
    own duration plus any lag before the wait: an upper bound, with no queueing behind another op)."""
    prof = load_profile(profile)
    out = []
    for i, o in enumerate(prof.ops):
        if o.done_s is None or len(o.ranks) < 2:
            continue
        lo, hi = o.submit_s, o.done_s
        crowded = any(
            j != i and q.submit_s < hi and (q.done_s if q.done_s is not None else math.inf) > lo
            for j, q in enumerate(prof.ops)
        )
        if crowded:
            continue
        op = o.comm_op(Profile.op_name(i))
        steps, wire = _steps_wire(op, Option("probe", ALGO_OF[o.kind]))
        out.append((i, int(steps), wire, hi - lo))
    return out


def fit_cost(
    profile: Profile | Mapping[str, Any] | str | os.PathLike,
    paths: int | Sequence[str] = 1,
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
) -> CostModel:
    """A :class:`~flowlane.syndicate.cost.CostModel` with ``paths`` (a count: the group's clones ``clone0``...; or
    names), every path at one :class:`~flowlane.syndicate.cost.PathCost`. With ``bandwidth_gbps`` and
    ``latency_us`` (the link's figures: Gbit/s, and microseconds per message step) that is ``alpha = latency``,
    ``beta = 8 / bandwidth``, no per-motif delta. Without them it is fitted (digest §5 item 6) from
    :func:`alone_samples`: at least two, of two sizes, with a positive beta; else :class:`ProfileError` says so and
    asks for the figures."""
    prof = load_profile(profile)
    names = path_names(paths)
    if (bandwidth_gbps is None) != (latency_us is None):
        raise ProfileError(
            "give both the link's figures, --bandwidth-gbps and --latency-us (bandwidth_gbps, latency_us), or "
            "neither (fit them from the profile)"
        )
    if bandwidth_gbps is not None and latency_us is not None:
        if not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
            raise ProfileError(f"--bandwidth-gbps must be a finite number > 0, got {bandwidth_gbps!r}")
        if not (math.isfinite(latency_us) and latency_us >= 0):
            raise ProfileError(f"--latency-us must be a finite number >= 0, got {latency_us!r}")
        pc = PathCost(latency_us * 1e-6, 8.0 / (bandwidth_gbps * 1e9))
        return CostModel({n: pc for n in names})
    samples = alone_samples(prof)
    observed = sum(o.done_s is not None for o in prof.ops)
    ask = "Give the link's figures instead: --bandwidth-gbps X --latency-us Y"
    if len(samples) < 2 or len({w for _, _, w, _ in samples}) < 2:
        raise ProfileError(
            f"cannot fit the link from this profile: {len(prof.ops)} ops, {observed} with done_s recorded, "
            f"{len(samples)} observed alone (no other op submitted or in flight before its wait returned), "
            f"of {len({w for _, _, w, _ in samples})} size(s); the fit needs two of different sizes. {ask}"
        )
    pc = fit_path_cost([(1, s, w, t) for _, s, w, t in samples])
    if pc.beta <= 0:
        raise ProfileError(
            f"the fit over {len(samples)} ops observed alone gives no positive beta (time does not grow with "
            f"bytes: lag before the waits, or sizes too alike). {ask}"
        )
    return CostModel({n: pc for n in names})


@dataclass
class PlanReport:
    """What :func:`plan_from_profile` found. Times are seconds per iteration."""

    fifo_predicted_s: float
    """optSched's time for the recorded policy: every op whole, first path, submission order."""
    plan_predicted_s: float
    """optSched replaying the plan's launch order in both unrolled iterations (what the enforcer runs)."""
    measured_iteration_s: float
    """The profile's own iteration_s (the FIFO run, measured)."""
    label: str
    """How the predictions were made: ``predicted (optSched on the fitted cost model)`` (or the given figures)."""
    ops: int
    motifs: int
    ops_cut: int
    """Ops the plan runs as more than one motif."""
    paths: tuple[str, ...]
    path_cost: PathCost
    kept_fifo: bool
    """The search found nothing better than FIFO: the plan is FIFO's (every op whole, submission order)."""
    search: SearchResult

    def rows(self) -> list[tuple[str, str]]:
        return [
            (f"FIFO iteration, {self.label}", f"{self.fifo_predicted_s * 1e3:.3f} ms"),
            (f"plan iteration, {self.label}", f"{self.plan_predicted_s * 1e3:.3f} ms"),
            ("FIFO iteration, measured (the profile)", f"{self.measured_iteration_s * 1e3:.3f} ms"),
            ("motifs per iteration", str(self.motifs)),
            ("ops cut into motifs", f"{self.ops_cut} of {self.ops}"),
        ]


def plan_from_profile(
    profile: Profile | Mapping[str, Any] | str | os.PathLike,
    cost: CostModel,
    search_config: SearchConfig | None = None,
    label: str = PREDICTED,
) -> tuple[SyndicatePlan, PlanReport]:
    """The joint search (seed 004 §5.1: MCMC over options and order, scored by optSched) on the profile's DAG under
    ``cost``, as a :class:`~flowlane.syndicate.plan.SyndicatePlan` whose ops are the profile's signatures in
    submission order, with a :class:`PlanReport`. When the plan's order, replayed, is not faster than FIFO the plan is
    FIFO's own, so its prediction never exceeds FIFO's."""
    prof = load_profile(profile)
    dag = dag_from_profile(prof, lambda op: runnable_options(op, cost))
    dtypes = {Profile.op_name(i): o.dtype for i, o in enumerate(prof.ops)}
    fifo_plan = dag.default_plan()
    fifo = opt_sched(dag, fifo_plan, cost, order="fifo")
    result = mcmc_search(dag, cost, search_config or SearchConfig())
    plan = plan_from_search(dag, result, dtypes, version=1)
    try:
        replayed = opt_sched(dag, result.plan, cost, order=unrolled_order(dag, plan)).per_iteration
    except OrderError:  # cannot happen: each iteration's order respects its own DAG; keep FIFO if it did
        replayed = math.inf
    kept_fifo = not replayed < fifo.per_iteration
    if kept_fifo:
        fifo_result = SearchResult(fifo_plan, {}, fifo.per_iteration, fifo, fifo.per_iteration)
        plan = plan_from_search(dag, fifo_result, dtypes, version=1)
        replayed = fifo.per_iteration
    motifs = [len(plan.motifs(i)) for i in range(len(plan.ops))]
    first = next(iter(cost.paths.values()))
    report = PlanReport(
        fifo.per_iteration,
        replayed,
        prof.iteration_s,
        label,
        len(plan.ops),
        sum(motifs),
        sum(m > 1 for m in motifs),
        tuple(cost.paths),
        first,
        kept_fifo,
        result,
    )
    return plan, report


def write_plan(plan: SyndicatePlan, out: str | os.PathLike) -> Path:
    """Write ``plan.to_json()`` to ``out`` through a temporary file beside it: nothing half-written."""
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(plan.to_json())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def default_out(profile: str | os.PathLike) -> Path:
    """The plan's file beside ``profile``: its name with ``profile`` replaced by ``plan``, so the recipe's
    ``syndicate_profile.json``, ``syndicate_profile_stage1.json`` and ``..._expert.json`` give
    ``syndicate_plan.json``, ``syndicate_plan_stage1.json`` (the ``{pp_rank}`` plan path) and ``..._expert.json``."""
    p = Path(profile)
    stem = p.stem.replace("profile", "plan", 1) if "profile" in p.stem else f"{p.stem}_plan"
    return p.with_name(f"{stem}.json")


# -- flowlane syndicate-plan ------------------------------------------------------------------------------------------
def _positive(kind: type, low: float, open_low: bool) -> Callable[[str], Any]:
    what = "an integer" if kind is int else "a finite number"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v < low or (open_low and v == low):
            raise argparse.ArgumentTypeError(
                f"must be {what} {'>' if open_low else '>='} {low:g}, got {text!r}"
            )
        return v

    return parse


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


DESCRIPTION = """\
Turn a recorded FIFO iteration (syndicate_profile.json) into a SYNDICATE plan JSON for --syndicate-plan,
dp_collective.plan or DeepSpeed's "syndicate": {"plan": ...}. The DAG is the iteration in program order (compute
between submissions, a wait that returned before a later submission orders it, the tail after every op); the cost
model is fitted from the ops observed alone (done_s - submit_s against bytes), or built from --bandwidth-gbps and
--latency-us; the search is SYNDICATE's MCMC scored by optSched. All iteration times it prints except the measured one
are predictions."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "syndicate-plan",
        help="a SYNDICATE plan JSON from a recorded FIFO iteration (syndicate_profile.json)",
        description=DESCRIPTION,
        formatter_class=_HelpWithDefaults,
    )
    p.add_argument("profile", metavar="PROFILE", help="the profile JSON (flowlane.syndicate.profile/1)")
    p.add_argument(
        "--out",
        default=None,
        metavar="PLAN",
        help="where to write the plan JSON (default: beside PROFILE, 'profile' in its name replaced by 'plan': "
        "syndicate_profile_stage1.json -> syndicate_plan_stage1.json)",
    )
    p.add_argument(
        "--paths",
        type=_positive(int, 1, False),
        default=1,
        metavar="N",
        help="clones of the group to plan over (clone0, clone1, ...; the plugins make one per name the plan uses); "
        "each is modelled as a lane of its own, so with more than 1 an overlap gain is an upper bound",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=_positive(float, 0, True),
        default=None,
        metavar="X",
        help="the link's bandwidth in Gbit/s (with --latency-us: used instead of a fit from the profile; "
        "default: fitted)",
    )
    p.add_argument(
        "--latency-us",
        type=_positive(float, 0, False),
        default=None,
        metavar="Y",
        help="the link's latency per message step in microseconds (with --bandwidth-gbps; default: fitted)",
    )
    p.add_argument(
        "--budget-s",
        type=_positive(float, 0, True),
        default=10.0,
        metavar="S",
        help="the search's wall-clock budget",
    )
    p.add_argument(
        "--max-iters",
        type=_positive(int, 0, False),
        default=None,
        metavar="M",
        help="stop the search after this many proposals (with --seed: a repeatable plan; default: no limit)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="K", help="the search's seed")
    return p


def run(args: argparse.Namespace) -> int:
    """``flowlane syndicate-plan``: load and check the profile, build the cost model, search, write the plan
    atomically, print the comparison. Bad input: one line, exit 2 (``SystemExit`` with the message)."""
    out = Path(args.out) if args.out else default_out(args.profile)
    if out.is_dir():  # before the search: its result must have somewhere to go
        raise SystemExit(f"syndicate-plan: --out {str(out)!r} is a folder; give the plan file's path")
    try:
        prof = load_profile(args.profile)
        cost = fit_cost(prof, args.paths, args.bandwidth_gbps, args.latency_us)
        label = PREDICTED if args.bandwidth_gbps is None else PREDICTED_GIVEN
        cfg = SearchConfig(seed=args.seed, time_budget_s=args.budget_s, max_iters=args.max_iters)
        plan, report = plan_from_profile(prof, cost, cfg, label)
        SyndicatePlan.from_json(plan.to_json())  # what the plugins' loaders run
    except (ProfileError, PlanError, MotifError) as e:
        raise SystemExit(f"syndicate-plan: {e}") from None
    try:
        write_plan(plan, out)
    except OSError as e:
        raise SystemExit(f"syndicate-plan: --out {str(out)!r} is not writable ({e.strerror or e})") from None
    from rich.console import Console
    from rich.table import Table

    pc = report.path_cost
    table = Table(title=f"SYNDICATE plan: {Path(args.profile).name}, iteration {prof.iteration}")
    table.add_column("")
    table.add_column("value", justify="right")
    for k, v in report.rows():
        table.add_row(k, v)
    con = Console()
    con.print(table)
    source = "fitted from the ops observed alone" if label == PREDICTED else "given"
    con.print(
        f"link ({source}): alpha {pc.alpha * 1e6:.2f} us/step, {8 / pc.beta / 1e9 if pc.beta else math.inf:.3g} "
        f"Gbit/s, delta {pc.delta * 1e6:.2f} us/motif; paths {', '.join(report.paths)}; search: "
        f"{report.search.iters} proposals, stopped by {report.search.stopped_by}"
        + (
            "; nothing beat FIFO, the plan is FIFO's"
            if report.kept_fifo
            else f"; order from optSched's {report.search.pick!r} rule"
        ),
        highlight=False,
        soft_wrap=True,
    )
    con.print(f"wrote {out}", highlight=False, soft_wrap=True)
    return 0


__all__ = [
    "FORMAT",
    "KINDS",
    "PREDICTED",
    "PlanReport",
    "Profile",
    "ProfileError",
    "ProfileOp",
    "alone_samples",
    "dag_from_profile",
    "default_out",
    "fit_cost",
    "load_profile",
    "path_names",
    "plan_from_profile",
    "runnable_options",
    "write_plan",
]
