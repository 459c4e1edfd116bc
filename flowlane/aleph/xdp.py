"""Tier 2 of ALEPH's data plane from Python: build the XDP aggregator (``aleph_dataplane/src/aleph_xdp.bpf.c``, clang's
BPF target + libbpf from Debian's ``clang`` and ``libbpf-dev``, installed by ``aleph_dataplane/install-xdp-deps.sh``)
and run frames through it in the kernel with BPF_PROG_TEST_RUN (``aleph_dataplane/src/aleph_xdp_run.c``).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlane._cbuild import _check_private

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

    def argv(self) -> list[str]:
        return [
            "--port", str(self.port), "--job", str(self.job), "--iters", str(self.iters),
            "--elems", str(self.elems), "--children", str(self.children), "--my-id", str(self.my_id),
            "--parent-ip", self.parent_ip, "--parent-port", str(self.parent_port), "--parent-mac", self.parent_mac,
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
