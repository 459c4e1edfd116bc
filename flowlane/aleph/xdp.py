"""Tier 2 of ALEPH's data plane from Python: build the XDP aggregator (``aleph_dataplane/src/aleph_xdp.bpf.c``, clang's
BPF target + libbpf from Debian's ``clang`` and ``libbpf-dev``, installed by ``aleph_dataplane/install-xdp-deps.sh``)
and run frames through it in the kernel with BPF_PROG_TEST_RUN (``aleph_dataplane/src/aleph_xdp_run.c``), or attach
it to a live interface (:class:`Attached`) and run a plan's tree with tier 1's PS and workers over veths in network
namespaces (:func:`run_live_tree`).

Feature-detected (digest §5.4): :func:`unavailable_reason` says why the tier cannot run here (no clang, no libbpf
headers, or the kernel refuses the program: no bpf(), no CAP_BPF, a verifier rejection) and None when it can. Tests
skip with that reason; tiers 0 and 1 do not depend on it. The program shares the UDP tier's wire format
(:mod:`flowlane.aleph.wire`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flowlane._cbuild import _check_private
from flowlane.aleph import wire as W
from flowlane.aleph.cluster import Plan
from flowlane.aleph.udp import _start
from flowlane.aleph.udp import build as build_udp

SRC_DIR = Path(__file__).resolve().parents[2] / "aleph_dataplane"
BPF_FLAGS = ("-O2", "-g", "-target", "bpf", "-Wall", "-Werror")
RUN_FLAGS = ("-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-Werror")
VERDICTS = ("ABORTED", "DROP", "PASS", "TX", "REDIRECT")
MAX_SEGMENTS = 8192  # ALEPH_XDP_MAX_SEGMENTS in aleph_xdp.bpf.c


@dataclass(frozen=True)
class XdpConfig:
    """What the loader writes into the program's config map (one aggregator)."""

    port: int = 9000
    """the ALEPH UDP port the program aggregates (other ports pass to the stack)"""
    job: int = 0
    """the job id accepted"""
    iters: int = 1
    """iterations accepted: 1..iters"""
    elems: int = 128
    """values per iteration (segments of 128; the last one shorter); at most 8192 segments"""
    children: int = 1
    """this aggregator's children (src ids 0..children-1), at most 32 (the bitmap)"""
    my_id: int = 0
    """this aggregator's src id at its parent"""
    parent_ip: str = "10.0.0.1"
    """the parent's IPv4 address"""
    parent_port: int = 9000
    """the parent's UDP port"""
    parent_mac: str = "02:00:00:00:00:01"
    """the parent's (or the next hop's) Ethernet address"""
    child_addrs: tuple[str, ...] = ()
    """the children's "IPV4:PORT" source addresses in src id order (the relay's ``--child-addrs``): a DATA for an id
    from any other source is dropped (``bad_addr``); empty: each id is pinned to the source of its first valid DATA,
    as tier 1's node does"""

    def argv(self) -> list[str]:
        return [
            "--port", str(self.port), "--job", str(self.job), "--iters", str(self.iters),
            "--elems", str(self.elems), "--children", str(self.children), "--my-id", str(self.my_id),
            "--parent-ip", self.parent_ip, "--parent-port", str(self.parent_port), "--parent-mac", self.parent_mac,
            *(["--child-addrs", ",".join(self.child_addrs)] if self.child_addrs else []),
        ]  # fmt: skip


def _cache() -> Path:
    cache = Path(os.environ.get("FLOWLANE_CACHE", Path.home() / ".cache" / "flowlane"))
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache, os.stat(cache))
    return cache


