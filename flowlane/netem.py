"""Emulated networks for local ranks: one Linux network namespace per rank, shaped with ``tc`` (benchmarks, tests).

``EmulatedNetwork(n, ...)`` creates, as a context manager:

- a *switch* namespace holding a Linux bridge ``br0`` (no address: it only forwards);
- one namespace per rank, each with a veth interface ``eth0`` (address ``subnet`` host ``rank + 1``) whose peer is a
  port of ``br0``. The veth pairs are created directly inside the namespaces (``ip -n NS link add ... peer ... netns``),
  so nothing is ever added to the caller's namespace and traffic cannot leave the namespaces created here.

Shaping (choose with the arguments; figures are Mbit/s, a "link" is one direction):

- ``rate_mbit`` (scalar or one per rank): the rank's *access link*, shaped in both directions with **tbf** — on the
  rank's ``eth0`` (uplink) and on its bridge port in the switch namespace (downlink, so several senders to one rank
  share its downlink, i.e. a star). tbf because one rate per device needs no classification and its explicit bucket
  (``burst``) makes the shaping exact and easy to reason about.
- ``pair_rate_mbit`` (``[n, n]`` matrix): a dedicated directed link per ordered pair ``i -> j`` (a mesh, as
  :func:`flowlane.plan.mesh_from_matrix` models it). tbf cannot tell destinations apart, so the rank's ``eth0`` gets an
  **htb** root with one class per destination (``rate = ceil`` = the pair's rate: classes never borrow, so pairs do
  not share bandwidth) and a **u32** filter on the destination IP per class. Other traffic (ARP, IPv6 neighbour
  discovery) goes to an unshaped default class. With both arguments the pair classes hang below one class at the
  access rate (they then share the uplink) and the downlink tbf stays. u32 is used rather than flower because flower
  is not built into every kernel (it is missing here).
- ``delay_ms`` (scalar or one per rank): one-way delay added on the rank's egress with a **netem** leaf qdisc; raises
  :class:`NetemError` up front when the kernel has no netem (as on this box), instead of silently not delaying.

Everything created is deleted on ``__exit__`` (also when the block raises), at interpreter exit (``atexit``) and on
SIGTERM while the network is up (the default SIGTERM action would skip both; the handler is installed only when the
caller had none). Deleting a namespace deletes its veth ends and qdiscs. Names carry the pid and a random suffix
(``flnet<pid><hex>s`` / ``...r<i>``), so concurrent users never collide. Requires root and iproute2 (``ip``, ``tc``);
:func:`check_available` raises :class:`NetemError` with the reason otherwise.

Run a rank's process with ``net.popen(rank, argv)`` (``ip netns exec <ns> argv``) and ``net.env(rank)`` (sets
``GLOO_SOCKET_IFNAME`` to the namespace's interface); ``net.ips[0]`` is rank 0's address for ``tcp://`` rendezvous.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EmulatedNetwork", "NetemError", "check_available"]

_UNSHAPED_MBIT = 100_000.0   # the default class of an htb root: effectively a plain veth


class NetemError(RuntimeError):
    """Link emulation is not possible here (not root, iproute2 missing, a qdisc not in the kernel, a bad option)."""


def _run(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise NetemError(f"command failed ({r.returncode}): {' '.join(cmd)}: {r.stderr.strip()}")
    return r


def check_available() -> None:
    """Raise :class:`NetemError` unless we are root and ``ip`` and ``tc`` are on PATH."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise NetemError(f"link emulation needs iproute2; not found on PATH: {', '.join(missing)}")
    if os.geteuid() != 0:
        raise NetemError("link emulation needs root (ip netns / tc); run as root or skip this benchmark/test")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (None when they can): root, iproute2, and a working
    ``ip netns add`` (some sandboxes forbid it even for root). Tests use this to skip with a clear reason."""
    try:
        check_available()
    except NetemError as e:
        return str(e)
    name = f"flprobe{uuid.uuid4().hex[:6]}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return f"'ip netns add' does not work here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


def _per_rank(v: float | Sequence[float] | None, n: int, what: str) -> list[float | None]:
    if v is None:
        return [None] * n
    vals = [float(v)] * n if isinstance(v, int | float) else [float(x) for x in v]
    if len(vals) != n:
        raise NetemError(f"{what} needs one value per rank ({n}), got {len(vals)}")
    return vals


def _mbit(x: float) -> str:
    return f"{x:.6g}mbit"


def _burst(rate_mbit: float, burst_kb: float) -> str:
    # at least burst_kb, and at least 1 ms of traffic so fast links are not throttled by a tiny bucket
    return f"{max(burst_kb * 1024, rate_mbit * 1e6 / 8 * 1e-3):.0f}b"


class EmulatedNetwork:
    """``num_ranks`` namespaces joined by a bridge, with tc-shaped links. Use as a context manager."""

    def __init__(self, num_ranks: int, *, rate_mbit: float | Sequence[float] | None = None,
                 pair_rate_mbit: Sequence[Sequence[float]] | Any = None,
                 delay_ms: float | Sequence[float] | None = None, subnet: str = "10.213.0.0/24",
                 burst_kb: float = 32.0, tbf_latency_ms: float = 100.0, ifname: str = "eth0",
                 prefix: str = "flnet") -> None:
        if num_ranks < 1:
            raise NetemError(f"num_ranks must be >= 1, got {num_ranks}")
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4:
            raise NetemError(f"subnet must be a private IPv4 range, got {subnet}")
        if net.num_addresses < num_ranks + 2:
            raise NetemError(f"subnet {subnet} is too small for {num_ranks} ranks")
        if not (1 <= len(ifname) <= 15) or not prefix.isalnum() or len(prefix) > 8:
            raise NetemError(f"bad ifname {ifname!r} or prefix {prefix!r} (alphanumeric prefix, <= 8 chars)")
        self.num_ranks = num_ranks
        self.rates = _per_rank(rate_mbit, num_ranks, "rate_mbit")
        self.delays = _per_rank(delay_ms, num_ranks, "delay_ms")
        self.pair: list[list[float]] | None = None
        if pair_rate_mbit is not None:
            m = [[float(x) for x in row] for row in pair_rate_mbit]
            if len(m) != num_ranks or any(len(row) != num_ranks for row in m):
                raise NetemError(f"pair_rate_mbit must be {num_ranks}x{num_ranks}")
            if any(m[i][j] <= 0 for i in range(num_ranks) for j in range(num_ranks) if i != j):
                raise NetemError("pair_rate_mbit must be > 0 off the diagonal (every pair needs a link)")
            self.pair = m
        if any(v is not None and not v > 0 for v in self.rates):
            raise NetemError(f"rate_mbit must be > 0, got {self.rates}")
        if any(v is not None and not v >= 0 for v in self.delays):
            raise NetemError(f"delay_ms must be >= 0, got {self.delays}")
        self.burst_kb = burst_kb
        self.tbf_latency_ms = tbf_latency_ms
        self.ifname = ifname
        self.prefixlen = net.prefixlen
        hosts = net.hosts()
        self.ips = [str(next(hosts)) for _ in range(num_ranks)]
        tag = f"{prefix}{os.getpid()}{secrets.token_hex(2)}"
        self.switch_ns = f"{tag}s"
        self.ns = [f"{tag}r{i}" for i in range(num_ranks)]
        self._created: list[str] = []
        self._lock = threading.Lock()
        self._old_sigterm: Any = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        check_available()
        if any(d for d in self.delays):
            self._require_qdisc("netem", "delay", "1ms")
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _raise_on_sigterm)
            self._old_sigterm = signal.SIG_DFL
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Delete every namespace created (idempotent; errors are ignored so that all are attempted)."""
        with self._lock:
            while self._created:
                _run("ip", "netns", "del", self._created.pop(), check=False)
        if self._old_sigterm is not None:
            with contextlib.suppress(ValueError):   # not in the main thread any more
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        atexit.unregister(self.close)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network owns (switch first), whether or not it exists yet."""
        return [self.switch_ns, *self.ns]

    # -- running processes -------------------------------------------------------------------------------------------
    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[rank]]

    def env(self, rank: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a rank's process: ``GLOO_SOCKET_IFNAME`` (and NCCL's) set to the namespace interface."""
        return {**(os.environ if base is None else base), "GLOO_SOCKET_IFNAME": self.ifname,
                "NCCL_SOCKET_IFNAME": self.ifname}

    def popen(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("env", self.env(rank))
        return subprocess.Popen([*self.exec_prefix(rank), *argv], **kw)

    def run(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env(rank))
        return subprocess.run([*self.exec_prefix(rank), *argv], **kw)

    def describe(self) -> dict[str, Any]:
        """The emulated links, for results files."""
        return {"ranks": self.num_ranks, "ips": self.ips, "access_rate_mbit": self.rates,
                "pair_rate_mbit": self.pair, "delay_ms": self.delays,
                "qdiscs": {"access": "tbf (uplink on eth0, downlink on the bridge port)",
                           "pair": "htb class per destination (rate=ceil) + u32 dst-IP filter on eth0",
                           "delay": "netem leaf"},
                "burst_kb_min": self.burst_kb}

    # -- building ----------------------------------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            self._add_ns(ns)
            port = f"p{i}"
            _run("ip", "-n", ns, "link", "add", self.ifname, "type", "veth", "peer", "name", port, "netns", sw)
            _run("ip", "-n", ns, "addr", "add", f"{self.ips[i]}/{self.prefixlen}", "dev", self.ifname)
            _run("ip", "-n", ns, "link", "set", self.ifname, "up")
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            self._shape_egress(i)
            if self.rates[i] is not None:   # downlink: the bridge port's egress towards rank i
                self._tbf(sw, port, self.rates[i], None)

    def _tc(self, ns: str, *args: str) -> None:
        _run("ip", "netns", "exec", ns, "tc", *args)

    def _tbf(self, ns: str, dev: str, rate: float, delay: float | None) -> None:
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", _mbit(rate),
                 "burst", _burst(rate, self.burst_kb), "latency", f"{self.tbf_latency_ms:g}ms")
        if delay:
            self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                     f"{delay:g}ms", "limit", "100000")

    def _shape_egress(self, i: int) -> None:
        ns, dev, rate, delay = self.ns[i], self.ifname, self.rates[i], self.delays[i]
        if self.pair is None:
            if rate is not None:
                self._tbf(ns, dev, rate, delay)
            elif delay:
                self._tc(ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{delay:g}ms", "limit", "100000")
            return
        # htb: 1:1 = the uplink (access rate or unshaped); 1:2 default (ARP, ...); 1:(10+j) = link i -> j
        up = rate if rate is not None else _UNSHAPED_MBIT
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2", "r2q", "100")
        self._htb_class(ns, "1:", "1:1", up, up)
        self._htb_class(ns, "1:1", "1:2", up, up)
        for j in range(self.num_ranks):
            if j == i:
                continue
            r = min(self.pair[i][j], up)
            cid = f"1:{10 + j:x}"
            self._htb_class(ns, "1:1", cid, r, r)
            if delay:
                self._tc(ns, "qdisc", "add", "dev", dev, "parent", cid, "handle", f"{10 + j:x}:", "netem", "delay",
                         f"{delay:g}ms", "limit", "100000")
            self._tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "dst", f"{self.ips[j]}/32", "flowid", cid)

    def _htb_class(self, ns: str, parent: str, cid: str, rate: float, ceil: float) -> None:
        b = _burst(max(rate, ceil), self.burst_kb)
        self._tc(ns, "class", "add", "dev", self.ifname, "parent", parent, "classid", cid, "htb", "rate", _mbit(rate),
                 "ceil", _mbit(ceil), "burst", b, "cburst", b, "quantum", "60000")

    def _require_qdisc(self, kind: str, *args: str) -> None:
        probe = f"flprobe{os.getpid()}{secrets.token_hex(2)}"
        _run("ip", "netns", "add", probe)
        try:
            _run("ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
            r = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "d0", "root", kind, *args, check=False)
            if r.returncode:
                raise NetemError(f"the kernel has no tc qdisc {kind!r} (needed for the requested "
                                 f"delay): {r.stderr.strip()}")
        finally:
            _run("ip", "netns", "del", probe, check=False)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
