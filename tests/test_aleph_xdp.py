"""ALEPH tier 2: the XDP aggregator, run in the kernel with BPF_PROG_TEST_RUN (exact sums, the completing packet sent
up to the parent, duplicates, malformed packets and DATA from a source other than the child id's dropped and
counted), then attached to a live veth in network namespaces, aggregating tier-1 workers' DATA for tier 1's PS (exact
sums, malformed and spoofed packets dropped and counted on the live path, recovery when the PS loses an aggregated
packet). Skips with the reason where clang/libbpf are missing, the kernel refuses the program or it cannot attach, or
namespaces cannot be made; tiers 0 and 1 have their own tests."""

import dataclasses
import random
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from flowlane.aleph import Plan
from flowlane.aleph import wire as W
from flowlane.aleph import xdp as X

pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def needs_xdp() -> None:
    """Skip with the reason where the tier cannot build or load (checked when a test needs it, not at collection)."""
    reason = X.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


CFG = X.XdpConfig(
    port=9000, job=7, iters=3, elems=300, children=3, my_id=2, parent_ip="10.0.0.1", parent_port=9100
)
NSEG = 3  # 300 values: segments of 128, 128, 44


def _seg(seg: int) -> slice:
    return slice(seg * W.SEG_ELEMS, min(CFG.elems, (seg + 1) * W.SEG_ELEMS))


def _data(it: int, seg: int, src: int, vals: np.ndarray, **kw) -> bytes:
    return X.frame(W.pack(W.DATA, it, seg, vals, job=CFG.job, src=src, **kw), src_ip=f"10.0.0.{10 + src}")


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (install-xdp-deps.sh)")
def test_the_bpf_object_builds_for_the_bpf_target():
    try:
        obj, _ = X.build()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    head = obj.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and struct.unpack("<H", head[18:20])[0] == 247  # EM_BPF


def test_xdp_sums_exactly_sends_the_sum_up_and_refuses_duplicates(needs_xdp):
    rng = np.random.default_rng(1)
    x = rng.integers(-(2**20), 2**20, size=(CFG.iters, CFG.children, CFG.elems), dtype=np.int32)
    # expect: (iteration, segment) completed by this frame (or sent up again), None (added), "dup" (refused)
    frames, expect = [], []
    order = random.Random(3)
    for it in range(1, CFG.iters + 1):
        pkts = [(seg, c) for seg in range(NSEG) for c in range(CFG.children)]
        order.shuffle(pkts)
        seen: dict[int, int] = {}
        for i, (seg, c) in enumerate(pkts):
            frames.append(_data(it, seg, c, x[it - 1, c, _seg(seg)]))
            seen[seg] = seen.get(seg, 0) + 1
            done = seen[seg] == CFG.children
            expect.append((it, seg) if done else None)
            if i % 4 == 1:  # a resent copy: never added twice; on a complete segment the sum goes up again
                frames.append(_data(it, seg, c, x[it - 1, c, _seg(seg)]))
                expect.append(("again", it, seg) if done else "dup")
    run = X.run_frames(frames, CFG)
    sums = x.astype(np.int64).sum(1)
    ups = 0
    for v, out, e in zip(run.verdicts, run.out, expect, strict=True):
        if e is None or e == "dup":
            assert v == "DROP"
            continue
        it, seg = e[-2:]
        assert v == "TX"
        ups += 1
        f = X.parse_frame(out)
        assert (f["dst_ip"], f["dport"], f["dst_mac"]) == (CFG.parent_ip, CFG.parent_port, CFG.parent_mac)
        assert (f["src_ip"], f["sport"], f["src_mac"]) == ("10.0.0.3", CFG.port, "02:00:00:00:00:03")
        assert f["ip_checksum_ok"]
        (magic, ver, typ, job, src, iteration, segment, bitmap, _, flags, count), vals = W.unpack(
            f["payload"]
        )
        assert (typ, job, src, iteration, segment, bitmap, flags) == (W.DATA, 7, 2, it, seg, 1 << 2, 0)
        assert count == len(vals) == _seg(seg).stop - _seg(seg).start
        assert np.array_equal(vals, sums[it - 1, _seg(seg)])  # exact; each child added once
    c = run.counters
    again = sum(isinstance(e, tuple) and e[0] == "again" for e in expect)
    assert ups == c["tx_up"] == CFG.iters * NSEG + again and c["resent_up"] == again > 0
    assert c["added"] == CFG.iters * NSEG * CFG.children
    assert c["dup"] == expect.count("dup") > 0
    assert sum(v for k, v in c.items() if k.startswith("bad_")) == 0 and c["overflow"] == 0


