"""Runtime Hermod scheduler on 4 gloo ranks (pipeline x data x expert, synthetic 1F1B iteration): scheduling never
changes the math, deferred traffic goes out in priority order with identical decisions on every rank, and injected
delays do not deadlock."""

from dataclasses import asdict

from flowlane.hermod.order import CoflowKey, HermodOrder, HermodOrderConfig
from flowlane.launch import launch
from flowlane.testing.workload import WorkloadConfig, run_rank

BASE = dict(
    pp=2, layers_per_stage=2, microbatches=3, iterations=2, act_elems=1024, param_elems=4096, moe=True
)
RUNS = {
    "fifo": dict(sched={"mode": "fifo"}),
    "hermod": dict(sched={"mode": "hermod", "chunk_bytes": 4096}),
    "fifo1": dict(sched={"mode": "fifo"}, iterations=1, moe=False),
    "delayed": dict(
        sched={"mode": "hermod", "chunk_bytes": 2048, "gate_timeout_s": 0.01},
        iterations=1,
        moe=False,
        delay_s=0.01,
    ),
    # EP all-to-alls on their wire class's clone (3 clones on loopback), with injected delays
    "hermod_ep": dict(
        sched={"mode": "hermod", "chunk_bytes": 4096},
        ep_wire_classes=True,
        gloo_class_ifnames=["lo", "lo", "lo"],
        delay_s=0.003,
    ),
    # the thesis' baselines (seed 000 §5.5.1): Megatron-LM's defaults (no DP overlap) and Lina (EP before DP, DP
    # chunked in issue order)
    "megatron": dict(sched={"mode": "fifo"}, overlap_dp=False),
    "lina": dict(sched={"mode": "hermod", "chunk_bytes": 4096, "gate_ctypes": ["ep"]}, order="fifo"),
    # ep_algorithm=auto in the workload: one stage, so the four ranks form one EP group (matching runs); six
    # iterations = warm-up, four probe iterations, one with the choice
    "fifo_ep4": dict(sched={"mode": "fifo"}, pp=1, iterations=6, ep_algorithm="plain"),
    "auto_ep4": dict(sched={"mode": "fifo"}, pp=1, iterations=6, ep_algorithm="auto"),
}


def _all_runs(rank: int, world: int) -> dict:
    """One launch for everything (spawning ranks is the expensive part on a shared 2-core machine)."""
    out = {"a2a": _a2a_rank(rank, world)}
    for name, kw in RUNS.items():
        out[name] = run_rank(rank, world, asdict(WorkloadConfig(**{**BASE, **kw})))
    return out


_RESULTS: list = []


def _results() -> list:
    if not _RESULTS:
        _RESULTS.extend(launch(_all_runs, 4, timeout=150))
    return _RESULTS


def test_hermod_and_fifo_give_identical_parameters_and_the_order_respects_priorities():
    fifo = [r["fifo"] for r in _results()]
    herm = [r["hermod"] for r in _results()]
    order = HermodOrder(HermodOrderConfig(BASE["microbatches"]))
    for f, h in zip(fifo, herm, strict=True):
        for pf, ph in zip(f["params"], h["params"], strict=True):
            assert pf == ph
        chunks = [e for e in h["log"] if e[0] == "chunk"]
        assert len(chunks) > len([e for e in f["log"] if e[0] == "chunk"])  # buckets were split
        # within every sealed window, chunks launch in Hermod priority order (chunk index breaks ties)
        by_window: dict[int, list] = {}
        for e in chunks:
            by_window.setdefault(e[7], []).append(e)
        for w, es in by_window.items():
            keys = [
                (order.sort_key(CoflowKey(it, mb, c, layer, op)), ch) for _, c, op, it, mb, layer, ch, _ in es
            ]
            assert keys == sorted(keys), (h["rank"], w, es)
        # Case III: Hermod takes all parameter gathers at once and sends the lowest layer first
        first_gather = next(e for e in chunks if e[2] == "all_gather")
        assert first_gather[5] == h["stage"] * BASE["layers_per_stage"]
        # FIFO = Megatron-core's forward pre-hooks: one layer ahead, in forward order; on the last stage the first
        # forward's pipeline receive comes between the first two gathers (issued lazily, not all at once)
        for it, es in _iterations(f["log"]).items():
            g = [i for i, e in enumerate(es) if e[2] == "all_gather"]
            assert [es[i][5] for i in g] == [h["stage"] * BASE["layers_per_stage"] + k for k in range(len(g))]
            if h["stage"] == 1:
                assert any(e[0] == "critical" for e in es[g[0] : g[1]]), (it, es[:6])
    # same decisions on every rank of a DP group: identical deferred launch sequences
    for stage in range(2):
        seqs = [[e[1:7] for e in r["log"] if e[0] == "chunk"] for r in herm if r["stage"] == stage]
        assert all(s == seqs[0] for s in seqs)


