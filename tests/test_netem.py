"""flowlane.testing.netem: a 2-namespace emulated network is reachable, shaped, and fully deleted on exit (also on errors)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowlane.testing.netem import EmulatedNetwork, NetemError, unavailable_reason

# a hang stops the test; 120 s, not 30: the hermod_real tests import torch, which took over 30 s at load 40
pytestmark = pytest.mark.timeout(120)


_SKIP = unavailable_reason()


def needs_netns(fn):  # noqa: ANN001, ANN201 - decorator
    return pytest.mark.netns(pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")(fn))


_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5099)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 16)):
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""
_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5099), timeout=10)
t = time.perf_counter(); c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
n = int(c.recv(64)); print(n, time.perf_counter() - t)
"""


_TIMED_CLIENT = """
import socket, sys, time
host, nbytes, src, at = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
c = socket.create_connection((host, 5099), timeout=10, source_address=(src, 0))
time.sleep(max(0.0, at - time.time()))   # every client starts sending at the same wall-clock time
t = time.perf_counter(); c.sendall(b"x" * nbytes); c.shutdown(socket.SHUT_WR)
n = int(c.recv(64)); print(n, time.perf_counter() - t)
"""


def _existing() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _transfer(net: EmulatedNetwork, src: int, dst: int, nbytes: int) -> float:
    srv = net.popen(dst, [sys.executable, "-c", _SERVER, net.ips[dst]], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        r = net.run(
            src,
            [sys.executable, "-c", _CLIENT, net.ips[dst], str(nbytes)],
            capture_output=True,
            text=True,
            timeout=15,
        )
        assert r.returncode == 0, r.stderr
        got, secs = r.stdout.split()
        assert int(got) == nbytes
        return float(secs)
    finally:
        srv.kill()
        srv.wait()


@needs_netns
def test_two_namespaces_connected_shaped_and_cleaned_up() -> None:
    # 0 -> 1 shaped to 40 Mbit/s (htb + u32), 1 -> 0 left at 400 Mbit/s
    with EmulatedNetwork(2, pair_rate_mbit=[[0, 40], [400, 0]]) as net:
        names = net.namespaces
        assert set(names) <= _existing()
        assert all(ip.startswith("10.") for ip in net.ips)
        slow = _transfer(net, 0, 1, 2_000_000)  # 16 Mbit at 40 Mbit/s: ~0.4 s
        fast = _transfer(net, 1, 0, 2_000_000)  # ~0.04 s
        assert slow >= 0.8 * 16 / 40, f"0->1 not shaped: {slow:.3f} s"
        assert slow < 3.0, f"0->1 far slower than 40 Mbit/s: {slow:.3f} s"
        assert fast < slow / 2, (
            f"1->0 (400 Mbit/s) not faster than 0->1 (40 Mbit/s): {fast:.3f} vs {slow:.3f}"
        )
        # nothing was created in the caller's namespace: the veths live only in the emulated namespaces
        root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert not any(n in root_links for n in names)
    assert not set(names) & _existing(), "namespaces left behind"


@needs_netns
def test_cleanup_after_exception_inside_block() -> None:
    with pytest.raises(RuntimeError, match="boom"), EmulatedNetwork(2, rate_mbit=100) as net:
        names = net.namespaces
        assert set(names) <= _existing()
        raise RuntimeError("boom")
    assert not set(names) & _existing(), "namespaces left behind after an exception"


@needs_netns
def test_failure_while_building_removes_what_was_created() -> None:
    net = EmulatedNetwork(2, rate_mbit=100)
    net.ifname = "bad name with spaces"  # makes 'ip link add' fail half-way through building
    with pytest.raises(NetemError, match="command failed"):
        net.up()
    assert not set(net.namespaces) & _existing()


def _two_flows_through_server_0(
    net: EmulatedNetwork, nbytes: int, first: str | None = None, second: str | None = None
) -> tuple[float, float]:
    """Rank 0 -> 2 from ``first`` (default: eth0, the default class) and rank 1 -> 3 from ``second`` (default: bulk0,
    the bulk class), started together: both cross server 0's NIC. Returns their durations."""
    servers = [
        net.popen(d, [sys.executable, "-c", _SERVER, net.ips[d]], stdout=subprocess.PIPE, text=True)
        for d in (2, 3)
    ]
    try:
        assert all(s.stdout is not None and s.stdout.readline().strip() == "ready" for s in servers)
        at = time.time() + 1.0
        clients = [
            net.popen(
                src,
                [sys.executable, "-c", _TIMED_CLIENT, net.ips[dst], str(nbytes), addr, str(at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, dst, addr in ((0, 2, first or net.ips[0]), (1, 3, second or net.bulk_ips[1]))
        ]
        outs = [c.communicate(timeout=20) for c in clients]
    finally:
        for s in servers:
            s.kill()
            s.wait()
    assert all(c.returncode == 0 for c in clients), [e for _, e in outs]
    assert [int(o.split()[0]) for o, _ in outs] == [nbytes, nbytes]
    return float(outs[0][0].split()[1]), float(outs[1][0].split()[1])


@needs_netns
def test_servers_share_one_nic_and_the_bulk_class_yields_to_the_rest() -> None:
    """Two servers of two ranks behind one 40 Mbit/s NIC each, with priority classes. A default-class flow and a
    bulk-class flow start together on server 0's NIC: the default flow finishes about as fast as alone, the bulk
    flow only after it (fair sharing would finish both at ~2x); traffic inside a server does not touch the NIC; the
    tc counters put each flow's bytes in its class."""
    nbytes = 3_000_000  # 24 Mbit: 0.6 s alone at 40 Mbit/s
    with EmulatedNetwork(
        4, rate_mbit=40, ranks_per_server=2, subnet="10.215.0.0/24", bulk_subnet="10.215.1.0/24"
    ) as net:
        assert len(net.namespaces) == 7 and set(net.namespaces) <= _existing()
        assert net.bulk_ips == ["10.215.1.1", "10.215.1.2", "10.215.1.3", "10.215.1.4"]
        inside = _transfer(net, 0, 1, nbytes)  # same server: no NIC
        assert inside < 0.3, f"intra-server transfer was shaped: {inside:.3f} s"
        t_hi, t_lo = _two_flows_through_server_0(net, nbytes)
        assert t_hi < 0.6 * 1.35, f"default class slowed by the bulk flow: {t_hi:.3f} s (alone ~0.6 s)"
        assert t_lo > 1.5 * t_hi, (
            f"bulk flow not behind the default one: bulk {t_lo:.3f} s, default {t_hi:.3f} s"
        )
        counts = net.class_bytes()
        assert set(counts) == {"h0:nic", "h1:nic", "s:d0", "s:d1"}
        assert counts["h0:nic"]["default"] >= nbytes and counts["h0:nic"]["bulk"] >= nbytes
        assert counts["s:d1"]["default"] >= nbytes and counts["s:d1"]["bulk"] >= nbytes
    assert not set(net.namespaces) & _existing(), "namespaces left behind"


@needs_netns
def test_a_shallow_switch_buffer_limits_only_the_downlink_queue() -> None:
    """``switch_buffer_kb``: the switch ports towards the ranks queue that many bytes (tbf ``limit``), the ranks'
    own uplinks keep the deep ``tbf_latency_ms`` queue; traffic still flows."""
    with EmulatedNetwork(2, rate_mbit=40, switch_buffer_kb=48, subnet="10.218.0.0/24") as net:

        def lat_us(ns: str, dev: str) -> float:  # tc reports tbf's queue as lat = (limit - burst) / rate
            out = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "-j", "qdisc", "show", "dev", dev],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            return float(json.loads(out)[0]["options"]["lat"])

        burst = 32 * 1024
        assert lat_us(net.switch_ns, "p1") == pytest.approx((48 * 1024 - burst) * 8 / 40e6 * 1e6, abs=2)
        assert lat_us(net.ns[0], "eth0") == pytest.approx(100e3)  # tbf_latency_ms, the default
        assert net.describe()["switch_buffer_kb"] == 48
        assert _transfer(net, 0, 1, 1_000_000) < 1.0  # 8 Mbit at 40 Mbit/s: 0.2 s, one sender never overflows


@needs_netns
def test_sysctls_are_set_in_the_rank_namespaces_only() -> None:
    """``sysctls``: each rank's namespace gets the value, the host keeps its own; non-network keys are refused."""

    def wmem(*prefix: str) -> str:
        return subprocess.run(
            [*prefix, "sysctl", "-n", "net.ipv4.tcp_wmem"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()

    host = wmem()
    with EmulatedNetwork(2, sysctls={"net.ipv4.tcp_wmem": "4096 32768 65536"}, subnet="10.220.0.0/24") as net:
        assert [wmem(*net.exec_prefix(r)) for r in range(2)] == [["4096", "32768", "65536"]] * 2
        assert net.describe()["sysctls"] == {"net.ipv4.tcp_wmem": "4096 32768 65536"}
        assert wmem() == host
    with pytest.raises(NetemError, match=r"only network keys .* got \['kernel.pid_max'\]"):
        EmulatedNetwork(2, sysctls={"kernel.pid_max": "4096"})
    bad = EmulatedNetwork(2, sysctls={"net.ipv4.no_such_key": "1"}, subnet="10.221.0.0/24")
    # the kernel refuses it: up() fails ...
    with pytest.raises(NetemError, match="net.ipv4.no_such_key=1"), bad:
        pass
    assert not set(bad.namespaces) & _existing(), "namespaces left behind"  # ... and removes what it built


@needs_netns
def test_run_ranks_returns_outputs_and_a_dead_peer_stops_the_rest_at_once() -> None:
    """EmulatedNetwork.run_ranks: every rank's stdout in rank order (large outputs do not block); a rank that fails
    ends the run at once, naming it, while its peer would have waited a minute; so does the time limit."""
    big = "import os, sys; print(os.environ['GLOO_SOCKET_IFNAME'], len(sys.argv)); print('x' * 200_000)"
    with EmulatedNetwork(2, subnet="10.219.0.0/24") as net:
        outs = net.run_ranks([[sys.executable, "-c", big], [sys.executable, "-c", big, "arg"]], timeout_s=30)
        assert [o.splitlines()[0] for o in outs] == ["eth0 1", "eth0 2"] and len(outs[1]) > 200_000
        assert net.run_ranks([[sys.executable, "-c", "print(1)"]], slots=[1], timeout_s=30) == ["1\n"]
        t = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(namespace slot 1\) failed: exit code 3.*\n.*boom"):
            net.run_ranks(
                [
                    [sys.executable, "-c", "import time; time.sleep(60)"],
                    [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                ],
                timeout_s=60,
            )
        assert time.monotonic() - t < 15, "the surviving rank was waited for"
        with pytest.raises(RuntimeError, match="rank 0 .* still running after 1 s"):
            net.run_ranks([[sys.executable, "-c", "import time; time.sleep(60)"]], timeout_s=1)
        with pytest.raises(NetemError, match="need as many slots"):
            net.run_ranks([["true"]], slots=[2], timeout_s=1)


@needs_netns
def test_a_bulk_lane_gives_the_bulk_class_its_own_capacity() -> None:
    """``bulk_lane_mbit``: the bulk class no longer shares the link, so both flows finish about as fast as alone."""
    nbytes = 3_000_000
    with EmulatedNetwork(
        4,
        rate_mbit=40,
        ranks_per_server=2,
        subnet="10.216.0.0/24",
        bulk_subnet="10.216.1.0/24",
        bulk_lane_mbit=40,
    ) as net:
        t_hi, t_lo = _two_flows_through_server_0(net, nbytes)
        assert max(t_hi, t_lo) < 0.6 * 1.35, (
            f"the lanes are not separate: default {t_hi:.3f} s, bulk {t_lo:.3f} s"
        )
        assert min(t_hi, t_lo) > 0.6 * 0.8, f"not shaped: default {t_hi:.3f} s, bulk {t_lo:.3f} s"


@needs_netns
def test_a_pipeline_class_sits_between_default_and_bulk() -> None:
    """``pipeline_subnet``: a flow from pipe0 yields to a default-class flow and goes before a bulk-class flow."""
    nbytes = 3_000_000
    with EmulatedNetwork(
        4,
        rate_mbit=40,
        ranks_per_server=2,
        subnet="10.217.0.0/24",
        bulk_subnet="10.217.1.0/24",
        pipeline_subnet="10.217.2.0/24",
    ) as net:
        assert net.pipe_ips[1] == "10.217.2.2"
        t_default, t_pipe = _two_flows_through_server_0(net, nbytes, second=net.pipe_ips[1])
        assert t_pipe > 1.5 * t_default, f"pipeline not behind default: {t_pipe:.3f} s vs {t_default:.3f} s"
        t_pipe, t_bulk = _two_flows_through_server_0(net, nbytes, first=net.pipe_ips[0])
        assert t_pipe < 0.6 * 1.35, f"pipeline class slowed by the bulk flow: {t_pipe:.3f} s (alone ~0.6 s)"
        assert t_bulk > 1.5 * t_pipe, f"bulk not behind pipeline: {t_bulk:.3f} s vs {t_pipe:.3f} s"
        counts = net.class_bytes()["h0:nic"]
        assert counts["pipeline"] >= 2 * nbytes and counts["bulk"] >= nbytes and counts["default"] >= nbytes


def test_bad_options_are_rejected_with_clear_errors() -> None:
    with pytest.raises(NetemError, match="private"):
        EmulatedNetwork(2, subnet="8.8.8.0/24")
    with pytest.raises(NetemError, match="2x2"):
        EmulatedNetwork(2, pair_rate_mbit=[[0, 1, 2]])
    with pytest.raises(NetemError, match="one value per rank"):
        EmulatedNetwork(3, rate_mbit=[10, 20])
    with pytest.raises(NetemError, match="> 0"):
        EmulatedNetwork(2, rate_mbit=0)
    with pytest.raises(NetemError, match="ranks_per_server must be >= 1 and divide num_ranks \\(4\\), got 3"):
        EmulatedNetwork(4, ranks_per_server=3)
    with pytest.raises(NetemError, match=r"rate_mbit needs one value per server \(2\), got 4"):
        EmulatedNetwork(4, ranks_per_server=2, rate_mbit=[1, 2, 3, 4])
    with pytest.raises(NetemError, match="cannot be combined with ranks_per_server"):
        EmulatedNetwork(4, ranks_per_server=2, pair_rate_mbit=[[1] * 4] * 4)
    with pytest.raises(NetemError, match="apart from subnet"):
        EmulatedNetwork(2, subnet="10.9.0.0/16", bulk_subnet="10.9.1.0/24")
    with pytest.raises(NetemError, match="cannot be combined with pair_rate_mbit or delay_ms"):
        EmulatedNetwork(2, bulk_subnet="10.9.1.0/24", delay_ms=1)
    with pytest.raises(NetemError, match="bulk_lane_mbit needs bulk_subnet and must be > 0, got 5"):
        EmulatedNetwork(2, bulk_lane_mbit=5)
    with pytest.raises(NetemError, match="pipeline_subnet needs bulk_subnet .* got 10.9.2.0/24"):
        EmulatedNetwork(2, pipeline_subnet="10.9.2.0/24")
    with pytest.raises(NetemError, match="apart from subnet .* and bulk_subnet"):
        EmulatedNetwork(2, bulk_subnet="10.9.1.0/24", pipeline_subnet="10.9.1.0/25")
    with pytest.raises(NetemError, match="needs priority classes"):
        EmulatedNetwork(2).class_bytes()
    for bad in (
        {"switch_buffer_kb": 0},
        {"switch_buffer_kb": 64, "shape_downlink": False},
        {"switch_buffer_kb": 64, "bulk_subnet": "10.9.1.0/24"},
        {"switch_buffer_kb": 64, "pair_rate_mbit": [[0, 1], [1, 0]]},
    ):
        with pytest.raises(
            NetemError, match=f"switch_buffer_kb must be > 0 .* got {bad['switch_buffer_kb']}"
        ):
            EmulatedNetwork(2, rate_mbit=10, **bad)


@pytest.mark.skipif(
    shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"
)
def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetemError, match="needs root"):
        EmulatedNetwork(2).up()


def test_hermod_real_variants_name_their_wire_level_and_reject_unknown_ones() -> None:
    """benchmarks/hermod_real.py: wire=0/1/2 parse (2 = all-to-alls in their MID class too); anything else is named."""
    from benchmarks.hermod_real import _parse_variant

    v = _parse_variant("chunk_bytes=65536,wire=2")
    assert v["chunk_bytes"] == 65536 and v["wire"] == 2 and v["max_inflight_chunks"] == 1
    with pytest.raises(ValueError, match="wire=3 is not one of 0"):
        _parse_variant("wire=3")
    with pytest.raises(ValueError, match="unknown variant key 'lanes'"):
        _parse_variant("lanes=2")
    assert _parse_variant("ep_algorithm=plain")["ep_algorithm"] == "plain"  # an A/B of the matched all-to-all
    from benchmarks.hermod_real import EP_ALGORITHMS
    from flowlane.hermod.matching import RUN_ALGORITHMS

    assert RUN_ALGORITHMS == EP_ALGORITHMS  # the benchmark's literal copy stays in step with the core
    import inspect

    from benchmarks.hermod_real import AUTO_CANDIDATES, AUTO_PROBE_ITERATIONS
    from flowlane.hermod.matching import AUTO_CANDIDATES as CORE_CANDIDATES
    from flowlane.sched.alltoall import AllToAllRunner

    assert AUTO_CANDIDATES.split("+") == list(CORE_CANDIDATES)
    assert inspect.signature(AllToAllRunner).parameters["probe_iterations"].default == AUTO_PROBE_ITERATIONS
    assert _parse_variant("ep_algorithm=auto")["ep_algorithm"] == "auto"
    with pytest.raises(
        ValueError,
        match=r"ep_algorithm=bvm is not one of \['bvn', 'bvn_bottleneck', 'alg3', 'plain', "
        r"'auto'\]",
    ):
        _parse_variant("ep_algorithm=bvm")
    from benchmarks.hermod_real import _wrap

    label = "hermod\nc128k i1 g50ms\na2a=auto\n(plain+bvn+alg3)"
    assert _wrap("hermod c128k i1 g50ms a2a=auto(plain+bvn+alg3)") == label
    v = _parse_variant("ep_algorithm=auto,ep_auto_candidates=plain+bvn+alg3")
    assert v["ep_auto_candidates"] == "plain+bvn+alg3"
    for bad, msg in (
        ("ep_algorithm=auto,ep_auto_candidates=plain", "must be two or more distinct names"),
        ("ep_algorithm=auto,ep_auto_candidates=plain+auto", "must be two or more distinct names"),
        ("ep_auto_candidates=plain+bvn", "needs ep_algorithm=auto"),
        ("ep_auto_probe_iterations=3", "needs ep_algorithm=auto"),
        ("ep_algorithm=auto,ep_auto_probe_iterations=0", "ep_auto_probe_iterations=0 must be >= 1"),
    ):
        with pytest.raises(ValueError, match=msg):
            _parse_variant(bad)


def test_hermod_real_megatron_workload_flags_and_bad_combinations(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--workload megatron: baselines are Megatron flags, Hermod runs on the distributed optimizer (wire=1 puts its
    bulk class on bulk0); combinations it cannot run are named before anything is set up (root not needed)."""
    from benchmarks.hermod_real import MEGATRON_BASELINES, main, megatron_flags, rank_slots

    assert megatron_flags({"megatron": MEGATRON_BASELINES["fifo"]}) == {
        "distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    }
    h = megatron_flags({"mode": "hermod", "chunk_bytes": 4096, "max_inflight_chunks": 1, "wire": 1})
    assert h["distributed_optimizer"] is True
    # the synthetic workload's chunk size has no Megatron counterpart (a bucket group is never split)
    assert h["features"]["scheduler"] == {
        "name": "hermod",
        "max_inflight_buckets": 1,
        "gloo_class_ifnames": "eth0,eth0,bulk0",
    }
    assert "gloo_class_ifnames" not in megatron_flags({"mode": "hermod", "wire": 0})["features"]["scheduler"]
    # on the shared NIC Megatron's PP groups ({0,2},{1,3}) are placed in one server each; the synthetic ones already are
    slots = rank_slots(True, "shared-nic")
    server = [slots[r] // 2 for r in range(4)]  # slots {0,1} and {2,3} are the fabric's servers
    assert server[0] == server[2] != server[1] == server[3]  # PP {0,2},{1,3} inside; DP {0,1},{2,3} across
    assert rank_slots(True, "per-rank") == rank_slots(False, "shared-nic") == [0, 1, 2, 3]
    for argv, msg in (
        (["--megatron-moe"], "--megatron-moe needs --workload megatron"),
        (["--workload", "megatron", "--baselines", "lina"], r"unknown \['lina'\] for --workload megatron"),
        (["--workload", "megatron", "--variant", "wire=2"], "wire=2 .* needs the synthetic"),
        (
            ["--workload", "megatron", "--param-elems", "65536"],
            "--param-elems / --act-elems size the synthetic",
        ),
        (["--act-elems", "100"], "--act-elems a multiple of 64 .* got 2, 100 and 262144"),
        (["--variant", "ep_algorithm=auto"], "with ep_algorithm=auto >= 2 .* >= 6 here; got 3"),
        (
            ["--iterations", "7", "--variant", "ep_algorithm=auto,ep_auto_candidates=plain+bvn+alg3"],
            ">= 8 here; got 7",
        ),
        (
            ["--iterations", "9", "--variant", "ep_algorithm=auto,ep_auto_probe_iterations=4"],
            ">= 10 here; got 9",
        ),
        (["--iterations", "1"], "--iterations must be >= 2 .* got 1"),
        (
            ["--workload", "megatron", "--variant", "ep_algorithm=auto"],
            "ep_algorithm=auto and --iterations need the synthetic workload",
        ),
        (["--layers-per-stage", "0"], "--layers-per-stage must be >= 1"),
    ):
        monkeypatch.setattr(sys, "argv", ["hermod_real", *argv])
        with pytest.raises(SystemExit):
            main()
        assert re.search(msg, capsys.readouterr().err), argv


def test_hermod_real_reports_auto_probe_apart_from_the_steady_iterations() -> None:
    """ep_algorithm=auto: the summary carries each round's choice, the probe's summed seconds and its iterations
    (max over ranks); steady per-iteration times and op rates count only the iterations after the probe."""
    from benchmarks.hermod_real import summarise

    def rank(stage: int, probe: list[float]) -> dict:
        auto = {
            "choice": "bvn",
            "probe_seconds": {"plain": 9.0, "bvn": 7.0},
            "probe_iterations": 2,
            "probe_iteration_times": probe,
        }
        ops = [{"ep": {"median_s": 0.1, "sum_s": 1.0, "bytes_sent": 10}}]
        return {
            "fifo": {"times": [2.0, 2.2], "digest": 1.0, "ops": ops, "stage": stage},
            "auto": {"times": [1.5, 1.7], "digest": 1.0, "ops": ops, "stage": stage, "ep_auto": [auto]},
        }

    s = summarise([rank(0, [1.9, 1.4, 2.0, 1.5]), rank(1, [1.8, 1.6, 2.1, 1.4])], {"fifo": {}, "auto": {}})
    assert s["ep_auto"] == {
        "auto": [
            {
                "choice": "bvn",
                "probe_seconds_all_ranks": {"plain": 9.0, "bvn": 7.0},
                "probe_iteration_times": [1.9, 1.6, 2.1, 1.5],
            }
        ]
    }
    assert s["per_iter"]["auto"] == [1.5, 1.7] and s["speedup"]["auto"] == pytest.approx(2.1 / 1.6)
    # 1 s over 2 steady its
    assert s["ops"]["auto"]["stage0"]["ep"]["op_time_per_iter_s"] == pytest.approx(0.5)


def test_hermod_real_star_fabric_and_more_ranks_are_checked_before_any_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fabric star (shallow switch buffers, no classes) and --ranks 8 (EP groups of four): what cannot run together
    is named before anything is set up; the baselines' all-to-all is the plain one (NCCL's), Hermod's the matched
    one; digests are compared to rounding as well as bit for bit."""
    from benchmarks.hermod_real import BASELINES, FIFO, _rel_diff, main, rank_slots

    assert FIFO["ep_algorithm"] == "plain" and all(b["ep_algorithm"] == "plain" for b in BASELINES.values())
    assert rank_slots(False, "star", 8) == list(range(8))
    assert _rel_diff([2.0, [1.0, 4.0]], [2.0, [1.0, 5.0]]) == pytest.approx(0.2)
    assert _rel_diff(3.0, 3.0) == 0.0
    for argv, msg in (
        (["--ranks", "6", "--fabric", "shared-nic"], "--ranks must be an even number >= 4 .* got 6"),
        (["--ranks", "5"], "got 5"),
        (["--ranks", "8", "--workload", "megatron"], "4 with --workload megatron"),
        (["--fabric", "star"], "--fabric star needs it"),
        (["--switch-buffer-kb", "64"], "--switch-buffer-kb goes with --fabric star"),
        (
            ["--fabric", "star", "--switch-buffer-kb", "64", "--variant", "wire=1"],
            "--fabric star has no priority classes",
        ),
        (["--pp", "1", "--fabric", "shared-nic"], "--pp 1 needs the synthetic workload on per-rank"),
        (["--pp", "3"], "invalid choice: 3"),
    ):
        monkeypatch.setattr(sys, "argv", ["hermod_real", *argv])
        with pytest.raises(SystemExit):
            main()
        assert re.search(msg, capsys.readouterr().err), argv


def test_hermod_real_rate_sweep_parses_rates_and_compares_within_each_rate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--rate-mbit 100,400: one run per rate, speedups taken within a rate (each rate's own medians); bad rates are
    named before anything is set up."""
    from benchmarks.hermod_real import _parse_rates, _plot_sweep, main, rate_sweep, split_detail

    assert _parse_rates("400,100") == [100.0, 400.0]
    for bad, msg in (
        ("fast", "a rate or a comma-separated list"),
        ("100,0", "must be > 0"),
        ("100,100", "distinct"),
    ):
        with pytest.raises(ValueError, match=msg):
            _parse_rates(bad)
    monkeypatch.setattr(sys, "argv", ["hermod_real", "--rate-mbit", "100,-5"])
    with pytest.raises(SystemExit):
        main()
    assert "'100,-5'" in capsys.readouterr().err

    def doc(fifo: float, meg: float, h: float) -> dict:
        med = {"fifo": fifo, "megatron": meg, "hermod x": h}
        return {
            "workload_kind": "megatron",
            "workload": {},
            "rounds": 2,
            "goal": ">= 1.15x",
            "variants": {m: {} for m in med},
            "median_iteration_time_s": med,
            "math_identical": dict.fromkeys(med, True),
            "goal_met": min(fifo, meg) / h >= 1.15,
            "speedup_best_hermod_vs_baseline": {"fifo": fifo / h, "megatron": meg / h},
            "wall_s": 1.0,
        }

    sw = rate_sweep({400.0: doc(0.6, 0.5, 0.4), 100.0: doc(2.0, 1.5, 1.4)}, ["megatron"])
    assert sw["rates_mbit"] == [100.0, 400.0]
    assert sw["speedup_vs_baseline"]["megatron"]["hermod x"] == {"100": 1.5 / 1.4, "400": 0.5 / 0.4}
    assert sw["speedup_vs_baseline"]["fifo"]["megatron"] == {"100": 2.0 / 1.5, "400": 0.6 / 0.5}
    assert sw["goal_met_at"] == {"100": False, "400": True} and sw["math_identical"] is True
    assert sw["wall_s"] == 2.0
    _plot_sweep(sw, tmp_path / "sweep.png", "t")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    # per-rank timelines leave the summary for its .detail.json.gz sidecar, in every point of a sweep too
    sw["points"]["100"]["timeline_last_iteration"] = {"fifo": [[["dp", 0.0, 1.0]]]}
    summary, detail = split_detail(sw)
    assert "timeline_last_iteration" not in summary["points"]["100"] and summary["rates_mbit"] == [
        100.0,
        400.0,
    ]
    assert detail == {"points": {"100": {"timeline_last_iteration": {"fifo": [[["dp", 0.0, 1.0]]]}}}}
    assert split_detail(sw["points"]["400"]) == (sw["points"]["400"], {})