def test_xdp_drops_and_counts_every_malformed_field(needs_xdp):
    v = np.ones(128, np.int32)
    good = dict(job=CFG.job, src=0)
    cases = {  # reason -> a frame that has exactly that fault
        "bad_magic": X.frame(W.pack(W.DATA, 1, 0, v, magic=0x1234, **good)),
        "bad_version": X.frame(W.pack(W.DATA, 1, 0, v, version=9, **good)),
        "bad_type": X.frame(W.pack(9, 1, 0, v, **good)),
        "bad_job": X.frame(W.pack(W.DATA, 1, 0, v, job=8, src=0)),
        "bad_flags": X.frame(W.pack(W.DATA, 1, 0, v, flags=1, **good)),
        "bad_iter": X.frame(W.pack(W.DATA, CFG.iters + 1, 0, v, **good)),
        "bad_src": X.frame(W.pack(W.DATA, 1, 0, v, job=CFG.job, src=CFG.children)),
        "bad_seg": X.frame(W.pack(W.DATA, 1, NSEG, v, **good)),
        "bad_count": X.frame(W.pack(W.DATA, 1, 2, v, **good)),  # segment 2 has 44 values
        "bad_len": X.frame(W.pack(W.DATA, 1, 0, v[:127], count=128, **good)),  # count 128, 127 values sent
    }
    short = X.frame(W.pack(W.DATA, 1, 0, v, **good))
    frames = [*cases.values(), short[:60], X.frame(W.pack(W.DATA, 1, 0, v, **good), udp_len=2000)]
    # a second scale in one slot's iteration; a stale iteration (slot still on 1); a second bit in a DATA bitmap
    frames += [
        X.frame(W.pack(W.DATA, 1, 1, v, scale=3, **good)),
        X.frame(W.pack(W.DATA, 1, 1, v, scale=4, job=CFG.job, src=1)),
        X.frame(W.pack(W.DATA, 2, 1, v, job=CFG.job, src=2)),
        X.frame(W.pack(W.DATA, 1, 0, v, job=CFG.job, src=1, bitmap=0b11)),
    ]
    # not the program's: another UDP port, and a RESULT (fan-out stays in userspace) -> the stack
    frames += [
        X.frame(W.pack(W.DATA, 1, 0, v, **good), dport=9001),
        X.frame(W.pack(W.RESULT, 1, 0, v, job=7)),
    ]
    run = X.run_frames(frames, CFG)
    assert run.verdicts == ["DROP"] * (len(frames) - 2) + ["PASS", "PASS"]
    c = run.counters
    want = {k: 1 for k in cases}
    want["bad_len"] += 2  # the cut frame and the UDP length beyond the frame
    want["bad_scale"], want["stale"], want["bad_src"] = 1, 1, 2
    assert {k: c[k] for k in want} == want
    assert c["added"] == 1 and c["tx_up"] == 0 and c["pass"] == 1  # only the first scale-3 packet was added