def test_all_to_alls_on_wire_class_clones_keep_the_math_and_agree_across_the_ep_group():
    """``ep_wire_classes``: an all-to-all of the oldest in-flight microbatch is critical (0), a later one's is
    pipeline (1). In 1F1B only the first stage's forwards of microbatches > 0 are pipeline (they run while an older
    microbatch awaits its backward); every backward and every last-stage all-to-all is critical. Every rank of an EP
    group makes the same choices; the parameters equal FIFO's."""
    res = _results()
    for r in res:
        for pf, ph in zip(r["fifo"]["params"], r["hermod_ep"]["params"], strict=True):
            assert pf == ph
        assert r["fifo"]["ep_classes"] == []
        got = r["hermod_ep"]["ep_classes"]
        assert len(got) == BASE["iterations"] * BASE["microbatches"] * BASE["layers_per_stage"] * 2
        for _, mb, layer, pass_, c in got:
            stage = r["hermod_ep"]["stage"]
            assert c == (1 if stage == 0 and mb > 0 and pass_ == "fwd" else 0), (stage, mb, layer, pass_)
    for stage in range(2):
        seqs = [r["hermod_ep"]["ep_classes"] for r in res if r["hermod_ep"]["stage"] == stage]
        assert seqs[0] and all(s == seqs[0] for s in seqs)


def test_auto_all_to_all_in_the_workload_probes_by_iteration_and_keeps_the_math():
    """The synthetic workload marks iteration ends for AllToAllRunner: iterations 1-4 run plain, BvN, plain, BvN
    (recorded as one all_to_all vs isend/irecv phases), the decision's all-reduce and broadcast end iteration 4,
    every rank reports the same choice and the parameters are bitwise those of the plain all-to-all."""
    res = _results()
    for r in res:
        a, f = r["auto_ep4"], r["fifo_ep4"]
        assert a["params"] == f["params"]
        ends = [*a["iter_starts"][1:], float("inf")]
        ep_ops = [
            {o[1] for o in a["ops"] if o[0] == "ep" and s <= o[3] < e and o[1] != "all_gather"}
            for s, e in zip(a["iter_starts"], ends, strict=True)
        ]
        assert ep_ops[1] == ep_ops[3] == {"all_to_all"} and ep_ops[2] == {"isend", "irecv"}, ep_ops
        # the decision ends iteration 4
        assert ep_ops[4] == {"isend", "irecv", "all_reduce", "broadcast"}, ep_ops
        assert ep_ops[5] == ({"all_to_all"} if a["ep_auto"]["choice"] == "plain" else {"isend", "irecv"}), (
            ep_ops
        )
    assert len({r["auto_ep4"]["ep_auto"]["choice"] for r in res}) == 1
    assert res[0]["fifo_ep4"]["ep_auto"] is None


