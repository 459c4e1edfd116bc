import json
import os
from types import SimpleNamespace

import pytest

from flowlane import launch as L
from flowlane.trace import write_chrome_trace
from tests import dist_workers as W


def test_recorded_ops_move_the_right_data_and_count_bytes_on_four_ranks(tmp_path):
    res = L.launch(W.comm_roundtrip, 4, timeout=120)
    for rank, r in enumerate(res):
        assert r["sum"] == sum(range(4))
        assert r["gathered"] == [float(i) for i in range(4) for _ in range(4)]
        assert r["a2a"] == [100.0 * src + rank * 2 + j for src in range(4) for j in range(2)]
        assert r["recv"] == float(rank ^ 1)
        # bytes: all_reduce 256 fp32, all_gather input 4 fp32, a2a input 8 fp32, one 1000-fp32 send (recv not counted)
        assert r["bytes"] == {"dp": 256 * 4 + 4 * 4, "ep": 8 * 4, "pp": 1000 * 4}
        assert ("dp", "all_reduce", 1024, ("it", 0), True) in r["ops"]
        assert ("pp", "isend", 4000, "s", True) in r["ops"] and ("pp", "irecv", 4000, "r", True) in r["ops"]
    events = [e for r in res for e in r["events"]]
    path = write_chrome_trace(tmp_path / "t.json", events)
    doc = json.loads(path.read_text())
    names = {(e["pid"], e["name"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {(r, "all_reduce") for r in range(4)} <= names and (0, "p2p") in names
    assert not (tmp_path / "t.json.tmp").exists()


def test_a_failing_rank_is_reported_by_number_with_its_traceback():
    with pytest.raises(L.RankFailedError, match="rank 1 failed") as e:
        L.launch(W.raise_on_rank_one, 3, timeout=60)
    assert "boom from rank one" in str(e.value)


def test_a_stuck_rank_becomes_a_timeout_error_naming_it_and_its_stack():
    with pytest.raises(L.RankTimeoutError) as e:
        L.launch(W.hang_on_rank_two, 3, timeout=15)
    assert e.value.ranks == [2]
    assert "hang_on_rank_two" in str(e.value)


def test_forked_ranks_see_the_launchers_environment_as_it_is_at_launch(monkeypatch):
    """Ranks fork from a fork server (no GPU here): its environment is the launcher's when it started, not now; each
    rank must see the launcher's current one, as a spawned rank would, with ``env`` on top."""
    monkeypatch.setenv("FLOWLANE_TEST_SEEN", "before")
    first = L.launch(W.env_and_parent, 2, args=("FLOWLANE_TEST_SEEN",), timeout=60, start_method="forkserver")
    monkeypatch.setenv("FLOWLANE_TEST_SEEN", "after")  # the fork server runs on with "before"
    again = L.launch(W.env_and_parent, 2, args=("FLOWLANE_TEST_SEEN",), timeout=60, start_method="forkserver")
    spawned = L.launch(
        W.env_and_parent,
        1,
        args=("FLOWLANE_TEST_SEEN",),
        timeout=60,
        start_method="spawn",
        threads_per_rank=2,
    )
    over = L.launch(
        W.env_and_parent, 1, args=("FLOWLANE_TEST_SEEN",), env={"FLOWLANE_TEST_SEEN": "env"}, timeout=60
    )
    assert [r[0] for r in first + again + spawned + over] == ["before"] * 2 + ["after"] * 3 + ["env"]
    # forked by the server (not this process), spawned by this one; the thread count is the rank's own either way
    assert {r[1] for r in first + again} != {os.getpid()} and spawned[0][1] == os.getpid()
    assert [r[2] for r in first + spawned] == [1, 1, 2]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: L.preload("megatron core"), r"preload: 'megatron core' is not a module name"),
        (lambda: L.launch(W.hang_on_rank_two, 1, start_method="fork"), r"start_method must be one of auto, "),
    ],
)
def test_bad_start_options_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_rank_that_dies_without_a_result_is_an_error_not_a_hang():
    with pytest.raises(L.RankFailedError, match="rank 0 failed:\nprocess exited with code 3"):
        L.launch(W.die_on_rank_zero, 2, timeout=60)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"nprocs": 0}, "nprocs must be an integer >= 1, got 0"),
        ({"nprocs": 2, "timeout": -1}, "timeout must be > 0 seconds, got -1"),
    ],
)
def test_launch_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        L.launch(W.hang_on_rank_two, **kw)


def test_ranks_may_return_tensors():
    res = L.launch(W.return_tensors, 2, timeout=120)
    assert [r["t"][10].item() for r in res] == [0.0, 10.0]


def test_owned_process_groups_are_destroyed_on_exit_and_kept_on_error():
    res = L.launch(W.owned_groups, 2, timeout=60)
    for r in res:
        assert r["inside"] == r["before"] + 1
        assert r["after"] == r["before"]  # destroyed (Megatron's destroy_model_parallel would only forget it)
        assert r["after_error"] == r["before"] + 1  # a peer may still be blocked in it: left to the launcher


def test_a_coalesced_batch_gives_one_handle_that_completes_every_op(monkeypatch, tmp_path):
    """NCCL returns one Work for a whole batch_isend_irecv (gloo one per op): flowlane.comm must not assume one per
    op (it did, and every pipeline p2p and matched all-to-all failed on the first GPU run); waiting on the one handle
    stamps every recorded op."""
    import torch
    import torch.distributed as dist

    from flowlane import comm

    class OneWork:
        waited = 0

        def wait(self, timeout=None):
            OneWork.waited += 1
            return True

        def is_completed(self):
            return True

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [OneWork()])
    # what comm reads of a P2POp (a real one needs an initialised process group)
    ops = [
        SimpleNamespace(op=fn, tensor=torch.ones(4), peer=1, group=None)
        for fn in (dist.isend, dist.irecv, dist.isend)
    ]
    try:
        with comm.recording() as rec:
            works = comm.batch_isend_irecv(ops, kind="pp")
            assert len(works) == 1 and works[0].is_completed()
            assert all(o.end is None for o in rec.ops)
            works[0].wait()
    finally:
        dist.destroy_process_group()
    assert OneWork.waited == 1
    assert [o.op for o in rec.ops] == ["isend", "irecv", "isend"] and all(o.end is not None for o in rec.ops)
    assert sum(o.nbytes for o in rec.ops) == 3 * 16