def test_xdp_pins_each_child_id_to_its_source_address(needs_xdp):
    """As tier 1's node: a DATA for a valid child id from another source (IPv4 address or UDP port) than the id's is
    dropped and counted as bad_addr, never added; the id's source is pinned by its first valid DATA, or given by the
    loader (then a spoofer that comes first is refused too)."""
    cfg = dataclasses.replace(CFG, iters=1, elems=128)
    rng = np.random.default_rng(2)
    x = rng.integers(-(2**20), 2**20, size=(3, 128), dtype=np.int32)
    spoof = np.full(128, 1 << 20, np.int32)
    ips = [f"10.0.0.{10 + c}" for c in range(3)]

    def d(src: int, vals: np.ndarray, ip: str, sport: int = 9001, **kw) -> bytes:
        return X.frame(W.pack(W.DATA, 1, 0, vals, job=cfg.job, src=src, **kw), src_ip=ip, sport=sport)

    def check(run: X.XdpRun, n_spoofed: int) -> None:
        assert run.verdicts == ["DROP"] * (len(run.verdicts) - 1) + ["TX"]
        vals = W.unpack(X.parse_frame(run.out[-1])["payload"])[1]
        assert np.array_equal(vals, x.astype(np.int64).sum(0))  # the honest children's sum, exactly
        c = run.counters
        assert c["bad_addr"] == n_spoofed and c["added"] == 3 and c["tx_up"] == 1 and c["dup"] == 0

    # pinned by the first valid DATA (child 0's); a malformed packet pins nothing (child 2's id stays free)
    pinned = [
        d(0, x[0], ips[0]),
        d(0, spoof, "10.0.0.66"),  # another host
        d(0, spoof, ips[0], sport=9002),  # the child's host, another port
        d(2, spoof[:127], "10.0.0.66", count=128),  # bad_len: checked before the source
        d(1, x[1], ips[1]),
        d(2, x[2], ips[2]),
    ]
    run = X.run_frames(pinned, cfg)
    check(run, 2)
    assert run.counters["bad_len"] == 1
    # given by the loader (the relay's --child-addrs): the spoofed copies arrive before any honest DATA
    given = dataclasses.replace(cfg, child_addrs=tuple(f"{ip}:9001" for ip in ips))
    first = [
        d(1, spoof, "10.0.0.66"),
        d(1, spoof, ips[1], sport=9002),
        *(d(c, x[c], ips[c]) for c in range(3)),
    ]
    check(X.run_frames(first, given), 2)
    with pytest.raises(RuntimeError, match="--child-addrs=10.0.0.10:9001,10.0.0.11:9001 needs"):
        X.run_frames([], dataclasses.replace(given, child_addrs=given.child_addrs[:2]))


# ---------------------------------------------------------------------------------------- attached to a live veth

# one XDP aggregator (3 children) and a worker direct to the PS
LIVE_PLAN = Plan.from_clusters(4, [[0, 1, 2], [3]])


@pytest.fixture(scope="module")
def live_net():
    """Namespaces for LIVE_PLAN's tree (PS, aggregator, 4 workers) on one bridge; skips with the reason."""
    from flowlane.testing.netem import EmulatedNetwork, unavailable_reason

    reason = X.unavailable_reason() or unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with EmulatedNetwork(X.live_nodes(LIVE_PLAN), subnet="10.233.0.0/24", prefix="alxdp") as net:
        yield net


def _send_from(ns: str, dst: tuple[str, int], payloads: list[bytes]) -> None:
    """Send raw UDP datagrams from inside namespace ``ns`` (the sender of a malformed packet)."""
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "for h in sys.argv[3:]: s.sendto(bytes.fromhex(h), (sys.argv[1], int(sys.argv[2])))\n"
    )
    argv = [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        "-c",
        code,
        dst[0],
        str(dst[1]),
        *(p.hex() for p in payloads),
    ]
    subprocess.run(argv, check=True, timeout=30)


def _live(net, x: np.ndarray, **kw) -> X.LiveRun:
    try:
        return X.run_live_tree(LIVE_PLAN, x, net, timeout_s=90, **kw)
    except X.XdpUnavailable as e:
        pytest.skip(f"the XDP program cannot attach to a veth here: {e}")