def test_injected_delays_do_not_deadlock_and_do_not_change_results():
    for r in _results():
        for pa, pb in zip(r["fifo1"]["params"], r["delayed"]["params"], strict=True):
            assert pa == pb


def test_matched_all_to_all_equals_all_to_all_single_on_four_ranks():
    for r in _results():
        a = r["a2a"]
        assert a["equal_bvn"] and a["equal_bvn_bottleneck"] and a["equal_alg3"] and a["equal_bvn_barrier"], a
        assert a["equal_bvn_capped"], a
        assert a["phases_bvn"] <= a["phases_alg3_total"]
        assert a["bad_sync"].startswith("phase_sync 'global' is not one of"), a


def test_auto_all_to_all_probes_whole_iterations_keeps_the_faster_and_agrees_across_ranks():
    """ep_algorithm=auto (AllToAllRunner): iteration 0 warms up with BvN, iterations 1-4 alternate plain / BvN, then
    every rank keeps one; outputs equal all_to_all_single throughout. A rank made slow in one algorithm makes every
    rank keep the other (the decision sums all ranks' times), so the test fails if the comparison were inverted; with
    three candidates the one not slowed wins."""
    rs = _results()
    for r in rs:
        a = r["a2a"]["auto"]
        assert a["all_equal"], a
        assert a["used"][:5] == ["bvn", "plain", "bvn", "plain", "bvn"], a
        assert a["used"][5:] == [a["choice"]] * 2, a
        assert a["slow_plain"] == "bvn" and a["slow_bvn"] == "plain", a
        # 2 iterations x 2 all-to-alls x 50 ms (virtual)
        assert a["slow_bvn_seconds"]["bvn"] > a["slow_bvn_seconds"]["plain"] + 0.1, a
        assert a["fixed"] == ["alg3"] * 3, a  # a fixed algorithm never probes
        # three candidates: warm-up with the first matched one, then two cycles in the given order, then the choice
        assert a["three"] == ["bvn", "plain", "bvn", "alg3", "plain", "bvn", "alg3", "alg3"], a
        assert a["three_choice"] == "alg3" and list(a["three_seconds"]) == ["plain", "bvn", "alg3"], a
        if a["pair"] is not None:  # ranks 0 and 1: a group of two never matches, whatever auto probes
            assert a["pair"] == ["plain"] * 6, a
    assert sum(r["a2a"]["auto"]["pair"] is not None for r in rs) == 2
    assert len({r["a2a"]["auto"]["choice"] for r in rs}) == 1  # one decision on every rank
    assert len({tuple(sorted(r["a2a"]["auto"]["slow_bvn_seconds"].items())) for r in rs}) == 1
    assert len({tuple(r["a2a"]["auto"]["three_seconds"].values()) for r in rs}) == 1


