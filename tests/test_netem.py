"""flowlane.netem: a 2-namespace emulated network is reachable, shaped, and fully deleted on exit (also on errors)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from flowlane.netem import EmulatedNetwork, NetemError, unavailable_reason

pytestmark = pytest.mark.timeout(30)


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


def _existing() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _transfer(net: EmulatedNetwork, src: int, dst: int, nbytes: int) -> float:
    srv = net.popen(dst, [sys.executable, "-c", _SERVER, net.ips[dst]], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        r = net.run(src, [sys.executable, "-c", _CLIENT, net.ips[dst], str(nbytes)], capture_output=True, text=True,
                    timeout=15)
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
        slow = _transfer(net, 0, 1, 2_000_000)         # 16 Mbit at 40 Mbit/s: ~0.4 s
        fast = _transfer(net, 1, 0, 2_000_000)         # ~0.04 s
        assert slow >= 0.8 * 16 / 40, f"0->1 not shaped: {slow:.3f} s"
        assert slow < 3.0, f"0->1 far slower than 40 Mbit/s: {slow:.3f} s"
        assert fast < slow / 2, f"1->0 (400 Mbit/s) not faster than 0->1 (40 Mbit/s): {fast:.3f} vs {slow:.3f}"
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
    net.ifname = "bad name with spaces"              # makes 'ip link add' fail half-way through building
    with pytest.raises(NetemError, match="command failed"):
        net.up()
    assert not set(net.namespaces) & _existing()


def test_bad_options_are_rejected_with_clear_errors() -> None:
    with pytest.raises(NetemError, match="private"):
        EmulatedNetwork(2, subnet="8.8.8.0/24")
    with pytest.raises(NetemError, match="2x2"):
        EmulatedNetwork(2, pair_rate_mbit=[[0, 1, 2]])
    with pytest.raises(NetemError, match="one value per rank"):
        EmulatedNetwork(3, rate_mbit=[10, 20])
    with pytest.raises(NetemError, match="> 0"):
        EmulatedNetwork(2, rate_mbit=0)


@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)")
def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetemError, match="needs root"):
        EmulatedNetwork(2).up()
