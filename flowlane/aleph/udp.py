"""Tier 1 of ALEPH's data plane from Python: build ``aleph_dataplane/src/aleph_udp.c`` and run a plan's tree of UDP
aggregators (digest §5.4 tier 1).

``run_tree(plan, inputs)`` starts one PS node, one aggregator node per cluster with members (its own worker is the
cluster's child 0), and one worker process per worker, all on loopback (or, with ``host``, on addresses the caller
provides inside network namespaces), and returns every worker's sums and every process's counters. With
``split=`` (q fractions) it has q PSs (seed Sec. 7, digest §2.9): part j of every aggregator's sum, the fraction
``split[j]`` of the values, goes to PS j. The binary is
built on first use with the system C compiler into ``$FLOWLANE_CACHE`` (the same private cache and checks as
:mod:`flowlane._cbuild`), named by a hash of the sources and flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowlane._cbuild import _check_private
from flowlane.aleph.cluster import Plan
from flowlane.aleph.wire import MAX_CHILDREN

SRC_DIR = Path(__file__).resolve().parents[2] / "aleph_dataplane"
FLAGS = ("-O2", "-g", "-std=c11", "-Wall", "-Wextra", "-Wshadow", "-Werror")
SAN_FLAGS = (
    "-O1",
    "-g",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=all",
)


def build(sanitize: bool = False) -> Path:
    """The aggregator binary (built on first use); ``sanitize``: an ASan + UBSan build. Raises
    subprocess.CalledProcessError with the compiler's output when it does not compile."""
    src = SRC_DIR / "src" / "aleph_udp.c"
    hdr = SRC_DIR / "include" / "aleph_wire.h"
    flags = SAN_FLAGS if sanitize else FLAGS
    tag = hashlib.sha256(src.read_bytes() + hdr.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("FLOWLANE_CACHE", Path.home() / ".cache" / "flowlane"))
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(cache, os.stat(cache))
    exe = cache / f"aleph_udp{'_san' if sanitize else ''}_{tag}"
    if not exe.exists():
        fd, tmp = tempfile.mkstemp(dir=cache)
        os.close(fd)
        try:
            r = subprocess.run(
                [os.environ.get("CC", "cc"), *flags, f"-I{hdr.parent}", "-o", tmp, str(src)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if r.returncode != 0:
                raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
            os.chmod(tmp, 0o700)
            os.replace(tmp, exe)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _check_private(exe, os.lstat(exe))
    return exe


@dataclass
class TreeRun:
    """What :func:`run_tree` measured: ``outputs[w]`` (iters x elems int32 sums seen by worker w), the counters of
    every process by role (``ps``, ``aggregator``, ``worker``), and the workers' wall time from a common start (all
    worker processes are up and told to go at once) to the last one's exit."""

    outputs: np.ndarray
    stats: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    wall_s: float = 0.0


def _start(
    argv: list[str], wrap: Callable[[list[str]], list[str]] | None
) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(
        wrap(argv) if wrap else argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    # the first line byte by byte from the pipe itself: a buffered readline could also swallow the counters' line of
    # a process that finishes at once, and communicate() reads the pipe, not that buffer
    raw = b""
    while not raw.endswith(b"\n"):
        b = os.read(p.stdout.fileno(), 1)
        if not b:
            break
        raw += b
    line = raw.decode(errors="replace")
    if not line.startswith("port "):
        p.kill()
        _, err = p.communicate(timeout=10)
        raise RuntimeError(f"aleph_udp did not start ({' '.join(argv)}): {line!r} {err.strip()}")
    return p, int(line.split()[1])


def check_split(split: Sequence[float]) -> tuple[float, ...]:
    """Several PSs' fractions of the values (Sec. 7): one per PS, each in [0, 1], summing to 1 (within 1e-9); e.g.
    :func:`flowlane.aleph.model.multi_ps_split` of the PSs' bandwidths. Raises ValueError naming the value."""
    fr = tuple(float(f) for f in split)
    if not fr or any(not 0 <= f <= 1 for f in fr) or abs(sum(fr) - 1) > 1e-9:
        raise ValueError(f"split={list(split)} must have one fraction in [0, 1] per PS, summing to 1")
    return fr


def split_bounds(elems: int, split: Sequence[float]) -> list[int]:
    """Value offsets of the q parts: part j is ``[b[j], b[j+1])``, ``b[j] = round(sum(split[:j]) * elems)`` (as tier 0's
    ``HierarchicalAllReduce`` cuts a tensor), so every rank cuts alike."""
    off, acc = [0], 0.0
    for f in check_split(split)[:-1]:
        acc += f
        off.append(min(elems, max(off[-1], round(acc * elems))))
    return [*off, elems]


def run_tree(
    plan: Plan,
    inputs: np.ndarray,
    *,
    drop: float = 0.0,
    seed: int = 0,
    rto_ms: int = 20,
    scale: int = 0,
    timeout_s: float = 120.0,
    sanitize: bool = False,
    hosts: Sequence[str] | None = None,
    ps_host: str | None = None,
    wrap: Sequence[Callable[[list[str]], list[str]] | None] | None = None,
    split: Sequence[float] | None = None,
    ps_hosts: Sequence[str] | None = None,
    ps_wrap: Sequence[Callable[[list[str]], list[str]] | None] | None = None,
) -> TreeRun:
    """Aggregate ``inputs`` (workers x iters x elems int32) through ``plan``'s tree; ``drop`` is the probability
    each process drops a received datagram. ``hosts[w]`` / ``ps_host``: addresses (default 127.0.0.1) and
    ``wrap[w]`` / ``wrap[n]`` (PS): argv wrappers (e.g. ``ip netns exec``) when ranks live in namespaces.

    ``split`` (q fractions, :func:`check_split`): q PSs, PS j at ``ps_hosts[j]`` (``ps_wrap[j]``; both default to
    ``ps_host`` / ``wrap[n]``). Part j (:func:`split_bounds`) runs as its own tier-1 tree under PS j with job id j: every
    aggregator runs a node per part (parent PS j) and every worker a worker per part, all started together, so each
    aggregator sends PS j exactly its part j and the PSs' links work at once. ``stats["ps"][j]`` is PS j's (a part of
    no values has no tree and no entry); the other roles' entries carry their ``"part"``."""
    inputs = np.ascontiguousarray(inputs, dtype="<i4")
    if inputs.ndim != 3 or inputs.shape[0] != plan.n:
        raise ValueError(
            f"inputs must be workers x iters x elems with {plan.n} workers, got shape {inputs.shape}"
        )
    if not 0 <= drop < 1:
        raise ValueError(f"drop={drop!r} must be a probability in [0, 1)")
    if plan.num_flows > MAX_CHILDREN or any(len(c.members) > MAX_CHILDREN for c in plan.clusters):
        raise ValueError(
            f"a node takes at most {MAX_CHILDREN} children (the bitmap's width); plan has |D|="
            f"{plan.num_flows} and clusters of up to {max(len(c.members) for c in plan.clusters)}"
        )
    n, iters, elems = inputs.shape
    hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * n
    ps_host = ps_host or "127.0.0.1"
    wraps = list(wrap) if wrap is not None else [None] * (n + 1)
    bounds = [0, elems] if split is None else split_bounds(elems, split)
    q = len(bounds) - 1
    if ps_hosts is not None and len(ps_hosts) != q:
        raise ValueError(f"ps_hosts={list(ps_hosts)} has {len(ps_hosts)} addresses for {q} PSs (split)")
    if ps_wrap is not None and len(ps_wrap) != q:
        raise ValueError(f"ps_wrap has {len(ps_wrap)} wrappers for {q} PSs (split)")
    exe = str(build(sanitize))
    procs: list[tuple[str, int, subprocess.Popen[str]]] = []
    with tempfile.TemporaryDirectory(prefix="aleph-udp-") as tmp:
        try:
            workers: list[tuple[subprocess.Popen[str], Path, int, int]] = []  # (process, output, part, w)
            for part in range(q):
                a, b = bounds[part], bounds[part + 1]
                if b == a:
                    continue
                host = ps_hosts[part] if ps_hosts is not None else ps_host
                pw = ps_wrap[part] if ps_wrap is not None else wraps[n]
                common = [
                    "--elems",
                    str(b - a),
                    "--iters",
                    str(iters),
                    "--rto-ms",
                    str(rto_ms),
                    "--drop",
                    repr(drop),
                ]
                common += ["--job", str(part)]
                sd = seed + 100_003 * part
                ps, ps_port = _start(
                    [exe, "node", "--children", str(plan.num_flows), "--seed", str(sd), *common], pw
                )
                procs.append(("ps", part, ps))
                parent_of: dict[int, tuple[str, int]] = {}
                for i, c in enumerate(plan.clusters):
                    if len(c.members) == 1:
                        parent_of[c.head] = (f"{host}:{ps_port}", i)
                        continue
                    agg, port = _start([exe, "node", "--children", str(len(c.members)), "--parent",
                                        f"{host}:{ps_port}", "--id", str(i), "--seed", str(sd * 1000 + i + 1),
                                        *common], wraps[c.head])  # fmt: skip
                    procs.append(("aggregator", part, agg))
                    for j, m in enumerate(c.members):
                        parent_of[m] = (f"{hosts[c.head]}:{port}", j)
                for w in range(n):
                    inp, out = Path(tmp) / f"in{w}_{part}", Path(tmp) / f"out{w}_{part}"
                    np.ascontiguousarray(inputs[w, :, a:b]).tofile(inp)
                    parent, lid = parent_of[w]
                    p, _ = _start([exe, "worker", "--wait-go", "1", "--parent", parent, "--id", str(lid), "--scale",
                                   str(scale), "--in", str(inp), "--out", str(out), "--seed",
                                   str(sd * 7919 + w + 17), *common], wraps[w])  # fmt: skip
                    procs.append(("worker", part, p))
                    workers.append((p, out, part, w))
            # every worker is up: start them together (process start-up is not timed)
            t0 = time.perf_counter()
            for p, _, _, _ in workers:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()  # (communicate() closes it)
            for p, _, _, _ in workers:
                p.wait(timeout=timeout_s)
            wall = time.perf_counter() - t0
            stats: dict[str, list[dict[str, Any]]] = {"ps": [], "aggregator": [], "worker": []}
            for role, part, p in procs:
                out_text, err = p.communicate(timeout=timeout_s)
                if p.returncode != 0:
                    raise RuntimeError(
                        f"aleph_udp {role} (part {part}) exited {p.returncode}: {err.strip()[-2000:]}"
                    )
                stats[role].append({**json.loads(out_text.strip().splitlines()[-1]), "part": part})
            outputs = np.zeros((n, iters, elems), dtype="<i4")
            for _, o, part, w in workers:
                a, b = bounds[part], bounds[part + 1]
                outputs[w, :, a:b] = np.fromfile(o, dtype="<i4").reshape(iters, b - a)
        finally:
            for _, _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return TreeRun(outputs, stats, wall)
