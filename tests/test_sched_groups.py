"""Wire classes on gloo (flowlane.sched.groups): one clone per Hermod class, each bound to its class's interface, so
a class's traffic leaves from its own source address; bad or inconsistent settings fail on every rank, never hang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flowlane.launch import LaunchError, launch
from flowlane.sched.groups import parse_class_ifnames
from flowlane.testing.netem import EmulatedNetwork, unavailable_reason
from tests import dist_workers as W

pytestmark = pytest.mark.timeout(120)


def test_class_interfaces_parse_pad_and_name_what_is_wrong():
    assert parse_class_ifnames(None) is None and parse_class_ifnames(" ") is None
    assert parse_class_ifnames("lo") == ["lo", "lo", "lo"]
    assert parse_class_ifnames(["lo", "lo"]) == ["lo", "lo", "lo"]
    with pytest.raises(ValueError, match="'nosuch0' does not exist"):
        parse_class_ifnames("lo,nosuch0")
    with pytest.raises(ValueError, match="1..3 non-empty"):
        parse_class_ifnames("lo,lo,lo,lo")
    with pytest.raises(ValueError, match="1..3 non-empty"):
        parse_class_ifnames("lo,,lo")


def test_ranks_that_disagree_on_wire_classes_all_fail_instead_of_hanging():
    with pytest.raises(LaunchError) as e:
        launch(W.class_groups_with, 2, args=({0: "lo"},), timeout=60)
    assert "set on ranks [0] only" in str(e.value)
    with pytest.raises(LaunchError) as e:
        launch(W.class_groups_with, 2, args=({0: "lo", 1: "nosuch0"},), timeout=60)
    assert "'nosuch0' does not exist" in str(e.value)


# the llm lane's torch exposes ncclConfig_t.trafficClass (ProcessGroupNCCL.Options().config.traffic_class); the gnn
# lane's older torch does not
@pytest.mark.llm
def test_nccl_clones_carry_each_class_traffic_class_in_the_same_order_on_every_rank():
    """The NCCL path as far as a CPU can take it: one clone per Hermod class for the union of every rank's groups, in
    one sorted order on every rank (or new_group would hang), each with ncclConfig_t.trafficClass of its class. Running
    those communicators needs GPUs (not tested here)."""
    from flowlane.hermod.wire import nccl_traffic_class

    res = launch(W.nccl_class_group_calls, 2, timeout=60)
    tcs = [nccl_traffic_class(c) for c in range(3)]
    expected = [[[0], "nccl", tc] for tc in tcs] + [[[0, 1], "nccl", tc] for tc in tcs]
    assert res[0]["calls"] == res[1]["calls"] == expected
    assert res[0]["world_clones"] == res[1]["world_clones"] == ["clone3", "clone4", "clone5", "clone5"]
    assert res[0]["mine"] == [(0,), (0, 1)] and res[1]["mine"] == [(0, 1)]


@pytest.mark.llm
def test_nccl_options_set_the_traffic_class_or_say_what_the_torch_build_lacks(
    monkeypatch: pytest.MonkeyPatch,
):
    import torch.distributed as dist

    from flowlane.hermod.wire import nccl_traffic_class
    from flowlane.sched.groups import _nccl_options

    assert [_nccl_options(c).config.traffic_class for c in range(3)] == [
        nccl_traffic_class(c) for c in range(3)
    ]
    with pytest.raises(ValueError, match="hermod_class must be an integer in"):
        _nccl_options(3)

    class OldOptions:  # a torch whose ncclConfig has no trafficClass (NCCL < 2.24)
        config = type("Config", (), {"blocking": 1})()

    monkeypatch.setattr(dist.ProcessGroupNCCL, "Options", OldOptions)
    with pytest.raises(RuntimeError, match="no 'traffic_class'.*NCCL >= 2.24"):
        _nccl_options(0)


def test_wire_classes_on_loopback_give_one_working_clone_per_class():
    out = launch(W.class_groups_with, 2, args=({0: "lo", 1: "lo"},), timeout=60)
    assert [o["clones"] for o in out] == [3, 3]
    assert [o["sums"] for o in out] == [[1.0, 1.0, 1.0]] * 2  # rank 0 + rank 1 on every clone


_RANK = r"""
import json, subprocess, sys, datetime
import torch, torch.distributed as dist
from flowlane.sched.groups import build_class_groups
rank, master, ifnames = int(sys.argv[1]), sys.argv[2], sys.argv[3] or None
dist.init_process_group("gloo", init_method=f"tcp://{master}:29613", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
cg = build_class_groups([[0, 1]], gloo_class_ifnames=ifnames)
sums = []
for c in range(3):
    t = torch.ones(1 << 16)
    dist.all_reduce(t, group=cg.get(None, c))
    sums.append(float(t[0]))
ss = subprocess.run(["ss", "-Htn", "state", "established"], capture_output=True, text=True, check=True).stdout
local = sorted({line.split()[-2].rsplit(":", 1)[0] for line in ss.splitlines() if line.strip()})
dist.barrier()
print(json.dumps({"sums": sums, "local": local}), flush=True)
"""


@pytest.mark.netns
@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
def test_the_bulk_class_leaves_from_its_own_interface_address():
    """Two namespaces; each rank has a macvlan ``bulk0`` (second subnet) on its eth0 (netem's priority classes).
    With classes (eth0, eth0, bulk0) the bulk clone's connections use the bulk addresses; without, none does."""
    with EmulatedNetwork(2, subnet="10.214.0.0/24", bulk_subnet="10.214.1.0/24") as net:
        for ifnames, bulk_used in (("eth0,eth0,bulk0", True), ("", False)):
            procs = [
                net.popen(
                    r,
                    [sys.executable, "-c", _RANK, str(r), net.ips[0], ifnames],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r in range(2)
            ]
            outs = [p.communicate(timeout=90) for p in procs]
            for p, (_, e) in zip(procs, outs, strict=True):
                assert p.returncode == 0, e[-2000:]
            for r, (o, _) in enumerate(outs):
                res = json.loads(o.strip().splitlines()[-1])
                assert res["sums"] == [2.0, 2.0, 2.0]
                assert net.ips[r] in res["local"]
                assert (net.bulk_ips[r] in res["local"]) is bulk_used, res
