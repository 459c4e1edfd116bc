"""ALEPH tier 2: the XDP aggregator, run in the kernel with BPF_PROG_TEST_RUN (exact sums, the completing packet sent
up to the parent, duplicates and malformed packets dropped and counted). Skips with the reason where clang/libbpf
are missing or the kernel refuses the program; tiers 0 and 1 have their own tests."""

import random
import shutil
import struct

import numpy as np
import pytest

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
    frames, expect = [], []  # expect: (iteration, segment) completed by this frame, or None
    order = random.Random(3)
    for it in range(1, CFG.iters + 1):
        pkts = [(seg, c) for seg in range(NSEG) for c in range(CFG.children)]
        order.shuffle(pkts)
        seen: dict[int, int] = {}
        for i, (seg, c) in enumerate(pkts):
            frames.append(_data(it, seg, c, x[it - 1, c, _seg(seg)]))
            seen[seg] = seen.get(seg, 0) + 1
            expect.append((it, seg) if seen[seg] == CFG.children else None)
            if i % 4 == 1:  # a resent copy of the same packet: must not be added twice
                frames.append(_data(it, seg, c, x[it - 1, c, _seg(seg)]))
                expect.append("dup")
    run = X.run_frames(frames, CFG)
    sums = x.astype(np.int64).sum(1)
    ups = 0
    for v, out, e in zip(run.verdicts, run.out, expect, strict=True):
        if e is None or e == "dup":
            assert v == "DROP"
            continue
        it, seg = e
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
    assert ups == c["tx_up"] == CFG.iters * NSEG
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