def _compile(cmd: list[str], out: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
        os.chmod(tmp, 0o700)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build() -> tuple[Path, Path]:
    """(BPF object, runner binary), built on first use into ``$FLOWLANE_CACHE``, named by a hash of the sources and
    flags. Raises FileNotFoundError naming the missing tool or header, CalledProcessError with the compiler's output."""
    if shutil.which("clang") is None:
        raise FileNotFoundError("clang is not installed (run aleph_dataplane/install-xdp-deps.sh)")
    if not Path("/usr/include/bpf/bpf_helpers.h").exists():
        raise FileNotFoundError("libbpf headers are not installed (run aleph_dataplane/install-xdp-deps.sh)")
    inc = SRC_DIR / "include"
    bpf_src, run_src = SRC_DIR / "src" / "aleph_xdp.bpf.c", SRC_DIR / "src" / "aleph_xdp_run.c"
    hdr = (inc / "aleph_wire.h").read_bytes()
    tag = hashlib.sha256(
        bpf_src.read_bytes() + run_src.read_bytes() + hdr + " ".join(BPF_FLAGS + RUN_FLAGS).encode()
    ).hexdigest()[:12]
    cache = _cache()
    obj, exe = cache / f"aleph_xdp_{tag}.bpf.o", cache / f"aleph_xdp_run_{tag}"
    multiarch = "/usr/include/x86_64-linux-gnu"  # asm/ headers for the BPF target (Debian's multiarch layout)
    if not obj.exists():
        _compile(["clang", *BPF_FLAGS, f"-I{inc}", f"-I{multiarch}", "-c", str(bpf_src)], obj)
    if not exe.exists():
        _compile([os.environ.get("CC", "cc"), *RUN_FLAGS, f"-I{inc}", str(run_src), "-lbpf"], exe)
    for p in (obj, exe):
        _check_private(p, os.lstat(p))
    return obj, exe


@dataclass
class XdpRun:
    """What :func:`run_frames` saw: per frame the verdict, the kernel's run time (ns) and the frame after the program,
    and the program's counters (summed over CPUs)."""

    verdicts: list[str]
    ns: list[int]
    out: list[bytes]
    counters: dict[str, int]


class XdpUnavailable(RuntimeError):
    """The XDP tier cannot run here (the message says why)."""


def run_frames(frames: list[bytes], cfg: XdpConfig, timeout_s: float = 120.0) -> XdpRun:
    """Load the program (fresh maps), configure it with ``cfg`` and run ``frames`` through it in order with
    BPF_PROG_TEST_RUN. Raises :class:`XdpUnavailable` when the kernel refuses the program."""
    obj, exe = build()
    blob = b"".join(struct.pack("<I", len(f)) + f for f in frames)
    r = subprocess.run([str(exe), str(obj), *cfg.argv()], input=blob, capture_output=True, timeout=timeout_s)
    if r.returncode == 3:
        raise XdpUnavailable(r.stderr.decode(errors="replace").strip())
    if r.returncode != 0:
        raise RuntimeError(
            f"aleph_xdp_run exited {r.returncode}: {r.stderr.decode(errors='replace').strip()}"
        )
    lines = [json.loads(x) for x in r.stdout.decode().splitlines()]
    rows: list[dict[str, Any]] = lines[:-1]
    return XdpRun(
        [q["verdict"] for q in rows],
        [q["ns"] for q in rows],
        [bytes.fromhex(q["out"]) for q in rows],
        lines[-1]["counters"],
    )


def unavailable_reason() -> str | None:
    """Why the XDP tier cannot run here, or None: builds it and loads it once (an empty run)."""
    try:
        run_frames([], XdpConfig())
    except (FileNotFoundError, XdpUnavailable) as e:
        return f"XDP tier unavailable: {e}"
    except subprocess.CalledProcessError as e:
        return f"XDP tier does not build: {(e.stderr or '').strip()[-400:]}"
    return None


def _mac(s: str) -> bytes:
    parts = s.split(":")
    if len(parts) != 6:
        raise ValueError(f"mac={s!r} is not aa:bb:cc:dd:ee:ff")
    return bytes(int(p, 16) for p in parts)


def _ip_checksum(hdr: bytes) -> int:
    s = sum(struct.unpack("!10H", hdr))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def frame(
    payload: bytes,
    *,
    src_ip: str = "10.0.0.2",
    dst_ip: str = "10.0.0.3",
    sport: int = 9000,
    dport: int = 9000,
    src_mac: str = "02:00:00:00:00:02",
    dst_mac: str = "02:00:00:00:00:03",
    udp_len: int | None = None,
) -> bytes:
    """An Ethernet + IPv4 + UDP frame around ``payload`` (an ALEPH datagram from :func:`flowlane.aleph.wire.pack`);
    ``udp_len`` overrides the UDP length field (tests craft inconsistent ones)."""
    ulen = 8 + len(payload) if udp_len is None else udp_len
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + len(payload), 0, 0x4000, 64, 17, 0,
        ipaddress.IPv4Address(src_ip).packed, ipaddress.IPv4Address(dst_ip).packed,
    )  # fmt: skip
    ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", sport, dport, ulen & 0xFFFF, 0)
    return _mac(dst_mac) + _mac(src_mac) + b"\x08\x00" + ip + udp + payload


