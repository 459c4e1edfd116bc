"""ALEPH tier 1: the userspace UDP aggregator (C) delivers exact sums under injected loss and refuses bad packets."""

import json
import re
import select
import socket
import subprocess
import time

import numpy as np
import pytest

from flowlane.aleph import Plan
from flowlane.aleph import wire as W
from flowlane.aleph.model import multi_ps_split
from flowlane.aleph.udp import SRC_DIR, build, run_tree, split_bounds

pytestmark = pytest.mark.once

PLAN = Plan.from_clusters(6, [[0, 1, 2], [3, 4], [5]])  # two aggregators and a worker that goes direct


def test_python_header_matches_the_c_header():
    text = (SRC_DIR / "include" / "aleph_wire.h").read_text()
    defines = {
        k: int(v.rstrip("u"), 0) for k, v in re.findall(r"#define (ALEPH_\w+) (0x[0-9A-Fa-f]+u?|\d+u?)", text)
    }
    assert defines == {
        "ALEPH_MAGIC": W.MAGIC,
        "ALEPH_VERSION": W.VERSION,
        "ALEPH_SEG_ELEMS": W.SEG_ELEMS,
        "ALEPH_MAX_CHILDREN": W.MAX_CHILDREN,
        "ALEPH_NACK_SPAN": W.NACK_SPAN,
    }
    start = text.index("struct __attribute__((packed)) aleph_hdr {")
    body = text[start : text.index("};", start)]
    ctypes = re.findall(r"^\s+(u?int\d+)_t (\w+);", body, re.M)
    codes = {"uint8": "B", "int8": "b", "uint16": "H", "uint32": "I"}
    assert "<" + "".join(codes[t] for t, _ in ctypes) == W.HEADER.format and W.HEADER.size == 24
    assert dict(re.findall(r"ALEPH_(\w+) = (\d)", text)) == {
        "DATA": "1",
        "RESULT": "2",
        "NACK": "3",
        "RETX": "4",
    }


def test_fixed_point_has_log2_n_headroom_and_round_trips():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 8, 9, 100):
        x = rng.standard_normal((n, 512)) * 3.7
        k = W.scale_exponent(float(np.abs(x).max()), n)
        q = np.stack([W.encode(r, k) for r in x]).astype(np.int64)
        assert np.abs(q.sum(0)).max() < 2**31 and np.abs(q).max() <= 2 ** (30 - int(np.ceil(np.log2(n))))
        assert np.abs(W.decode(q.sum(0), k) - x.sum(0)).max() <= n * 2.0 ** -(k + 1)
    with pytest.raises(ValueError, match="do not fit int32"):
        W.encode(np.array([1e9]), 10)
    with pytest.raises(ValueError, match="max_abs=nan"):
        W.scale_exponent(float("nan"), 4)


@pytest.mark.parametrize("drop", [0.0, 0.001, 0.01])
def test_udp_tree_sums_exactly_under_loss_without_double_counting(drop):
    rng = np.random.default_rng(1)
    x = rng.integers(-(2**27), 2**27, size=(6, 4, 40 * 128 + 77), dtype=np.int64).astype(np.int32)
    run = run_tree(PLAN, x, drop=drop, seed=3, rto_ms=15)
    want = x.astype(np.int64).sum(0)
    # every worker, every iteration
    assert np.array_equal(run.outputs, np.broadcast_to(want, run.outputs.shape))
    every = [s for role in run.stats.values() for s in role]
    assert all(s["overflow"] == 0 and sum(s["bad"].values()) == 0 for s in every)
    if drop >= 0.01:  # loss really happened and was repaired (the seeds make this deterministic enough)
        assert sum(s["injected_drops"] for s in every) > 0
        assert sum(s["nacks"] for s in every) > 0


