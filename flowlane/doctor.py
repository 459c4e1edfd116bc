"""`flowlane doctor`: what this machine can use."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _package(name: str, dist: str, import_name: str | None = None) -> Check:
    v = _version(dist)
    if v is None:
        return Check(name, False, "not installed")
    try:
        # a framework's import-time notices (Megatron's "no Transformer Engine") would bury the table; what they
        # say is reported as rows instead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(import_name or dist)
    except Exception as e:  # noqa: BLE001 - report any import failure
        return Check(name, False, f"{v} installed but import fails: {type(e).__name__}: {str(e)[:120]}")
    return Check(name, True, v)


def _torch_checks() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001
        return [Check("torch", False, f"import fails: {e}")]
    out = [
        Check("torch", True, torch.__version__),
        Check("gloo", dist.is_available() and dist.is_gloo_available(), "torch.distributed gloo backend"),
    ]
    cuda = torch.cuda.is_available()
    out.append(Check("CUDA", cuda, f"{torch.cuda.device_count()} device(s)" if cuda else "no GPU / driver"))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        out.append(Check("NCCL", cuda, f"{nccl} ({'usable' if cuda else 'library only: needs a GPU'})"))
    except Exception as e:  # noqa: BLE001
        out.append(Check("NCCL", False, f"unavailable: {e}"))
    return out


def _kvikio() -> Check:
    for dist_name in ("kvikio-cu13", "kvikio-cu12"):
        v = _version(dist_name)
        if v:
            break
    else:
        return Check("kvikio/GDS", False, "not installed (llm lane only)")
    try:
        import kvikio
        import kvikio.defaults

        # kvikio >= 25 exposes settings through defaults.get(); older releases had compat_mode()
        getter = getattr(kvikio.defaults, "get", None)
        compat = getter("compat_mode") if getter else kvikio.defaults.compat_mode()
        gds = os.path.exists("/run/udev") and shutil.which("gdscheck") is not None
        return Check(
            "kvikio/GDS",
            True,
            f"{v}; compat mode {compat}; GDS tools {'found' if gds else 'absent'}"
            f"{'' if _has_libcuda() else '; no libcuda: file I/O unavailable, posix backend is used'}",
        )
    except Exception as e:  # noqa: BLE001
        return Check("kvikio/GDS", False, f"{v} import fails: {e}")


def _transformer_engine() -> Check:
    v = _version("transformer-engine") or _version("transformer_engine")
    if v is None:
        return Check(
            "Transformer Engine",
            False,
            "not installed: Megatron-core runs its local layers (no FP8 or TE's fused kernels)",
        )
    return Check("Transformer Engine", True, v)


def _offload_tiers(directory: str | None = None) -> Check:
    """Which activation-offload tiers work here: pinned host memory needs CUDA; the SSD tier's O_DIRECT is probed
    with one aligned 4 KiB write in ``directory`` (default: the temporary folder)."""
    from flowlane.offload.backends import probe_o_direct

    d = Path(directory or tempfile.gettempdir())
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        cuda = False
    pinned = "pinned_cpu: yes" if cuda else "pinned_cpu: needs CUDA"
    if not os.access(d, os.W_OK):
        return Check("activation offload", cuda, f"{pinned}; posix in {d}: not writable by this user")
    # probed in a private folder of its own: a fixed name in a shared one (/tmp) could be another user's symlink
    with tempfile.TemporaryDirectory(prefix="flowlane-doctor-", dir=d) as private:
        o_direct = probe_o_direct(Path(private))
    posix = f"posix in {d}: {'O_DIRECT' if o_direct else 'buffered (no O_DIRECT there)'}"
    return Check("activation offload", True, f"{pinned}; {posix}; offload.dirs picks the SSD folders")


def _has_libcuda() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _netns() -> Check:
    ip, tc = shutil.which("ip"), shutil.which("tc")
    if not ip or not tc:
        return Check("netns+tc", False, f"missing: {'ip ' if not ip else ''}{'tc' if not tc else ''}".strip())
    if os.geteuid() != 0:
        return Check("netns+tc", False, "ip and tc present, but not root: link emulation needs root")
    name = f"flowlane-doctor-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return Check("netns+tc", False, f"ip netns add failed: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return Check("netns+tc", True, "root; network namespaces + tc available for link emulation")


def environment() -> Check:
    """Which environment (lane) this report is about: each lane has its own packages, so the same machine reports
    differently from .venv-llm and .venv-gnn."""
    name = os.path.basename(sys.prefix.rstrip(os.sep))
    lane = name.removeprefix(".venv-") if name.startswith(".venv-") else None
    where = f"lane {lane!r}" if lane else "not a flowlane lane"
    return Check("environment", True, f"{where}: Python {sys.version.split()[0]} at {sys.executable}")


def checks(offload_dir: str | None = None) -> list[Check]:
    out = [environment(), *_torch_checks()]
    out += [
        _package("megatron-core", "megatron-core", "megatron.core"),
        _transformer_engine(),
        _package("deepspeed", "deepspeed"),
        _package("DGL", "dgl"),
        _kvikio(),
        _offload_tiers(offload_dir),
        _netns(),
    ]
    try:  # PyTorch-Direct (issue 39): which feature-gather path a FeatureStore picks here, and why
        from flowlane.direct import default_choice

        c = default_choice()
        out.append(Check("PyTorch-Direct gather", c.path == "zero-copy", f"{c.path}: {c.reason}"))
    except Exception as e:  # noqa: BLE001
        out.append(Check("PyTorch-Direct gather", False, f"unavailable: {e}"))
    so = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "nccl_net_plugin",
        "build",
        "libnccl-net-flowlane.so",
    )
    out.append(
        Check(
            "NCCL net plugin",
            os.path.exists(so),
            so if os.path.exists(so) else "not built (make -C nccl_net_plugin)",
        )
    )
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="show what this machine and environment (lane) can use",
        description="What this machine can use, as seen from this Python environment (lane): run it "
        "from each lane, e.g. .venv-llm/bin/flowlane doctor and .venv-gnn/bin/flowlane doctor.",
    )
    p.add_argument(
        "--offload-dir",
        metavar="DIR",
        default=None,
        help="the folder to probe for the activation offload's SSD tier (O_DIRECT or buffered; default: the "
        "temporary folder), e.g. a mount you would give offload.dirs",
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from rich.console import Console
    from rich.table import Table

    table = Table(title="flowlane doctor")
    table.add_column("component")
    table.add_column("usable")
    table.add_column("detail")
    offload_dir = getattr(args, "offload_dir", None)
    if offload_dir is not None and not os.path.isdir(offload_dir):
        raise SystemExit(f"doctor: --offload-dir {offload_dir!r} is not a directory")
    for c in checks(offload_dir):
        table.add_row(c.name, "[green]yes[/]" if c.ok else "[yellow]no[/]", c.detail)
    Console().print(table)
    return 0
