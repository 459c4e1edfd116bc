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
- ``shape_downlink=False``: shape only the uplink (the receive side stays unshaped).
- ``switch_buffer_kb``: the switch port towards each rank (the downlink tbf) queues at most this many KiB and drops
  the rest (tbf ``limit``) -- a shallow switch buffer, where many-to-one traffic loses packets and TCP waits for
  retransmission timeouts (incast). Uplinks keep ``tbf_latency_ms`` (a host's own queue is deep). Without it the
  downlink queues ``tbf_latency_ms`` of traffic like the uplink. Plain tbf links only (no classes, no pair rates).
- ``sysctls``: network sysctls set in every rank's namespace (its own copy, the host's are untouched), e.g.
  ``{"net.ipv4.tcp_wmem": "4096 32768 65536"}`` caps the socket send buffer, which bounds how far a sender's
  completed sends run ahead of the data on the wire. A key the kernel refuses in a namespace fails ``up()``.

Servers and priority classes (what a coflow scheduler's wire priority needs):

- ``ranks_per_server=k`` (> 1): ranks ``k*s .. k*s+k-1`` are one *server*: their ``eth0`` ports are bridged in a
  server namespace (``...h<s>``, traffic between them is unshaped, as NVLink would be), whose one NIC (``nic``) is the
  access link into the switch. ``rate_mbit`` is then one value per server and shapes that NIC (transmit, and the
  switch port towards it: receive), so every rank of a server shares it -- seed 000's one link per server.
- ``bulk_subnet="10.x.y.0/24"``: every rank also gets a macvlan ``bulk0`` on its ``eth0`` with an address in that
  subnet (its own source address on the same NIC), and every shaped port becomes an **htb** tree with a default class
  at the link rate and a *bulk* class (prio 1, 1 kbit/s guaranteed, ceil = the link rate) selected by **u32** filters
  on the bulk subnet (source or destination): bulk traffic gets only what the default class leaves -- the
  strict-priority queue a switch gives a low DSCP class. A process that binds a connection to ``bulk0`` (gloo:
  ``GLOO_SOCKET_IFNAME=bulk0`` while creating its group, see :mod:`flowlane.sched.groups`) is queued behind
  everything else; nothing else is reordered. :meth:`EmulatedNetwork.class_bytes` reads each class's byte counters.
  ``bulk_lane_mbit``: the bulk class gets its own lane of that rate beside the link instead of the link's leftovers,
  so bulk traffic no longer competes at all -- an upper bound for what ordering bulk traffic could gain.
- ``pipeline_subnet=`` (with ``bulk_subnet``): a third, middle class -- a macvlan ``pipe0`` per rank whose traffic
  every shaped port serves after the default class and before the bulk class (Hermod's critical / pipeline / bulk).
  (The kernel here has no ``prio`` qdisc; htb's class priorities give the same strict order.)

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
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["BULK_IFNAME", "EmulatedNetwork", "NetemError", "check_available"]

_UNSHAPED_MBIT = 100_000.0  # the default class of an htb root: effectively a plain veth
BULK_IFNAME = "bulk0"  # the macvlan carrying the bulk (lowest-priority) class, with bulk_subnet
PIPELINE_IFNAME = "pipe0"  # the macvlan carrying the middle class, with pipeline_subnet
_DEFAULT_CLASS, _PIPELINE_CLASS, _BULK_CLASS = "1:10", "1:20", "1:30"  # classes of a priority htb tree


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


def _per_rank(v: float | Sequence[float] | None, n: int, what: str, unit: str = "rank") -> list[float | None]:
    if v is None:
        return [None] * n
    vals = [float(v)] * n if isinstance(v, int | float) else [float(x) for x in v]
    if len(vals) != n:
        raise NetemError(f"{what} needs one value per {unit} ({n}), got {len(vals)}")
    return vals


def _mbit(x: float) -> str:
    return f"{x:.6g}mbit"


def _burst(rate_mbit: float, burst_kb: float) -> str:
    # at least burst_kb, and at least 1 ms of traffic so fast links are not throttled by a tiny bucket. On a quiet
    # 2-core host one TCP flow gets 0.96x of 100, 400 and 1000 Mbit/s with 32 or 128 KB (results/netem/tbf_burst.json,
    # benchmarks/netem_tbf_burst.py); at load ~25 the 32 KB bucket topped out near 200 Mbit/s (results/aleph/README.md):
    # pass more when loaded
    return f"{max(burst_kb * 1024, rate_mbit * 1e6 / 8 * 1e-3):.0f}b"


class EmulatedNetwork:
    """``num_ranks`` namespaces joined by a bridge, with tc-shaped links. Use as a context manager."""

    def __init__(
        self,
        num_ranks: int,
        *,
        rate_mbit: float | Sequence[float] | None = None,
        pair_rate_mbit: Sequence[Sequence[float]] | Any = None,
        delay_ms: float | Sequence[float] | None = None,
        subnet: str = "10.213.0.0/24",
        burst_kb: float = 32.0,
        tbf_latency_ms: float = 100.0,
        ifname: str = "eth0",
        prefix: str = "flnet",
        ranks_per_server: int = 1,
        bulk_subnet: str | None = None,
        bulk_lane_mbit: float | None = None,
        shape_downlink: bool = True,
        pipeline_subnet: str | None = None,
        switch_buffer_kb: float | None = None,
        sysctls: Mapping[str, str] | None = None,
    ) -> None:
        if num_ranks < 1:
            raise NetemError(f"num_ranks must be >= 1, got {num_ranks}")
        if ranks_per_server < 1 or num_ranks % ranks_per_server:
            raise NetemError(
                f"ranks_per_server must be >= 1 and divide num_ranks ({num_ranks}), got {ranks_per_server}"
            )
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4:
            raise NetemError(f"subnet must be a private IPv4 range, got {subnet}")
        if net.num_addresses < num_ranks + 2:
            raise NetemError(f"subnet {subnet} is too small for {num_ranks} ranks")
        if not (1 <= len(ifname) <= 15) or not prefix.isalnum() or len(prefix) > 8:
            raise NetemError(f"bad ifname {ifname!r} or prefix {prefix!r} (alphanumeric prefix, <= 8 chars)")
        self.num_ranks = num_ranks
        self.ranks_per_server = ranks_per_server
        links = num_ranks // ranks_per_server
        self.rates = _per_rank(rate_mbit, links, "rate_mbit", "rank" if ranks_per_server == 1 else "server")
        self.delays = _per_rank(delay_ms, num_ranks, "delay_ms")
        self.shape_downlink = shape_downlink
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
        if ranks_per_server > 1 and self.pair is not None:
            raise NetemError(
                "pair_rate_mbit needs one link per rank; it cannot be combined with ranks_per_server > 1"
            )
        self.bulk_net: ipaddress.IPv4Network | None = None
        self.bulk_ips: list[str] = []
        if bulk_subnet is not None:
            if self.pair is not None or any(self.delays):
                raise NetemError(
                    "bulk_subnet (priority classes) cannot be combined with pair_rate_mbit or delay_ms"
                )
            bnet = ipaddress.ip_network(bulk_subnet)
            if (
                not bnet.is_private
                or bnet.version != 4
                or bnet.overlaps(net)
                or bnet.num_addresses < num_ranks + 2
            ):
                raise NetemError(
                    f"bulk_subnet must be a private IPv4 range apart from subnet {subnet} with room for "
                    f"{num_ranks} ranks, got {bulk_subnet}"
                )
            self.bulk_net = bnet  # type: ignore[assignment]
            bhosts = bnet.hosts()
            self.bulk_ips = [str(next(bhosts)) for _ in range(num_ranks)]
        self.pipe_net: ipaddress.IPv4Network | None = None
        self.pipe_ips: list[str] = []
        if pipeline_subnet is not None:
            pnet = ipaddress.ip_network(pipeline_subnet)
            if (
                self.bulk_net is None
                or not pnet.is_private
                or pnet.version != 4
                or pnet.overlaps(net)
                or pnet.overlaps(self.bulk_net)
                or pnet.num_addresses < num_ranks + 2
            ):
                raise NetemError(
                    f"pipeline_subnet needs bulk_subnet and must be a private IPv4 range apart from "
                    f"subnet {subnet} and bulk_subnet {bulk_subnet} with room for {num_ranks} ranks, "
                    f"got {pipeline_subnet}"
                )
            self.pipe_net = pnet  # type: ignore[assignment]
            phosts = pnet.hosts()
            self.pipe_ips = [str(next(phosts)) for _ in range(num_ranks)]
        if bulk_lane_mbit is not None and (self.bulk_net is None or not bulk_lane_mbit > 0):
            raise NetemError(f"bulk_lane_mbit needs bulk_subnet and must be > 0, got {bulk_lane_mbit}")
        self.bulk_lane = bulk_lane_mbit
        if switch_buffer_kb is not None and not (
            switch_buffer_kb > 0 and shape_downlink and bulk_subnet is None and pair_rate_mbit is None
        ):
            raise NetemError(
                f"switch_buffer_kb must be > 0 and needs shaped downlinks without bulk_subnet or "
                f"pair_rate_mbit (plain tbf ports), got {switch_buffer_kb}"
            )
        self.switch_buffer_kb = switch_buffer_kb
        self.sysctls = dict(sysctls or {})
        bad = [k for k in self.sysctls if not re.fullmatch(r"net\.(ipv4|ipv6|core)\.[a-z0-9_.]+", k)]
        if bad:
            raise NetemError(
                f"sysctls: only network keys (net.ipv4.*, net.ipv6.*, net.core.*) can be set in the "
                f"rank namespaces, got {bad}"
            )
        self.burst_kb = burst_kb
        self.tbf_latency_ms = tbf_latency_ms
        self.ifname = ifname
        self.prefixlen = net.prefixlen
        hosts = net.hosts()
        self.ips = [str(next(hosts)) for _ in range(num_ranks)]
        tag = self.tag = f"{prefix}{os.getpid()}{secrets.token_hex(2)}"
        self.switch_ns = f"{tag}s"
        self.server_ns = [f"{tag}h{k}" for k in range(links)] if ranks_per_server > 1 else []
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
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL,
            None,
        ):
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
            with contextlib.suppress(ValueError):  # not in the main thread any more
                signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        atexit.unregister(self.close)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network owns (switch first), whether or not it exists yet."""
        return [self.switch_ns, *self.server_ns, *self.ns]

    # -- running processes -------------------------------------------------------------------------------------------
    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[rank]]

    def env(self, rank: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a rank's process: ``GLOO_SOCKET_IFNAME`` (and NCCL's) set to the namespace interface."""
        return {
            **(os.environ if base is None else base),
            "GLOO_SOCKET_IFNAME": self.ifname,
            "NCCL_SOCKET_IFNAME": self.ifname,
        }

    def popen(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("env", self.env(rank))
        return subprocess.Popen([*self.exec_prefix(rank), *argv], **kw)

    def run(self, rank: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env(rank))
        return subprocess.run([*self.exec_prefix(rank), *argv], **kw)

    def run_ranks(
        self,
        argvs: Sequence[Sequence[str]],
        *,
        timeout_s: float,
        slots: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> list[str]:
        """Run ``argvs[r]`` in namespace ``slots[r]`` (default ``r``), all at once, and wait for every one; returns
        each one's stdout. The first process to fail stops the others at once and raises :class:`RuntimeError`
        naming its rank, exit code and the end of its stderr, as does any still running after ``timeout_s``: a dead
        peer is an error, never a hang (its survivors would otherwise wait out their own collective timeouts)."""
        slots = list(range(len(argvs))) if slots is None else list(slots)
        if len(slots) != len(argvs) or any(not 0 <= s < self.num_ranks for s in slots):
            raise NetemError(
                f"run_ranks: {len(argvs)} commands need as many slots in 0..{self.num_ranks - 1}, got {slots}"
            )
        with contextlib.ExitStack() as stack:
            files = [
                (
                    stack.enter_context(tempfile.TemporaryFile("w+")),
                    stack.enter_context(tempfile.TemporaryFile("w+")),
                )
                for _ in argvs
            ]  # files, not pipes: a large stdout never blocks its writer
            procs = [
                self.popen(s, list(a), env=self.env(s, env), cwd=cwd, stdout=o, stderr=e, text=True)
                for s, a, (o, e) in zip(slots, argvs, files, strict=True)
            ]
            deadline = time.monotonic() + timeout_s
            failed: tuple[int, str] | None = None
            try:
                while True:
                    codes = [p.poll() for p in procs]
                    bad = next((r for r, c in enumerate(codes) if c), None)  # exited, non-zero
                    if bad is not None:
                        failed = (bad, f"exit code {codes[bad]}")
                    elif None not in codes:
                        break
                    elif time.monotonic() > deadline:
                        failed = (codes.index(None), f"still running after {timeout_s:g} s")
                    if failed is not None:
                        break
                    time.sleep(0.05)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            for o, e in files:
                o.seek(0)
                e.seek(0)
            if failed is not None:
                r, why = failed
                raise RuntimeError(
                    f"rank {r} (namespace slot {slots[r]}) failed: {why}; its stderr ends:\n"
                    f"{files[r][1].read()[-3000:]}"
                )
            return [o.read() for o, _ in files]

    def describe(self) -> dict[str, Any]:
        """The emulated links, for results files."""
        access = "the server NIC (nic)" if self.server_ns else "eth0"
        down = ", downlink on the switch port towards it" if self.shape_downlink else "; downlink unshaped"
        return {
            "ranks": self.num_ranks,
            "ips": self.ips,
            "ranks_per_server": self.ranks_per_server,
            "access_rate_mbit": self.rates,
            "pair_rate_mbit": self.pair,
            "delay_ms": self.delays,
            "bulk_subnet": str(self.bulk_net) if self.bulk_net else None,
            "bulk_ips": self.bulk_ips,
            "bulk_lane_mbit": self.bulk_lane,
            "pipeline_subnet": str(self.pipe_net) if self.pipe_net else None,
            "pipeline_ips": self.pipe_ips,
            "qdiscs": {
                "access": (
                    f"htb: default class + strict-priority bulk class (u32 on {self.bulk_net})"
                    if self.bulk_net
                    else "tbf"
                )
                + f" (uplink on {access}{down})",
                "pair": "htb class per destination (rate=ceil) + u32 dst-IP filter on eth0",
                "delay": "netem leaf",
            },
            "burst_kb_min": self.burst_kb,
            "tbf_latency_ms": self.tbf_latency_ms,
            "switch_buffer_kb": self.switch_buffer_kb,
            "sysctls": self.sysctls,
        }

    def shaped_ports(self) -> list[tuple[str, str]]:
        """``(namespace, device)`` of every shaped access port: uplinks first, then downlinks."""
        up = [(h, "nic") for h in self.server_ns] or [(ns, self.ifname) for ns in self.ns]
        down = [(self.switch_ns, f"d{k}") for k in range(len(self.server_ns))] or [
            (self.switch_ns, f"p{i}") for i in range(self.num_ranks)
        ]
        keep = [r is not None for r in self.rates]
        return [p for p, k in zip(up, keep, strict=True) if k] + (
            [p for p, k in zip(down, keep, strict=True) if k] if self.shape_downlink else []
        )

    def class_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes each shaped port's default and bulk classes have sent so far (``bulk_subnet`` networks): evidence
        that the traffic meant for a class went there. Keys ``<namespace suffix>:<device>``."""
        if self.bulk_net is None:
            raise NetemError("class_bytes needs priority classes (bulk_subnet)")
        out: dict[str, dict[str, int]] = {}
        for ns, dev in self.shaped_ports():
            text = _run("ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", dev).stdout
            # "class htb 1:30 parent 1:1 ... \n Sent 1234 bytes ..." (this iproute2 prints no JSON for classes)
            by_id = {m[0]: int(m[1]) for m in re.findall(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes", text)}
            out[f"{ns.removeprefix(self.tag)}:{dev}"] = {
                "default": by_id.get(_DEFAULT_CLASS, 0),
                **({"pipeline": by_id.get(_PIPELINE_CLASS, 0)} if self.pipe_net else {}),
                "bulk": by_id.get(_BULK_CLASS, 0),
            }
        return out

    # -- building ----------------------------------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _bridge(self, ns: str) -> None:
        _run("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", ns, "link", "set", "br0", "up")

    def _veth(self, ns: str, dev: str, bridge_ns: str, port: str) -> None:
        """veth ``dev`` in ``ns`` <-> ``port`` on ``bridge_ns``'s br0 (created in place, both ends up)."""
        _run("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", bridge_ns)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", bridge_ns, "link", "set", port, "master", "br0")
        _run("ip", "-n", bridge_ns, "link", "set", port, "up")

    def _build(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        self._bridge(sw)
        for k, host in enumerate(self.server_ns):  # servers: one NIC into the switch, ranks bridged behind it
            self._add_ns(host)
            self._bridge(host)
            self._veth(host, "nic", sw, f"d{k}")
            _run("ip", "-n", host, "link", "set", "nic", "master", "br0")
            if self.rates[k] is not None:
                self._shape_link(host, "nic", self.rates[k])
                if self.shape_downlink:  # the switch port towards the server: the NIC's receive side
                    self._shape_link(sw, f"d{k}", self.rates[k], self.switch_buffer_kb)
        for i, ns in enumerate(self.ns):
            self._add_ns(ns)
            for key, value in self.sysctls.items():  # this namespace's own copy (not the host's)
                _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")
            port = f"p{i}"
            self._veth(
                ns, self.ifname, self.server_ns[i // self.ranks_per_server] if self.server_ns else sw, port
            )
            _run("ip", "-n", ns, "addr", "add", f"{self.ips[i]}/{self.prefixlen}", "dev", self.ifname)
            for dev, cnet, cips in (
                (BULK_IFNAME, self.bulk_net, self.bulk_ips),
                (PIPELINE_IFNAME, self.pipe_net, self.pipe_ips),
            ):
                if cnet is None:
                    continue
                # same NIC, own source address: what the class filters match
                _run(
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    dev,
                    "link",
                    self.ifname,
                    "type",
                    "macvlan",
                    "mode",
                    "bridge",
                )
                _run("ip", "-n", ns, "addr", "add", f"{cips[i]}/{cnet.prefixlen}", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
            if self.server_ns:
                if self.delays[i]:
                    self._tc(
                        ns,
                        "qdisc",
                        "add",
                        "dev",
                        self.ifname,
                        "root",
                        "netem",
                        "delay",
                        f"{self.delays[i]:g}ms",
                        "limit",
                        "100000",
                    )
                continue
            self._shape_egress(i)
            if self.rates[i] is not None and self.shape_downlink:  # the bridge port's egress towards rank i
                self._shape_link(sw, port, self.rates[i], self.switch_buffer_kb)

    def _shape_link(self, ns: str, dev: str, rate: float, buffer_kb: float | None = None) -> None:
        """One direction of an access link: tbf (queueing ``buffer_kb`` at most when given), or the priority htb tree
        when there are classes."""
        if self.bulk_net is None:
            self._tbf(ns, dev, rate, None, buffer_kb)
            return
        # 1:1 = the link; 1:10 default class (prio 0, may use all of it); with pipeline_subnet 1:20 (prio 1: what
        # 1:10 leaves); 1:30 bulk (lowest prio: what the others leave), or with bulk_lane_mbit a sibling of 1:1 with
        # its own capacity (a separate lane: a bound, not a schedule)
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", _DEFAULT_CLASS[2:])
        self._htb_class(ns, dev, "1:", "1:1", rate, rate)
        self._htb_class(ns, dev, "1:1", _DEFAULT_CLASS, rate, rate, prio=0)
        if self.pipe_net is not None:
            self._htb_class(ns, dev, "1:1", _PIPELINE_CLASS, 0.001, rate, prio=1)
        if self.bulk_lane is None:
            self._htb_class(ns, dev, "1:1", _BULK_CLASS, 0.001, rate, prio=2 if self.pipe_net else 1)
        else:
            self._htb_class(ns, dev, "1:", _BULK_CLASS, self.bulk_lane, self.bulk_lane)
        for cnet, cid in ((self.bulk_net, _BULK_CLASS), (self.pipe_net, _PIPELINE_CLASS)):
            for field in ("src", "dst") if cnet is not None else ():
                self._tc(
                    ns,
                    "filter",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    "1",
                    "u32",
                    "match",
                    "ip",
                    field,
                    str(cnet),
                    "flowid",
                    cid,
                )

    def _tc(self, ns: str, *args: str) -> None:
        _run("ip", "netns", "exec", ns, "tc", *args)

    def _tbf(
        self, ns: str, dev: str, rate: float, delay: float | None, buffer_kb: float | None = None
    ) -> None:
        queue = (
            ("limit", f"{buffer_kb * 1024:.0f}") if buffer_kb else ("latency", f"{self.tbf_latency_ms:g}ms")
        )
        self._tc(
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "handle",
            "1:",
            "tbf",
            "rate",
            _mbit(rate),
            "burst",
            _burst(rate, self.burst_kb),
            *queue,
        )
        if delay:
            self._tc(
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{delay:g}ms",
                "limit",
                "100000",
            )

    def _shape_egress(self, i: int) -> None:
        ns, dev, rate, delay = self.ns[i], self.ifname, self.rates[i], self.delays[i]
        if self.pair is None:
            if rate is not None and self.bulk_net is not None:
                self._shape_link(ns, dev, rate)
            elif rate is not None:
                self._tbf(ns, dev, rate, delay)
            elif delay:
                self._tc(
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "netem",
                    "delay",
                    f"{delay:g}ms",
                    "limit",
                    "100000",
                )
            return
        # htb: 1:1 = the uplink (access rate or unshaped); 1:2 default (ARP, ...); 1:(10+j) = link i -> j
        up = rate if rate is not None else _UNSHAPED_MBIT
        self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2", "r2q", "100")
        self._htb_class(ns, dev, "1:", "1:1", up, up)
        self._htb_class(ns, dev, "1:1", "1:2", up, up)
        for j in range(self.num_ranks):
            if j == i:
                continue
            r = min(self.pair[i][j], up)
            cid = f"1:{10 + j:x}"
            self._htb_class(ns, dev, "1:1", cid, r, r)
            if delay:
                self._tc(
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    cid,
                    "handle",
                    f"{10 + j:x}:",
                    "netem",
                    "delay",
                    f"{delay:g}ms",
                    "limit",
                    "100000",
                )
            self._tc(
                ns,
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dst",
                f"{self.ips[j]}/32",
                "flowid",
                cid,
            )

    def _htb_class(
        self, ns: str, dev: str, parent: str, cid: str, rate: float, ceil: float, prio: int | None = None
    ) -> None:
        b = _burst(max(rate, ceil), self.burst_kb)
        self._tc(
            ns,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            parent,
            "classid",
            cid,
            "htb",
            "rate",
            _mbit(rate),
            "ceil",
            _mbit(ceil),
            "burst",
            b,
            "cburst",
            b,
            "quantum",
            "60000",
            *(("prio", str(prio)) if prio is not None else ()),
        )

    def _require_qdisc(self, kind: str, *args: str) -> None:
        probe = f"flprobe{os.getpid()}{secrets.token_hex(2)}"
        _run("ip", "netns", "add", probe)
        try:
            _run("ip", "-n", probe, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
            r = _run(
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "d0",
                "root",
                kind,
                *args,
                check=False,
            )
            if r.returncode:
                raise NetemError(
                    f"the kernel has no tc qdisc {kind!r} (needed for the requested "
                    f"delay): {r.stderr.strip()}"
                )
        finally:
            _run("ip", "netns", "del", probe, check=False)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