def _auto_rank(rank: int, world: int, splits: list, x, ref, matrix) -> dict:
    import types

    import torch
    import torch.distributed as dist

    import flowlane.comm
    import flowlane.sched.alltoall as a2a
    from flowlane.sched.alltoall import AllToAllRunner

    recv = [matrix[i][rank] for i in range(world)]

    def iterations(runner: AllToAllRunner, n: int) -> tuple[list, bool]:
        """n iterations of two all-to-alls (a dispatch and its combine) each; the algorithm of each iteration."""
        used, ok = [], True
        for _ in range(n):
            y = torch.full((sum(recv), 3), -1.0)
            used.append(runner(y, x, recv, splits))
            back = torch.full_like(x, -1.0)
            assert runner(back, y, splits, recv) == used[-1]
            ok = ok and bool(torch.equal(y, ref)) and bool(torch.equal(back, x))
            runner.end_iteration()
        return used, ok

    # The runner's clock is virtual here: it advances only by the lags the wrappers below add, so what the decision
    # compares is exactly those lags and not how busy the host is (real gloo phases once cost more than a 0.4 s lag
    # on a loaded host and turned the three-candidate choice).
    clock = [0.0]
    real_time, a2a.time = a2a.time, types.SimpleNamespace(perf_counter=lambda: clock[0])
    runner = AllToAllRunner("auto", probe_iterations=2)
    used, ok = iterations(runner, 7)
    out = {"used": used, "all_equal": ok, "choice": runner.choice}

    # rank 1 lags in one algorithm only, as behind an incast-prone port
    def slowed(fn, delay_s: float = 0.05):
        def wrapper(*args, **kw):
            if rank == 1:
                clock[0] += delay_s
            return fn(*args, **kw)

        return wrapper

    for name, mod, attr in (
        ("slow_plain", flowlane.comm, "all_to_all_single"),
        ("slow_bvn", a2a, "matched_all_to_all"),
    ):
        orig = getattr(mod, attr)
        setattr(mod, attr, slowed(orig))
        try:
            runner = AllToAllRunner("auto", probe_iterations=2)
            iterations(runner, 5)
            out[name], out[f"{name}_seconds"] = runner.choice, runner.probe_seconds
        finally:
            setattr(mod, attr, orig)
    # three candidates, the seed's Algorithm 3 among them: plain and BvN slowed on rank 1, so Algorithm 3 must win
    orig_plain, orig_matched = flowlane.comm.all_to_all_single, a2a.matched_all_to_all

    def matched_slow_unless_alg3(*args, **kw):
        return (orig_matched if kw.get("algorithm") == "alg3" else slowed(orig_matched, 0.1))(*args, **kw)

    flowlane.comm.all_to_all_single, a2a.matched_all_to_all = (
        slowed(orig_plain, 0.1),
        matched_slow_unless_alg3,
    )
    try:
        runner = AllToAllRunner("auto", probe_iterations=2, candidates="plain,bvn,alg3")
        out["three"], _ = iterations(runner, 8)
        out["three_choice"], out["three_seconds"] = runner.choice, runner.probe_seconds
    finally:
        flowlane.comm.all_to_all_single, a2a.matched_all_to_all = orig_plain, orig_matched
    a2a.time = real_time
    out["fixed"] = iterations(AllToAllRunner("alg3"), 3)[0]
    pair = dist.new_group([0, 1])
    runner = AllToAllRunner("auto", probe_iterations=1)
    out["pair"] = None
    if rank in (0, 1):
        t = torch.arange(8, dtype=torch.float32).view(-1, 2) + 100 * rank
        want = torch.empty(4, 2)
        dist.all_to_all_single(want, t, [2, 2], [2, 2], group=pair)
        used, ok = [], True
        for _ in range(6):
            y = torch.empty(4, 2)
            used.append(runner(y, t, [2, 2], [2, 2], group=pair))
            ok = ok and bool(torch.equal(y, want))
        out["pair"] = used if ok else ["mismatch"]
    for _ in range(3):
        runner.end_iteration()  # every rank, as a training loop would: the decision is a collective of all ranks
    return out


