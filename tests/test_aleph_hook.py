"""ALEPH tier 0: the hierarchical all-reduce over gloo subgroups equals all_reduce; the DDP hook equals DDP's own."""

import pytest

from flowlane.launch import launch
from tests import aleph_workers

# torch-only core code: runs in the llm lane (the gnn lane's torch 2.2.1 was checked by hand, see docs/aleph.md)
pytestmark = pytest.mark.once

CASES_4 = [
    ([[3, 1, 2], [0]], "allreduce"),  # Table 1's plan: w3 aggregates w1, w2; w0 direct
    ([[3, 1, 2], [0]], "ps"),
    ([[0, 1, 2, 3]], "allreduce"),  # one cluster: no top tier
    ([[1, 0], [2, 3]], "ps"),
]


def _check(res: list[dict], ncases: int) -> None:
    for rank, r in enumerate(res):
        assert r["int_equal"] == [True] * ncases, (rank, r["int_equal"])
        assert r["rs_equal"] == [True] * ncases, (rank, r["rs_equal"])
        assert max(r["float_maxdiff"]) < 1e-4, (rank, r["float_maxdiff"])
        # DDP's own reducer: x (1/size), then one all-reduce: bit for bit
        assert r["ddp_singletons_bitwise"], rank
        assert r["ddp_hier_maxdiff"] < 1e-5, (rank, r["ddp_hier_maxdiff"])
        assert r["ddp_moved"] > 1e-3  # training changed the parameters: the comparison is not vacuous
        assert r["probe"] == res[0]["probe"] and all(f > 0 for f in r["probe"])
        assert "disagree on the ALEPH plan" in r["mismatch"], (
            rank,
            r["mismatch"],
        )  # raised everywhere, no hang


def test_hierarchical_allreduce_and_ddp_hook_match_all_reduce_and_plans_must_agree_on_4_ranks():
    res = launch(aleph_workers.hierarchical_cases, 4, args=(CASES_4,), timeout=120)
    _check(res, len(CASES_4))
    # the DDP hook re-planning after each iteration's last bucket: the plan changed at iteration 2
    for r in res:
        assert r["replan_decisions"] == [(1, False), (2, True), (3, False)], r["replan_decisions"]
        assert r["replan_maxdiff"] < 1e-5, r["replan_maxdiff"]
        # the default (real, confirmed) probe: three re-planning points, the same decisions on every rank
        assert [d[0] for d in r["real_probe_decisions"]] == [1, 2, 3], r["real_probe_decisions"]
        assert r["real_probe_decisions"] == res[0]["real_probe_decisions"]
        assert r["real_probe_maxdiff"] < 1e-5, r["real_probe_maxdiff"]


@pytest.mark.slow
def test_hierarchical_allreduce_on_7_ranks_with_singletons_and_two_tiers():
    cases = [([[6, 0, 1, 2], [3, 4], [5]], "allreduce"), ([[6, 0, 1, 2], [3, 4], [5]], "ps")]
    res = launch(aleph_workers.hierarchical_cases, 7, args=(cases,), timeout=240)
    _check(res, len(cases))


def test_replanning_with_the_default_probe_is_refused_off_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe times CPU tensors by the host clock after Work.wait(): NCCL takes no CPU tensors and its wait does not
    block the host, so on a non-gloo group re-planning with the default probe is refused at install (no GPU here: the
    group's backend is faked). A caller's own probe, or a CPU part on gloo, is accepted."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from flowlane.aleph import AlephConfig, Replanner
    from flowlane.aleph.hook import install_aleph_hook
    from flowlane.aleph.probe import probe_bandwidth

    backend = ["nccl"]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend[0])
    rp = Replanner([30.0, 20.0, 10.0, 10.0], AlephConfig(replan_every=1, top="ps"))
    model = SimpleNamespace(process_group="dp")  # refused before the model is looked at
    with pytest.raises(
        ValueError, match=r"install_aleph_hook\(replanner=...\): .* which is 'nccl'; it needs gloo"
    ):
        install_aleph_hook(model, rp.plan, top="ps", replanner=rp)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"probe_bandwidth: .* which is 'nccl'"):
        probe_bandwidth(group="dp")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a torch DistributedDataParallel"):  # past the backend check
        install_aleph_hook(model, rp.plan, top="ps", replanner=rp, probe=lambda: [1.0] * 4)  # type: ignore[arg-type]
    backend[0] = "cpu:gloo,cuda:nccl"
    with pytest.raises(TypeError, match="needs a torch DistributedDataParallel"):
        install_aleph_hook(model, rp.plan, top="ps", replanner=rp)  # type: ignore[arg-type]


def test_the_ps_of_a_plan_made_from_figures_is_the_head_they_favour(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a replanner (figures known) the hook's PS is flowlane.aleph.model.ps_head, at install and after each
    re-plan, not the first head. Unit level: the hierarchy's constructor is recorded, no process group."""
    from types import SimpleNamespace

    import torch

    import flowlane.aleph.hook as hook_mod
    from flowlane.aleph import AlephConfig, Replanner
    from flowlane.aleph.model import ps_head

    made: list[tuple] = []

    def fake_har(plan, group=None, top="allreduce", chunk_bytes=0, **kw):  # type: ignore[no-untyped-def]
        made.append((plan, kw.get("ps")))
        return SimpleNamespace(plan=plan, top=top, ps=kw.get("ps") or (plan.heads[0],), dedicated_ps=False,
                               group=group, chunk_bytes=chunk_bytes, _up_pgs=[], _down_pgs=[])  # fmt: skip

    monkeypatch.setattr(hook_mod, "HierarchicalAllReduce", fake_har)
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", SimpleNamespace)
    rp = Replanner([30.0, 20.0, 10.0, 10.0], AlephConfig(replan_every=1, top="ps"))
    assert [list(c.members) for c in rp.plan.clusters] == [[0, 2, 3], [1]]  # 0: 30/3 = 10, 1: 20/1 = 20
    seen = iter([[10.0, 10.0, 20.0, 30.0]])
    model = SimpleNamespace(process_group=None, register_comm_hook=lambda state, hook: None)
    state = hook_mod.install_aleph_hook(model, rp.plan, top="ps", replanner=rp, probe=lambda: next(seen))
    assert made[-1][1] == (1,) == (ps_head(rp.plan, rp.bandwidth),)
    state.end_iteration()  # 3 takes over 0's members, 2 alone: 2 (20/1) beats 3 (30/3)
    assert state.decisions[0][1] and made[-1][0].heads == (2, 3) and made[-1][1] == (2,)
