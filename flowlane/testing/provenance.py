"""What produced a result file: the shared envelope every benchmark and GPU check writes into its JSON.

``provenance()`` records the command line, the commit (and whether tracked files had local changes), the host, its
CPU count and, where torch sees one, the GPU. A copy of the tree sent elsewhere (the GPU machine) takes the commit
from ``FLOWLANE_COMMIT``, set by whoever sent it; it wins over a ``.git`` there, which may be stale.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def provenance(command: str | None = None, device: str | None = None) -> dict[str, Any]:
    """The envelope: ``command`` (default: this process's own command line), ``commit``, ``dirty``, ``host``,
    ``cpus``, ``device`` (given, or the CUDA device torch sees, or ``cpu``) and the UTC time."""
    # whoever sent a copy of the tree elsewhere knows its commit; a .git beside that copy may be stale (the GPU
    # machine's was the session's first commit), so FLOWLANE_COMMIT wins when it is set
    sent = os.environ.get("FLOWLANE_COMMIT")
    commit = sent or _git("rev-parse", "HEAD")
    dirty: bool | None = (
        bool(_git("status", "--porcelain", "--untracked-files=no")) if commit and not sent else None
    )
    if not commit:
        commit = "unknown (no .git and no FLOWLANE_COMMIT)"
    if device is None:
        device = "cpu"
        torch = sys.modules.get("torch")  # never imports torch itself: a pure-core benchmark stays torch-free
        if torch is not None and torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    if command is None:
        argv0 = sys.argv[0]
        command = " ".join(
            shlex.quote(a)
            for a in ([sys.executable.rsplit("/", 1)[-1], argv0] if argv0.endswith(".py") else [argv0])
            + sys.argv[1:]
        )
    return {
        "command": command,
        "commit": commit,
        "dirty": dirty,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "device": device,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(
    path: str | os.PathLike[str],
    doc: dict[str, Any],
    command: str | None = None,
    detail: dict[str, Any] | None = None,
) -> Path:
    """Write ``doc`` with its :func:`provenance` envelope as indented JSON to ``path`` (folders made), atomically:
    a crash leaves the previous file, never half a new one. Returns the path.

    ``detail`` (optional): bulky per-op or per-point data (timelines, raw sweeps) that backs the figures but that a
    reader does not open; it goes, with the same envelope, to ``<stem>.detail.json.gz`` beside ``path``, and ``doc``
    names that file under ``detail_file`` (issue 29: summaries committed, large sweeps compressed beside them)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = provenance(command)
    if detail:
        side = out.with_name(f"{out.stem}.detail.json.gz")
        tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
        # mtime=0: the same detail gives the same bytes (no spurious diffs when a result is rewritten)
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(json.dumps({**detail, "provenance": env}).encode())
        os.replace(tmp, side)
        doc = {**doc, "detail_file": side.name}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**doc, "provenance": env}, indent=1))
    os.replace(tmp, out)
    return out


def read_detail(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``detail`` that :func:`write_result` put beside the result at ``path`` (raises FileNotFoundError naming
    the file when there is none)."""
    out = Path(path)
    doc = json.loads(out.read_text())
    name = doc.get("detail_file")
    if not name:
        raise FileNotFoundError(f"{out} names no detail_file")
    with gzip.open(out.with_name(name), "rt") as f:
        return json.load(f)