def parse_frame(buf: bytes) -> dict[str, Any]:
    """The addresses, IP checksum validity and ALEPH datagram of a frame (for tests and the benchmark)."""
    ip = buf[14:34]
    return {
        "dst_mac": buf[0:6].hex(":"),
        "src_mac": buf[6:12].hex(":"),
        "src_ip": str(ipaddress.IPv4Address(ip[12:16])),
        "dst_ip": str(ipaddress.IPv4Address(ip[16:20])),
        "ip_checksum_ok": _ip_checksum(ip[:10] + b"\0\0" + ip[12:]) == struct.unpack("!H", ip[10:12])[0],
        "sport": struct.unpack("!H", buf[34:36])[0],
        "dport": struct.unpack("!H", buf[36:38])[0],
        "payload": buf[42:],
    }


# ------------------------------------------------------------------------------------------------- on a live interface


class Attached:
    """The program attached to ``ifname`` (in the namespace ``wrap`` enters) by a running ``aleph_xdp_run --attach``:
    a BPF link, so the kernel detaches it when that process ends. ``mode`` is what the kernel took ("native": the
    veth driver's XDP; "skb": generic XDP after the stack has built an skb). :meth:`detach` ends it and returns the
    program's counters, with ``run_cnt`` / ``run_time_ns`` (the kernel's BPF stats of the program) when given.

    ``prog="aleph_xdp_pass"`` attaches the pass-everything program (no config): a veth delivers XDP_TX frames to its
    peer only when the peer's NAPI is on, which an XDP program on the peer (or GRO) turns on."""

    def __init__(
        self,
        ifname: str,
        cfg: XdpConfig | None,
        *,
        prog: str = "aleph_xdp",
        mode: str = "auto",
        wrap: Sequence[str] = (),
        timeout_s: float = 60.0,
    ) -> None:
        if mode not in ("auto", "native", "skb"):
            raise ValueError(f"mode={mode!r} must be 'auto', 'native' or 'skb'")
        if prog not in ("aleph_xdp", "aleph_xdp_pass"):
            raise ValueError(f"prog={prog!r} must be 'aleph_xdp' or 'aleph_xdp_pass'")
        if (cfg is None) != (prog == "aleph_xdp_pass"):
            raise ValueError("cfg is required for prog='aleph_xdp' and not taken by 'aleph_xdp_pass'")
        obj, exe = build()
        argv = [*wrap, str(exe), str(obj), "--prog", prog, "--attach", ifname, "--xdp-mode", mode]
        argv += cfg.argv() if cfg is not None else []
        self._p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self._p.stdout is not None
        line = self._p.stdout.readline()
        if not line.startswith("{"):
            _, err = self._p.communicate(timeout=timeout_s)
            if self._p.returncode == 3:
                raise XdpUnavailable(err.strip())
            raise RuntimeError(f"aleph_xdp_run --attach {ifname} exited {self._p.returncode}: {err.strip()}")
        info = json.loads(line)
        self.ifname, self.prog, self.timeout_s = ifname, prog, timeout_s
        self.mode: str = info["mode"]
        self.native_error: str = info["native_error"]
        self.result: dict[str, Any] | None = None

    def detach(self) -> dict[str, Any]:
        """Detach (ends the loader) and return ``{"counters": {...}, "run_cnt": .., "run_time_ns": ..}``."""
        if self.result is None:
            out, err = self._p.communicate("done\n", timeout=self.timeout_s)
            if self._p.returncode != 0:
                raise RuntimeError(
                    f"aleph_xdp_run on {self.ifname} exited {self._p.returncode}: {err.strip()}"
                )
            self.result = json.loads(out.strip().splitlines()[-1])
        return self.result

    def kill(self) -> None:
        if self._p.poll() is None:
            self._p.kill()
            self._p.wait()


class Namespaces(Protocol):
    """What :func:`run_live_tree` needs of a network: ``flowlane.testing.netem.EmulatedNetwork`` has it (one namespace
    per node, ``ifname`` in each on a bridge in ``switch_ns`` whose port towards namespace i is ``p<i>``)."""

    ns: list[str]
    ips: list[str]
    switch_ns: str
    ifname: str


def live_nodes(plan: Plan) -> int:
    """Namespaces :func:`run_live_tree` uses for ``plan``: the PS, one per cluster with members (its aggregator), one
    per worker."""
    return 1 + sum(len(c.members) > 1 for c in plan.clusters) + plan.n