@pytest.mark.parametrize(
    "split,drop",
    [((0.6, 0.4), 0.01), (tuple(multi_ps_split([300, 150, 100])), 0.0), ((1.0, 0.0), 0.0)],
    ids=["uneven-2ps-loss", "proportional-3ps", "empty-part"],
)
def test_udp_tree_with_several_ps_splits_every_aggregator_sum_and_sums_exactly(split, drop):
    """Seed Sec. 7 in tier 1: PS j gets part j (split[j] of the values) of every aggregator's sum; every worker ends
    with the whole sum, exactly, and each PS saw exactly its part's packets."""
    rng = np.random.default_rng(7)
    elems, iters = 30 * 128 + 5, 2
    x = rng.integers(-(2**27), 2**27, size=(6, iters, elems), dtype=np.int64).astype(np.int32)
    run = run_tree(PLAN, x, drop=drop, seed=5, rto_ms=15, split=split)
    want = x.astype(np.int64).sum(0)
    assert np.array_equal(run.outputs, np.broadcast_to(want, run.outputs.shape))
    b = split_bounds(elems, split)
    parts = [j for j in range(len(split)) if b[j + 1] > b[j]]
    assert [s["part"] for s in run.stats["ps"]] == parts  # one PS per non-empty part
    every = [s for role in run.stats.values() for s in role]
    assert all(s["overflow"] == 0 and sum(s["bad"].values()) == 0 for s in every)
    for ps in run.stats["ps"]:
        j = ps["part"]
        nseg = -(-(b[j + 1] - b[j]) // W.SEG_ELEMS)
        # |D| = 3 flows (two aggregators, worker 5 direct) into each PS, its part's segments only: each added once
        assert ps["data_rx"] - ps["dup"] == 3 * nseg * iters
    if drop:
        assert sum(s["injected_drops"] for s in every) > 0


def test_several_ps_bad_splits_are_refused():
    x = np.zeros((6, 1, 10), np.int32)
    for bad in ([0.5, 0.6], [1.2, -0.2], []):
        with pytest.raises(ValueError, match=r"must have one fraction in \[0, 1\] per PS, summing to 1"):
            run_tree(PLAN, x, split=bad)
    with pytest.raises(ValueError, match="has 1 addresses for 2 PSs"):
        run_tree(PLAN, x, split=[0.5, 0.5], ps_hosts=["127.0.0.1"])
    assert split_bounds(10, [0.6, 0.4]) == [0, 6, 10] and split_bounds(7, [1.0, 0.0]) == [0, 7, 7]


def test_float_gradients_through_fixed_point_match_the_float_sum():
    rng = np.random.default_rng(2)
    g = rng.standard_normal((6, 1, 1000)).astype(np.float32)
    k = W.scale_exponent(float(np.abs(g).max()), 6)
    q = np.stack([W.encode(r, k) for r in g])
    run = run_tree(PLAN, q, scale=k)
    np.testing.assert_allclose(
        W.decode(run.outputs[0, 0], k), g[:, 0].astype(np.float64).sum(0), atol=6 * 2.0**-k
    )


def test_bad_packets_are_dropped_and_counted_by_reason():
    exe = str(build(sanitize=True))  # ASan + UBSan: a bounds slip would abort the node
    node = subprocess.Popen(
        [
            exe,
            "node",
            "--children",
            "2",
            "--elems",
            "200",
            "--iters",
            "1",
            "--linger-ms",
            "200",
            "--max-idle-ms",
            "20000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None
        port = int(node.stdout.readline().split()[1])
        a, b = (
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
        )
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.settimeout(10)
        to = ("127.0.0.1", port)
        seg0 = np.arange(128, dtype=np.int32)
        bad = {
            "len": b"\x01\x02",
            "magic": W.pack(W.DATA, 1, 0, seg0, magic=0xBEEF),
            "version": W.pack(W.DATA, 1, 0, seg0, version=9),
            "type": W.pack(7, 1, 0, seg0),
            "job": W.pack(W.DATA, 1, 0, seg0, job=5),
            "src": W.pack(W.DATA, 1, 0, seg0, src=2),  # only children 0 and 1 exist
            "seg": W.pack(W.DATA, 1, 2, seg0),  # 200 elements: segments 0 and 1
            "count": W.pack(W.DATA, 1, 1, seg0),  # segment 1 holds 72 values, not 128
            "flags": W.pack(W.DATA, 1, 0, seg0, flags=1),
            "iter": W.pack(W.DATA, 2, 0, seg0),  # --iters 1
        }
        bad["len2"] = W.pack(W.DATA, 1, 0, seg0[:100], count=128)  # count says 128, the datagram carries 100
        for pkt in bad.values():
            a.sendto(pkt, to)
        segs = [np.arange(128, dtype=np.int32), np.arange(72, dtype=np.int32) * -3]
        for src, sock in ((0, a), (1, b)):
            for sg, v in enumerate(segs):
                sock.sendto(W.pack(W.DATA, 1, sg, v * (src + 1), src=src, scale=4), to)
        a.sendto(W.pack(W.DATA, 1, 0, segs[0], src=0, scale=4), to)  # a duplicate: must not be added twice
        b.sendto(W.pack(W.DATA, 1, 1, segs[1], src=0, scale=4), to)  # child 0's id from another address
        # another fixed-point scale this iteration
        a.sendto(W.pack(W.DATA, 1, 1, segs[1], src=0, scale=5), to)
        got = {}
        while len(got) < 2:
            fields, vals = W.unpack(a.recv(2048))
            assert fields[2] == W.RESULT and fields[8] == 4  # type, scale
            got[fields[6]] = vals
        assert np.array_equal(got[0], segs[0] * 3) and np.array_equal(got[1], segs[1] * 3)
        out, err = node.communicate(timeout=30)
    finally:
        if node.poll() is None:
            node.kill()
    assert node.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["bad"] == {
        "len": 2,
        "magic": 1,
        "version": 1,
        "type": 1,
        "job": 1,
        "src": 1,
        "seg": 1,
        "count": 1,
        "scale": 1,
        "flags": 1,
        "addr": 1,
        "iter": 1,
    }
    assert stats["dup"] == 1


def test_an_aggregator_keeps_asking_its_parent_while_its_children_keep_asking_it():
    """A parent that misses a few NACK rounds (busy, lossy) must still be asked again. The children's own NACKs reach
    the aggregator every 100 ms; they are packets, not progress, so they must not hold off its NACKs upward, whose wait
    backs off 50, 100, 200, 400, 800 ms. The parent ignores the first four and answers the fifth. Before the fix the
    aggregator counted any packet as activity: once its wait passed 100 ms it never asked again, and the workers gave
    up."""
    exe = str(build(sanitize=True))
    parent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    parent.bind(("127.0.0.1", 0))
    up = f"127.0.0.1:{parent.getsockname()[1]}"
    opts = ["--elems", "256", "--iters", "1", "--rto-ms", "50", "--linger-ms", "200"]
    node = subprocess.Popen(
        [exe, "node", "--children", "2", "--parent", up, "--id", "0", *opts, "--max-idle-ms", "60000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        assert node.stdout is not None
        to = ("127.0.0.1", int(node.stdout.readline().split()[1]))
        for src, child in enumerate(children):
            child.bind(("127.0.0.1", 0))
            for seg in (0, 1):
                child.sendto(W.pack(W.DATA, 1, seg, np.full(128, src + 1, np.int32), src=src), to)
        sums: dict[int, np.ndarray] = {}
        nacks_up = 0
        result0 = None
        next_child_nack = 0.0
        deadline = time.monotonic() + 30  # a bound against a hang, not a timing assertion
        while result0 is None and time.monotonic() < deadline:
            # "segment 0, please", as a worker that backed off to 100 ms
            if time.monotonic() >= next_child_nack:
                children[0].sendto(W.pack(W.NACK, 1, 0, src=0, bitmap=1), to)
                next_child_nack = time.monotonic() + 0.1
            readable, _, _ = select.select([parent, children[1]], [], [], 0.02)
            if parent in readable:
                pkt, addr = parent.recvfrom(2048)
                fields, vals = W.unpack(pkt)
                if fields[2] == W.DATA:  # a cluster sum: answer segment 1, withhold segment 0
                    sums[fields[6]] = vals
                    if fields[6] == 1:
                        parent.sendto(W.pack(W.RESULT, 1, 1, vals), addr)
                elif fields[2] == W.NACK and 0 in sums:
                    nacks_up += 1
                    if nacks_up == 5:
                        parent.sendto(W.pack(W.RESULT, 1, 0, sums[0]), addr)
            if children[1] in readable:
                fields, vals = W.unpack(children[1].recv(2048))
                if fields[2] == W.RESULT and fields[6] == 0:
                    result0 = vals
        out, err = node.communicate(timeout=30)
    finally:
        if node.poll() is None:
            node.kill()
        for sock in (parent, *children):
            sock.close()
    assert nacks_up >= 5, f"the aggregator asked its parent {nacks_up} times, then fell silent"
    assert result0 is not None and np.array_equal(result0, np.full(128, 3, np.int32))
    assert node.returncode == 0, err


def test_bad_command_lines_name_the_value():
    exe = str(build())
    r = subprocess.run(
        [exe, "node", "--children", "40", "--elems", "10", "--iters", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "--children=40 must be an integer in [1, 32]" in r.stderr
    r = subprocess.run(
        [
            exe,
            "worker",
            "--parent",
            "nohost:1",
            "--id",
            "0",
            "--elems",
            "1",
            "--iters",
            "1",
            "--in",
            "x",
            "--out",
            "y",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "nohost is not an IPv4 address" in r.stderr
    xdp = [
        exe,
        "node",
        "--children",
        "2",
        "--parent",
        "127.0.0.1:9",
        "--elems",
        "1",
        "--iters",
        "1",
        "--xdp",
        "1",
    ]
    r = subprocess.run([*xdp, "--child-addrs", "127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--child-addrs with --children=2 addresses, got 127.0.0.1:1" in r.stderr
    r = subprocess.run([*xdp, "--child-addrs", "127.0.0.1:1,h:2"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "h is not an IPv4 address" in r.stderr