def _a2a_rank(rank: int, world: int) -> dict:
    import random

    import torch
    import torch.distributed as dist

    from flowlane.hermod.matching import phases_total, plan_all_to_all
    from flowlane.sched.alltoall import gather_split_matrix, matched_all_to_all

    r = random.Random(rank)
    splits = [r.randint(0, 9) for _ in range(world)]
    matrix = gather_split_matrix(splits)
    recv = [matrix[i][rank] for i in range(world)]
    x = torch.arange(sum(splits) * 3, dtype=torch.float32).view(-1, 3) + 1000 * rank
    ref = torch.empty(sum(recv), 3)
    dist.all_to_all_single(ref, x, recv, splits)
    out = {}
    for alg in ("bvn", "bvn_bottleneck", "alg3"):
        y = torch.full((sum(recv), 3), -1.0)
        matched_all_to_all(y, x, recv, splits, matrix, algorithm=alg, quantum=2)
        out[f"equal_{alg}"] = bool(torch.equal(y, ref))
    y = torch.full((sum(recv), 3), -1.0)
    matched_all_to_all(y, x, recv, splits, matrix, phase_sync="barrier")
    out["equal_bvn_barrier"] = bool(torch.equal(y, ref))
    # a plan capped at 2 phases: the second sends everything left at once
    y = torch.full((sum(recv), 3), -1.0)
    capped = matched_all_to_all(y, x, recv, splits, matrix, max_phases=2)
    out["equal_bvn_capped"] = bool(torch.equal(y, ref)) and len(capped) <= 2
    try:
        matched_all_to_all(y, x, recv, splits, matrix, phase_sync="global")  # type: ignore[arg-type]
    except ValueError as e:
        out["bad_sync"] = str(e)
    out["auto"] = _auto_rank(rank, world, splits, x, ref, matrix)
    out["phases_bvn"] = phases_total(plan_all_to_all(matrix, 1, "bvn"))
    out["phases_alg3_total"] = phases_total(plan_all_to_all(matrix, 1, "alg3"))
    return out


def _iterations(log: list) -> dict[int, list]:
    by: dict[int, list] = {}
    for e in log:
        by.setdefault(e[3], []).append(e)
    return by


def test_megatron_defaults_gather_before_and_reduce_after_the_schedule_with_the_same_math():
    """overlap_dp=False: no DP op is launched between an iteration's first and last pipeline/expert op, unlike the
    overlapped FIFO, where the last microbatch's reductions start during its backward (Case II)."""
    overlapped_reduces_early = False
    for r in _results():
        meg, fifo = r["megatron"], r["fifo"]
        for pm, pf in zip(meg["params"], fifo["params"], strict=True):
            assert pm == pf
        for name, run in (("megatron", meg), ("fifo", fifo)):
            for it, es in _iterations(run["log"]).items():
                crit = [i for i, e in enumerate(es) if e[0] == "critical"]
                inside = [e for e in es[crit[0] : crit[-1]] if e[0] == "chunk"]
                if name == "megatron":
                    assert inside == [], (r["rank"], it, inside)
                    assert [e[2] for e in es if e[0] == "chunk"] == ["all_gather"] * 2 + [
                        "reduce_scatter"
                    ] * 2
                elif inside:
                    overlapped_reduces_early = True
    assert overlapped_reduces_early  # the check above can tell the two DAGs apart


def test_lina_chunks_dp_in_issue_order_and_keeps_the_math():
    """Lina: DP split into chunks like Hermod, launched in issue order (FIFO keys; its gathers issued as Megatron's
    are), identically on every rank of a DP group; parameters equal FIFO's."""
    for r in _results():
        lina, fifo = r["lina"], r["fifo"]
        for pl, pf in zip(lina["params"], fifo["params"], strict=True):
            assert pl == pf
        chunks = [e for e in lina["log"] if e[0] == "chunk"]
        assert len(chunks) > len([e for e in fifo["log"] if e[0] == "chunk"])
        ops = [(e[3], e[2], e[5]) for i, e in enumerate(chunks) if i == 0 or chunks[i - 1][2:6] != e[2:6]]
        # each op's chunks back to back, the ops in issue order: FIFO's sequence (it logs one chunk per op)
        assert ops == [(e[3], e[2], e[5]) for e in fifo["log"] if e[0] == "chunk"]
    for stage in range(2):
        seqs = [
            [e[1:7] for e in r["lina"]["log"] if e[0] == "chunk"]
            for r in _results()
            if r["lina"]["stage"] == stage
        ]
        assert all(s == seqs[0] for s in seqs)


def test_workload_device_is_checked():
    import pytest

    with pytest.raises(ValueError, match="device 'tpu' must be 'cpu' or 'cuda'"):
        WorkloadConfig(device="tpu")
    assert WorkloadConfig(device="cuda:1").device == "cuda:1"