@pytest.mark.parametrize("mode", ["auto", "skb"])
def test_xdp_on_a_live_veth_sums_exactly_and_drops_malformed_and_spoofed_packets(live_net, mode):
    rng = np.random.default_rng(5)
    iters, elems = 3, 5 * W.SEG_ELEMS + 44
    x = rng.integers(-(2**24), 2**24, size=(4, iters, elems), dtype=np.int32)
    bad = {  # sent by worker 1 to the aggregator's port before the workers start: each dropped in the kernel
        "bad_magic": W.pack(W.DATA, 1, 0, np.ones(128, np.int32), magic=0xBEEF, src=1),
        "bad_src": W.pack(W.DATA, 1, 0, np.ones(128, np.int32), src=3),  # the aggregator has children 0..2
        "bad_count": W.pack(W.DATA, 1, 5, np.ones(128, np.int32), src=1),  # segment 5 holds 44 values
        "bad_len": W.pack(W.DATA, 1, 0, np.ones(128, np.int32), src=1)[:100],  # cut short
    }

    # valid DATA for children 1 and 0 of iteration 1 that are not theirs: from worker 3 (direct to the PS, on the
    # children's network) and from worker 0's host at another port than its worker's; added, they would spoil the sum
    spoofed = {3: W.pack(W.DATA, 1, 0, np.full(128, 1 << 20, np.int32), src=1),
               0: W.pack(W.DATA, 1, 0, np.full(128, 1 << 20, np.int32), src=0)}  # fmt: skip

    def send_bad(info: dict) -> None:
        agg, w1 = info["agg_slot"][0], info["worker_slot"][1]
        _send_from(info["ns"][w1], (info["ips"][agg], info["port"]), list(bad.values()))
        for w, pkt in spoofed.items():
            _send_from(info["ns"][info["worker_slot"][w]], (info["ips"][agg], info["port"]), [pkt])

    run = _live(live_net, x, mode=mode, before_go=send_bad)
    want = x.astype(np.int64).sum(0)
    # every worker, every iteration
    assert np.array_equal(run.outputs, np.broadcast_to(want, run.outputs.shape))
    (agg,) = run.xdp
    nseg = -(-elems // W.SEG_ELEMS)
    if mode == "skb":
        assert agg["mode"] == "skb"
    c = agg["counters"]
    assert c["added"] == 3 * nseg * iters and c["tx_up"] == nseg * iters  # every DATA summed in the kernel
    assert {k: c[k] for k in bad} == dict.fromkeys(bad, 1) and c["dup"] == c["overflow"] == 0
    # dropped in the kernel: the program was given the children's addresses
    assert c["bad_addr"] == len(spoofed)
    assert agg["run_cnt"] >= c["rx"] > 0  # the kernel ran it on the live path (BPF stats)
    (relay,) = run.stats["aggregator"]
    # userspace saw neither DATA nor bad nor spoofed
    assert relay["unaggregated"] == 0 and sum(relay["bad"].values()) == 0
    (ps,) = run.stats["ps"]
    assert ps["rx"] == 2 * nseg * iters and sum(ps["bad"].values()) == 0  # the aggregator's sums + worker 3's


def test_xdp_live_recovers_an_aggregated_packet_the_ps_lost(live_net):
    """The PS drops 20 % of what it receives (seeded): the aggregator's lost sums come back through NACK, a RETX
    relayed to the children and the program sending the stored sum up again; nothing is counted twice."""
    rng = np.random.default_rng(6)
    x = rng.integers(-(2**24), 2**24, size=(4, 2, 40 * W.SEG_ELEMS), dtype=np.int32)
    run = _live(live_net, x, drop=0.2, drop_at=("ps",), seed=4, rto_ms=20)
    want = x.astype(np.int64).sum(0)
    assert np.array_equal(run.outputs, np.broadcast_to(want, run.outputs.shape))
    c = run.xdp[0]["counters"]
    assert c["added"] == 3 * 40 * 2 and c["resent_up"] > 0 and c["overflow"] == 0
    (ps,) = run.stats["ps"]
    assert ps["injected_drops"] > 0 and ps["overflow"] == 0
