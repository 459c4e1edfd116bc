"""From a recorded FIFO iteration to a plan (flowlane/syndicate/profile.py, `flowlane syndicate-plan`): the profile's
checks name the field, the DAG is the iteration in program order with its waits, the fit recovers the link, the plan
loads as the plugins load it and never predicts worse than FIFO, and the command writes it or refuses in one line.
Framework-free: synthetic profiles, no ranks."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowlane.cli import main
from flowlane.syndicate.cost import CostModel, Option, PathCost
from flowlane.syndicate.optsched import Comm, Compute
from flowlane.syndicate.plan import SyndicatePlan
from flowlane.syndicate.profile import (
    FORMAT,
    KINDS,
    PREDICTED,
    ProfileError,
    ProfileOp,
    alone_samples,
    dag_from_profile,
    default_out,
    fit_cost,
    load_profile,
    plan_from_profile,
    runnable_options,
)
from flowlane.syndicate.search import SearchConfig

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent
LINK = PathCost(alpha=1e-4, beta=8 / 10e9, delta=2e-4)  # 0.1 ms per step, 10 Gbit/s, 0.2 ms per motif
SEARCH = SearchConfig(seed=0, max_iters=300)


def serial_profile(
    sizes=(1 << 20, 1 << 18, 1 << 16, 1 << 20), ranks=4, head=0.01, gap=0.002, opt=0.005
) -> dict:
    """DeepSpeed's pattern, generated from LINK: each all-reduce is waited for at once, then compute, then the next;
    the optimizer step after the last wait."""
    cost = CostModel({"x": LINK})
    t, ops = head, []
    for n in sizes:
        c = cost.standalone(
            ProfileOp("all_reduce", n, "float32", tuple(range(ranks)), 0, None).comm_op("o"), Option("x")
        )
        ops.append(
            {
                "kind": "all_reduce",
                "numel": n,
                "dtype": "float32",
                "ranks": list(range(ranks)),
                "submit_s": t,
                "done_s": t + c,
            }
        )
        t += c + gap
    return {
        "format": FORMAT,
        "iteration": 3,
        "iteration_s": ops[-1]["done_s"] + opt,
        "ranks": list(range(ranks)),
        "ops": ops,
        "provenance": {"synthetic": True},
    }


def overlap_profile(ranks=4) -> dict:
    """Megatron's pattern with --overlap-grad-reduce: buckets submitted during the backward, waited for after it (no
    done_s recorded)."""
    ops = [
        {
            "kind": "all_reduce",
            "numel": n,
            "dtype": "bfloat16",
            "ranks": list(range(ranks)),
            "submit_s": 0.02 + 0.001 * i,
            "done_s": None,
        }
        for i, n in enumerate([1 << 20, 1 << 20, 1 << 19, 1 << 20])
    ]
    return {"format": FORMAT, "iteration": 1, "iteration_s": 0.06, "ranks": list(range(ranks)), "ops": ops}


def test_the_profile_kinds_and_algorithms_are_the_enforcers():
    from flowlane.syndicate import enforcer  # torch: the contract the planner's options must meet

    assert set(KINDS) == set(enforcer._KINDS)
    for kind in KINDS:
        op = ProfileOp(kind, 64, "float32", (0, 1, 2, 3), 0, None).comm_op("o")
        opts = runnable_options(op, CostModel({"clone0": LINK, "clone1": LINK}))
        assert opts[0] == Option("clone0", opts[0].algo)  # the recorded run's: whole, first path
        assert {o.algo for o in opts} <= set(enforcer.RUNNABLE_ALGOS)


def test_the_dag_is_the_iteration_in_program_order_with_its_waits():
    prof = {
        "format": FORMAT,
        "iteration": 7,
        "iteration_s": 4.0,
        "ranks": [0, 1],
        "ops": [
            {
                "kind": "all_reduce",
                "numel": 8,
                "dtype": "float32",
                "ranks": [0, 1],
                "submit_s": 1.0,
                "done_s": 1.5,
            },
            {
                "kind": "all_reduce",
                "numel": 8,
                "dtype": "float32",
                "ranks": [0, 1],
                "submit_s": 2.0,
                "done_s": None,
            },
            {
                "kind": "all_gather",
                "numel": 8,
                "dtype": "bfloat16",
                "ranks": [0, 1],
                "submit_s": 2.5,
                "done_s": 3.8,
            },
        ],
    }
    dag = dag_from_profile(prof, lambda op: (Option("clone0"),))
    got = [
        (s.name, s.seconds, s.deps) if isinstance(s, Compute) else (s.name, s.op.kind, s.deps)
        for s in dag.steps
    ]
    assert got == [
        ("compute0", 1.0, ()),
        ("op0", "all_reduce", ("compute0",)),
        (
            "compute1",
            0.5,
            ("op0",),
        ),  # op0's wait returned at 1.5: the gap's compute runs from there, after op0
        ("op1", "all_reduce", ("compute1",)),
        ("compute2", 0.5, ()),
        ("op2", "all_gather", ("compute2",)),
        ("tail", pytest.approx(0.2), ("op0", "op1", "op2")),  # after op2's wait at 3.8, every op done
    ]
    assert dag.carry == (("tail", "compute0"),) and dag.iterations == 2
    assert all(isinstance(c, Comm) and c.op.ranks == 2 for c in dag.comms)


def test_the_fit_recovers_the_link_and_fifo_predicts_the_measured_iteration():
    prof = serial_profile()
    assert [i for i, *_ in alone_samples(prof)] == [0, 1, 2, 3]
    cost = fit_cost(prof)
    (name, pc), *more = cost.paths.items()
    assert name == "clone0" and not more
    # one group size: the per-step and per-motif costs are one number (cost.fit_path_cost's rule)
    assert pc.beta == pytest.approx(LINK.beta, rel=1e-9)
    assert pc.delta == pytest.approx(6 * LINK.alpha + LINK.delta, rel=1e-9) and pc.alpha == 0
    plan, report = plan_from_profile(prof, cost, SEARCH)
    assert report.fifo_predicted_s == pytest.approx(report.measured_iteration_s, rel=1e-9)
    assert report.label == PREDICTED


def test_a_plan_from_a_serial_profile_loads_and_keeps_the_submission_order_deepspeed_needs(tmp_path):
    from flowlane.syndicate.enforcer import check_dp_gradient_plan

    prof = serial_profile()
    plan, report = plan_from_profile(prof, fit_cost(prof, paths=2), SEARCH)
    loaded = SyndicatePlan.from_json(
        plan.to_json()
    )  # what --syndicate-plan / dp_collective.plan / DeepSpeed load
    assert loaded == plan
    sig = [(o.kind, o.numel, o.dtype, o.ranks) for o in loaded.ops]
    assert sig == [(o["kind"], o["numel"], o["dtype"], len(o["ranks"])) for o in prof["ops"]]
    assert {o.option.path for o in loaded.ops} <= {"clone0", "clone1"}
    # every wait returned before the next submission: the waits order the ops, as DeepSpeed's install demands
    check_dp_gradient_plan(loaded, 4, "DeepSpeed", serial_why="DeepSpeed waits for each bucket's all-reduce")
    assert report.plan_predicted_s <= report.fifo_predicted_s


def test_the_plan_never_predicts_worse_than_fifo_and_two_clones_overlap_the_buckets():
    from flowlane.syndicate.enforcer import check_dp_gradient_plan

    prof = overlap_profile()
    one_plan, one = plan_from_profile(prof, fit_cost(prof, 1, bandwidth_gbps=10, latency_us=20), SEARCH)
    assert one.plan_predicted_s <= one.fifo_predicted_s
    plan, two = plan_from_profile(prof, fit_cost(prof, 2, bandwidth_gbps=10, latency_us=20), SEARCH)
    assert two.fifo_predicted_s == pytest.approx(one.fifo_predicted_s)  # FIFO: every op on clone0
    assert two.plan_predicted_s < two.fifo_predicted_s and not two.kept_fifo
    assert {o.option.path for o in plan.ops} == {"clone0", "clone1"}
    assert two.motifs == sum(len(plan.motifs(i)) for i in range(len(plan.ops)))
    assert two.ops_cut == sum(len(plan.motifs(i)) > 1 for i in range(len(plan.ops)))
    # no waits before the last submission: Megatron with --overlap-grad-reduce may interleave the ops
    check_dp_gradient_plan(SyndicatePlan.from_json(plan.to_json()), 4, "Megatron-core")


def distopt_profile(ranks=4, buckets=4, numel=1 << 21, gap=0.006) -> dict:
    """Megatron's distributed optimizer with --overlap-grad-reduce and --overlap-param-gather: the parameters'
    all-gathers at the forward's start, the gradients' reduce-scatters during the backward, ``gap`` apart, all
    waited for after the backward (no done_s)."""
    ops = [
        {
            "kind": kind,
            "numel": numel,
            "dtype": dtype,
            "ranks": list(range(ranks)),
            "submit_s": t0 + step * i,
            "done_s": None,
        }
        for kind, dtype, t0, step in (
            ("all_gather", "bfloat16", 0.0, 0.001),
            ("reduce_scatter", "float32", 0.02, gap),
        )
        for i in range(buckets)
    ]
    end = 0.02 + gap * (buckets - 1) + 0.03
    return {"format": FORMAT, "iteration": 1, "iteration_s": end, "ranks": list(range(ranks)), "ops": ops}


def test_the_plan_is_the_order_of_the_list_scheduling_rule_the_search_chose(tmp_path, capsys):
    from dataclasses import replace

    from flowlane.syndicate.replan import plan_from_search

    # on this bucket chain the seed's priority rule holds a clone for the next bucket's more critical motif while
    # a ready one waits; the search's other rule (earliest) wins, and the written plan is that rule's order
    prof = distopt_profile()
    cost = fit_cost(prof, 2, bandwidth_gbps=10, latency_us=20)
    plan, report = plan_from_profile(prof, cost, SEARCH)
    _, seed_only = plan_from_profile(prof, cost, replace(SEARCH, picks=("priority",)))
    assert report.search.pick == "earliest" and not report.kept_fifo
    # replayed as the enforcer runs them: 96.4 ms against the priority rule's best, 100.5 (FIFO 151.3)
    assert report.plan_predicted_s < seed_only.plan_predicted_s - 2e-3 < report.fifo_predicted_s
    dtypes = {f"op{i}": o["dtype"] for i, o in enumerate(prof["ops"])}
    dag = dag_from_profile(prof, lambda op: runnable_options(op, cost))
    assert plan == plan_from_search(dag, report.search, dtypes, 1)
    argv = ["syndicate-plan", str(_write(tmp_path, prof)), "--paths", "2", "--bandwidth-gbps", "10"]
    assert main([*argv, "--latency-us", "20", "--seed", "0", "--max-iters", "300"]) == 0
    assert "order from optSched's 'earliest' rule" in capsys.readouterr().out.replace("\n", "")


def test_a_search_result_slower_than_fifo_is_not_written(monkeypatch):
    from flowlane.syndicate import profile as mod
    from flowlane.syndicate.optsched import opt_sched
    from flowlane.syndicate.search import SearchResult

    def cut_everything(dag, cost, config=None, start=None):  # a "search" that cuts every op in 4: more motifs
        plan = {c.name: Option("clone0", "ring", 4) for c in dag.comms}
        s = opt_sched(dag, plan, cost)
        return SearchResult(plan, {}, s.per_iteration, s, s.per_iteration)

    monkeypatch.setattr(mod, "mcmc_search", cut_everything)
    prof = serial_profile()
    plan, report = plan_from_profile(prof, fit_cost(prof), SEARCH)
    assert report.kept_fifo and report.plan_predicted_s == report.fifo_predicted_s
    assert plan.order == SyndicatePlan.fifo(plan.ops).order and report.ops_cut == 0


def test_a_profile_without_done_s_needs_the_link_figures():
    with pytest.raises(ProfileError, match=r"0 with done_s recorded.*--bandwidth-gbps X --latency-us Y"):
        fit_cost(overlap_profile())
    with pytest.raises(ProfileError, match=r"give both .*--bandwidth-gbps and --latency-us"):
        fit_cost(overlap_profile(), bandwidth_gbps=10)
    late = (
        overlap_profile()
    )  # waited for after the backward: each op's span holds the others, no duration of its own
    for i, op in enumerate(late["ops"]):
        op["done_s"] = 0.05 + 0.001 * i
    assert alone_samples(late) == []
    with pytest.raises(ProfileError, match=r"4 with done_s recorded, 0 observed alone .*--latency-us Y"):
        fit_cost(late)
    one_size = serial_profile(sizes=(4096, 4096, 4096))
    with pytest.raises(ProfileError, match=r"3 observed alone \(.*\), of 1 size\(s\).*--bandwidth-gbps"):
        fit_cost(one_size)


def _bad(**change) -> dict:
    prof = serial_profile()
    for key, value in change.items():
        where, _, field = key.partition("__")
        if where == "op1":
            prof["ops"][1][field] = value
        else:
            prof[key] = value
    return prof


@pytest.mark.parametrize(
    "prof, match",
    [
        (_bad(format="flowlane.syndicate.profile/0"), r"format 'flowlane.syndicate.profile/0' is not "),
        (_bad(ops=[]), r"profile ops must be a non-empty list"),
        (_bad(iteration_s=-1.0), r"iteration_s must be >= 0"),
        (_bad(op1__submit_s=-0.5), r"ops\[1\]\.submit_s must be >= 0"),
        (_bad(op1__done_s=0.0), r"ops\[1\]\.done_s=0.0 is before its submit_s"),
        (_bad(op1__kind="all_to_some"), r"ops\[1\]\.kind 'all_to_some' is not one of \['all_reduce'"),
        (_bad(op1__dtype="float8"), r"ops\[1\]\.dtype 'float8' is not one of \[.*'bfloat16'"),
        (_bad(op1__numel=0), r"ops\[1\]\.numel must be an integer >= 1"),
        (_bad(op1__ranks=[0, 1]), r"ops\[1\]\.ranks \[0, 1\] differ from ops\[0\]\.ranks"),
        (_bad(op1__submit_s=0.0), r"ops\[1\]\.submit_s=0.0 is before ops\[0\]\.submit_s.*submission order"),
        (_bad(op1__done_s=99.0), r"ops\[1\]\.done_s=99.0 is after the iteration's end"),
        (_bad(op1__group=3), r"ops\[1\]: unknown keys \['group'\]"),
        (_bad(iteration="3"), r"profile iteration must be an integer >= 0"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_field(prof, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(prof)


def test_the_enforcers_own_dict_without_provenance_loads():
    prof = serial_profile()
    del prof["provenance"]
    assert load_profile(prof).provenance == {}


def _write(tmp_path: Path, prof: dict, name: str = "syndicate_profile.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(prof))
    return p


def test_the_command_writes_a_plan_the_loader_takes(tmp_path, capsys):
    prof = _write(tmp_path, serial_profile())
    out = tmp_path / "plans" / "plan.json"
    assert main(["syndicate-plan", str(prof), "--out", str(out), "--paths", "2", "--max-iters", "200"]) == 0
    plan = SyndicatePlan.from_json(out.read_text())
    assert [o.numel for o in plan.ops] == [o["numel"] for o in serial_profile()["ops"]]
    assert [p.name for p in out.parent.iterdir()] == ["plan.json"]  # the temporary file is gone
    text = capsys.readouterr().out
    for row in (
        "FIFO iteration, predicted (optSched on the fitted cost model)",
        "measured",
        "motifs",
        "ops cut",
    ):
        assert row in text
    assert f"wrote {out}" in text.replace("\n", "")
    # a folder for --out is refused before the search, in one line
    assert main(["syndicate-plan", str(prof), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"flowlane syndicate-plan: error: --out {str(tmp_path)!r} is a folder"
    )


def test_the_command_defaults_to_a_plan_beside_the_profile(tmp_path, capsys):
    prof = _write(tmp_path, overlap_profile())
    argv = ["syndicate-plan", str(prof), "--bandwidth-gbps", "10", "--latency-us", "20", "--max-iters", "50"]
    assert main(argv) == 0
    assert SyndicatePlan.from_json((tmp_path / "syndicate_plan.json").read_text()).ops
    assert "given link figures" in capsys.readouterr().out
    # the recipe's stage and expert profiles get plans of their own, named as the plan paths take them
    assert default_out(tmp_path / "syndicate_profile_stage1.json") == tmp_path / "syndicate_plan_stage1.json"
    assert default_out("o/syndicate_profile_expert.json") == Path("o/syndicate_plan_expert.json")
    assert default_out("o/run3.json") == Path("o/run3_plan.json")


@pytest.mark.parametrize(
    "prof, argv, match",
    [
        ({**serial_profile(), "format": "nope"}, [], r"profile format 'nope' is not"),
        (overlap_profile(), [], r"give the link's figures instead: --bandwidth-gbps X --latency-us Y"),
        (overlap_profile(), ["--latency-us", "5"], r"give both .*--bandwidth-gbps and --latency-us"),
        ("{not json", [], r"is not JSON"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys, prof, argv, match):
    p = tmp_path / "p.json"
    p.write_text(prof if isinstance(prof, str) else json.dumps(prof))
    out = tmp_path / "plan.json"
    assert main(["syndicate-plan", str(p), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowlane syndicate-plan: error: ") and err.count("\n") == 1, err
    assert re.search(match, err, re.I) and "Traceback" not in err
    assert not out.exists()


def test_the_command_runs_without_torch_and_exits_2_on_a_missing_file(tmp_path):
    prof = _write(tmp_path, serial_profile())
    block = (
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, _NoTorch())\n"
    )
    code = block + (
        "from flowlane.cli import main\n"
        f"rc = main(['syndicate-plan', {str(prof)!r}, '--out', {str(tmp_path / 'p.json')!r}, '--max-iters', '50'])\n"
        f"bad = main(['syndicate-plan', {str(tmp_path / 'missing.json')!r}])\n"
        "print('RC', rc, bad, 'torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "RC 0 2 False" in r.stdout, r.stdout + r.stderr
    assert "cannot read the profile" in r.stderr and "Traceback" not in r.stderr


def test_the_docs_quote_the_command_with_flags_it_has():
    import argparse

    from flowlane.syndicate.profile import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    known = {s for a in add_parser(sub)._actions for s in a.option_strings}
    doc = (ROOT / "docs/syndicate.md").read_text()
    quoted = re.findall(r"flowlane syndicate-plan[^`\n]*", doc)
    assert quoted, "docs/syndicate.md quotes no `flowlane syndicate-plan` command"
    flags = {f for q in quoted for f in re.findall(r"(?<![\w-])(--[a-z][-a-z]*)", q)}
    assert flags and flags <= known, flags - known


def test_the_profile_is_not_mutated():
    prof = serial_profile()
    before = copy.deepcopy(prof)
    plan_from_profile(prof, fit_cost(prof), SearchConfig(max_iters=20))
    assert prof == before