@dataclass
class LiveRun:
    """What :func:`run_live_tree` saw: ``outputs[w]`` (iters x elems sums at worker w), every tier-1 process's
    counters by role, per aggregator the XDP program's counters and BPF stats and the mode it ran in, the workers'
    wall time, and /proc/stat's machine-wide CPU ticks (USER_HZ) by field from the go to the last worker's exit."""

    outputs: np.ndarray
    stats: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    xdp: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    proc_stat_ticks: dict[str, int] = field(default_factory=dict)


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _proc_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1 : 1 + len(_STAT_FIELDS)]]


def _if_mac(ns: str, dev: str) -> str:
    r = subprocess.run(
        ["ip", "-n", ns, "-j", "link", "show", dev], capture_output=True, text=True, timeout=30
    )
    if r.returncode:
        raise RuntimeError(f"ip -n {ns} link show {dev}: {r.stderr.strip()}")
    return str(json.loads(r.stdout)[0]["address"])


def run_live_tree(
    plan: Plan,
    inputs: np.ndarray,
    net: Namespaces,
    *,
    userspace: bool = False,
    mode: str = "auto",
    port: int = 9000,
    rto_ms: int = 50,
    timeout_s: float = 120.0,
    before_go: Callable[[dict[str, Any]], None] | None = None,
    peer_pass: bool = True,
    drop: float = 0.0,
    drop_at: Sequence[str] = ("ps", "aggregator", "worker"),
    seed: int = 0,
) -> LiveRun:
    """Aggregate ``inputs`` (workers x iters x elems int32) through ``plan``'s tree on live veths: namespace 0 runs
    tier 1's PS node, namespaces 1..A each one cluster's aggregator, namespaces A+1.. the workers (tier-1 worker
    processes, which send real DATA datagrams). Per aggregator the XDP program is attached to its interface
    (``mode``: auto / native / skb) with a userspace relay node (``aleph_udp node --xdp 1``) behind it for RESULT,
    NACK and RETX; in native mode the bridge port facing it gets ``aleph_xdp_pass`` so that its XDP_TX frames are
    received (``peer_pass=False`` leaves it off: the veth then drops them, the documented quirk). ``userspace=True`` runs tier 1's own aggregator node there instead (no XDP): the baseline.

    A cluster head's own worker has a namespace of its own: a host's own packets never cross its interface's XDP
    hook, so the aggregator namespace holds only the aggregation. ``before_go(info)`` runs once everything is up,
    before the workers send (``info``: namespaces, addresses, port; tests send malformed and spoofed packets from it:
    the program is given its children's addresses, the relay's ``--child-addrs``, and drops a DATA for an id from any
    other source as ``bad_addr``). ``drop``: the probability that each tier-1 process of the roles in ``drop_at``
    drops a received datagram (seeded; the XDP program itself sees every frame: at a PS that drops an aggregator's
    sum, recovery goes NACK -> RETX relayed to the children -> their DATA again -> the program sends the stored sum
    up again). Raises :class:`XdpUnavailable` when the program cannot load or attach."""
    inputs = np.ascontiguousarray(inputs, dtype="<i4")
    if inputs.ndim != 3 or inputs.shape[0] != plan.n:
        raise ValueError(f"inputs must be workers x iters x elems with {plan.n} workers, got {inputs.shape}")
    n, iters, elems = inputs.shape
    if -(-elems // W.SEG_ELEMS) > MAX_SEGMENTS:
        raise ValueError(f"elems={elems} exceeds the program's {MAX_SEGMENTS} segments of {W.SEG_ELEMS}")
    if not 0 <= drop < 1:
        raise ValueError(f"drop={drop!r} must be a probability in [0, 1)")
    if set(drop_at) - {"ps", "aggregator", "worker"}:
        raise ValueError(f"drop_at={tuple(drop_at)!r}: roles are 'ps', 'aggregator', 'worker'")
    if len(net.ns) < live_nodes(plan):
        raise ValueError(
            f"the plan needs {live_nodes(plan)} namespaces (live_nodes), the network has {len(net.ns)}"
        )

    exe = str(build_udp())
    wport = port + 1
    aggs = [i for i, c in enumerate(plan.clusters) if len(c.members) > 1]
    agg_slot = {i: 1 + k for k, i in enumerate(aggs)}
    w_slot = [1 + len(aggs) + w for w in range(n)]
    ex = [["ip", "netns", "exec", ns] for ns in net.ns]

    def inside(slot: int) -> Callable[[list[str]], list[str]]:
        return lambda argv: [*ex[slot], *argv]

    ps_ip = net.ips[0]
    base = ["--elems", str(elems), "--iters", str(iters), "--rto-ms", str(rto_ms)]

    def common(role: str, k: int) -> list[str]:
        p = drop if role in drop_at else 0.0
        return [*base, "--drop", repr(p), "--seed", str(seed * 1009 + k), "--port"]

    def child_addrs(i: int) -> list[str]:
        """Cluster i's workers' sources, in child id order: the program pins them, the relay sends to them."""
        return [f"{net.ips[w_slot[m]]}:{wport}" for m in plan.clusters[i].members]

    procs: list[tuple[str, subprocess.Popen[str]]] = []
    attached: list[tuple[int, Attached, Attached | None]] = []
    try:
        for i in aggs if not userspace else []:
            c, slot = plan.clusters[i], agg_slot[i]
            cfg = XdpConfig(
                port=port, job=0, iters=iters, elems=elems, children=len(c.members), my_id=i, parent_ip=ps_ip,
                parent_port=port, parent_mac=_if_mac(net.ns[0], net.ifname), child_addrs=tuple(child_addrs(i)),
            )  # fmt: skip
            a = Attached(net.ifname, cfg, mode=mode, wrap=ex[slot])
            peer = None
            # XDP_TX on a veth reaches its peer only when the peer runs XDP (or GRO)
            if a.mode == "native" and peer_pass:
                peer = Attached(f"p{slot}", None, prog="aleph_xdp_pass", mode="native", wrap=["ip", "netns",
                                "exec", net.switch_ns])  # fmt: skip
            attached.append((i, a, peer))
        ps, _ = _start(
            [exe, "node", "--children", str(plan.num_flows), *common("ps", 0), str(port)], inside(0)
        )
        procs.append(("ps", ps))
        parent_of: dict[int, tuple[str, int]] = {}
        for i, c in enumerate(plan.clusters):
            if len(c.members) == 1:
                parent_of[c.head] = (f"{ps_ip}:{port}", i)
                continue
            relay = ["--xdp", "1", "--child-addrs", ",".join(child_addrs(i))]
            argv = [
                exe,
                "node",
                "--children",
                str(len(c.members)),
                "--parent",
                f"{ps_ip}:{port}",
                "--id",
                str(i),
            ]
            agg, _ = _start(
                [*argv, *common("aggregator", 1 + i), str(port), *([] if userspace else relay)],
                inside(agg_slot[i]),
            )
            procs.append(("aggregator", agg))
            for j, m in enumerate(c.members):
                parent_of[m] = (f"{net.ips[agg_slot[i]]}:{port}", j)
        with tempfile.TemporaryDirectory(prefix="aleph-xdp-live-") as tmp:
            workers = []
            for w in range(n):
                inp, out = Path(tmp) / f"in{w}", Path(tmp) / f"out{w}"
                inputs[w].tofile(inp)
                parent, lid = parent_of[w]
                p, _ = _start([exe, "worker", "--wait-go", "1", "--parent", parent, "--id", str(lid), "--in",
                               str(inp), "--out", str(out), *common("worker", 100 + w), str(wport)], inside(w_slot[w]))  # fmt: skip
                procs.append(("worker", p))
                workers.append((p, out))
            if before_go is not None:
                before_go({"ns": list(net.ns), "ips": list(net.ips), "port": port, "agg_slot": agg_slot,
                           "worker_slot": w_slot})  # fmt: skip
            s0, t0 = _proc_stat(), time.perf_counter()
            for p, _ in workers:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for p, _ in workers:
                p.wait(timeout=timeout_s)
            wall, s1 = time.perf_counter() - t0, _proc_stat()
            stats: dict[str, list[dict[str, Any]]] = {"ps": [], "aggregator": [], "worker": []}
            for role, p in procs:
                text, err = p.communicate(timeout=timeout_s)
                if p.returncode != 0:
                    raise RuntimeError(f"aleph_udp {role} exited {p.returncode}: {err.strip()[-2000:]}")
                stats[role].append(json.loads(text.strip().splitlines()[-1]))
            outputs = np.stack([np.fromfile(o, dtype="<i4").reshape(iters, elems) for _, o in workers])
        xdp = []
        for i, a, peer in attached:
            xdp.append({"cluster": i, "mode": a.mode, "native_error": a.native_error, **a.detach()})
            if peer is not None:
                peer.detach()
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for _, a, peer in attached:
            a.kill()
            if peer is not None:
                peer.kill()
    ticks = {k: b - a for k, a, b in zip(_STAT_FIELDS, s0, s1, strict=True)}
    return LiveRun(outputs, stats, xdp, wall, ticks)
