"""First GPU check of flowlane.offload: bitwise-equal gradients and memory/time per I/O backend, in one short run.

A small deterministic transformer (``Block``: LayerNorm, QKV matmul, explicit softmax attention, projection, GELU MLP)
trains for ``--steps`` SGD steps from the same weights and inputs: once without offload (the baseline), once more
without offload (is the baseline itself bitwise reproducible?), then once per backend with
``flowlane.offload.install(model, OffloadConfig(...), scope_classes=["Block"])``. Every step's loss and every parameter
gradient must be ``torch.equal`` to the baseline's.

Steps: step 0 is the warm-up; it waits for all stores after forward (``cache.wait_io()``) so that every offloaded
activation really goes to the backend and is read back from it. Later steps alternate "natural" (no wait: what
training would do; with a fast GPU most activations are still being written when backward needs them and are
forwarded from memory) and "roundtrip" (wait after forward, as in step 0). Peak memory and median step time are
reported per mode. cuda: peak = ``max_memory_allocated`` after ``reset_peak_memory_stats`` minus the memory held
before the step; both devices: the cache's own peak of saved-activation bytes alive (baseline: the same accounting
with ``track_saved_tensors``).

Never hangs: each run happens in a worker thread with a deadline (a stuck run is recorded as "timeout" with the stacks
of its threads, and the process leaves with ``os._exit``), later runs share the remaining time budget, and
``faulthandler`` kills the process at ``--hard-s`` seconds after it started. The JSON is rewritten (temp file +
``os.replace``) after every run, so a kill still leaves the finished runs. Exit code: 0 when every available backend
passed, 1 when one mismatched, errored, timed out or failed a check (or a --require'd backend was unavailable),
2 when the run could not start.

    python3 -m benchmarks.offload_gpu_check --device cuda --out results/offload_gpu_check.json
    .venv-llm/bin/python -m benchmarks.offload_gpu_check --device cpu --out /tmp/offload_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import gc
import importlib
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flowlane.offload import BackendUnavailableError, OffloadConfig, install, track_saved_tensors  # noqa: E402
from flowlane.sim.output import write_json  # noqa: E402

ALL_BACKENDS = ("posix", "pinned_cpu", "kvikio", "null", "auto")
DISK_BACKENDS = ("posix", "kvikio", "auto")
STAT_KEYS = ("bytes_written", "bytes_read", "bytes_cancelled", "forwards", "cancellations", "loads", "sync_loads",
             "fallbacks", "io_errors", "storages_tracked", "storages_offloaded", "storages_kept", "dedup_hits",
             "small_skips", "param_skips", "outside_scope", "version_errors")
MiB = 1024 * 1024


# ------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """LayerNorm -> fused QKV -> softmax(q k^T / sqrt(d)) v -> proj (+res) -> LayerNorm -> MLP (+res)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # three same-shape views of one storage
        q, k, v = (z.view(b, s, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads)), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, hidden: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(blocks))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, hidden)  # outside every scope: kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------------------------------------- helpers
def _process_age() -> float:
    """Seconds since this process started (interpreter start + imports included); 0 where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


def _fs_type(path: str) -> str | None:
    best, fstype = "", None
    with contextlib.suppress(OSError):
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
    return fstype


def _kvikio_info() -> dict[str, Any]:
    """Import kvikio (as the backend would) and report version and mode; never raises."""
    info: dict[str, Any] = {"importable": False, "env_KVIKIO_COMPAT_MODE": os.environ.get("KVIKIO_COMPAT_MODE"),
                            "nvidia_fs_loaded": os.path.exists("/proc/driver/nvidia-fs")}
    try:
        import kvikio  # noqa: PLC0415 - optional, only to report what the backend will use
    except Exception as e:  # ImportError, or OSError/RuntimeError when libkvikio or libcufile cannot be loaded
        info["error"] = f"{type(e).__name__}: {e}"
        return info
    info["importable"] = True
    info["version"] = getattr(kvikio, "__version__", None)
    info["path"] = os.path.dirname(getattr(kvikio, "__file__", "") or "")
    def sub(name: str) -> Any:  # ``import kvikio`` does not bind kvikio.defaults / kvikio.cufile_driver
        return importlib.import_module(f"kvikio.{name}")

    probes: dict[str, Callable[[], Any]] = {
        "compat_mode": lambda: sub("defaults").get("compat_mode"),
        "compat_mode_preferred": lambda: sub("defaults").is_compat_mode_preferred(),
        "is_gds_available": lambda: sub("cufile_driver").get("is_gds_available"),
        "libcufile_version": lambda: sub("cufile_driver").libcufile_version(),
    }
    for key, fn in probes.items():
        try:
            v = fn()
            info[key] = f"{v.name} ({int(v)})" if hasattr(v, "name") else (v if isinstance(v, bool) else str(v))
        except Exception as e:  # the API differs across kvikio versions; informational only
            info[key] = f"n/a ({type(e).__name__}: {e})"
    return info


def _driver_version() -> str | None:
    with contextlib.suppress(Exception):
        import ctypes  # noqa: PLC0415

        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    return None


def _probe_kvikio(timeout: float) -> dict[str, Any]:
    info: dict[str, Any] = {}
    box = _run_in_thread(lambda: info.update(_kvikio_info()), timeout, name="kvikio-probe")
    return info if not box else {"importable": False, **{k: v for k, v in box.items() if k != "exc"},
                                 "error": box.get("error", f"importing kvikio took more than {timeout:.0f} s")}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stats(cache: Any) -> dict[str, int]:
    s = cache.stats_snapshot().as_dict()
    return {k: int(s.get(k, 0)) for k in STAT_KEYS}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mode(i: int) -> str:
    return "warmup" if i == 0 else ("natural" if i % 2 == 1 else "roundtrip")


# ------------------------------------------------------------------------------------------------- one run
class Run:
    """Steps of one configuration (baseline or a backend); runs in a worker thread, fills ``self.steps``."""

    def __init__(self, name: str, a: argparse.Namespace, dev: torch.device, base_model: Net,
                 inputs: list[torch.Tensor], ref: list[dict[str, Any]] | None, soft_deadline: float) -> None:
        self.name, self.a, self.dev = name, a, dev
        self.base_model, self.inputs, self.ref = base_model, inputs, ref
        self.soft_deadline = soft_deadline
        self.steps: list[dict[str, Any]] = []
        self.keep: list[dict[str, Any]] = []  # baseline only: loss and grads per step
        self.describe: dict[str, Any] | None = None
        self.leftover_files: int | None = None
        self.stopped_early = False
        self.phase = "setup"
        self.spy: dict[str, Any] | None = None
        self.dir = ""

    def __call__(self) -> None:
        model = copy.deepcopy(self.base_model)  # every run starts from the same weights; hooks stay on the copy
        names = [n for n, _ in model.named_parameters()]
        cache = None
        if self.name not in ("baseline", "baseline_repeat"):
            a = self.a
            self.dir = os.path.join(a.workdir, self.name)  # own directory: leftovers of a stuck run stay apart
            os.makedirs(self.dir, exist_ok=True)
            cfg = OffloadConfig(backend=self.name, dirs=(self.dir,), min_bytes=a.min_bytes, keep_last_k=a.keep_last_k,
                                offload_cpu_tensors=self.dev.type == "cpu", on_io_error="raise",
                                o_direct=a.o_direct, kvikio_compat_mode=a.kvikio_compat)
            self.phase = "install"
            cache = install(model, cfg, scope_classes=["Block"])
            self.describe = cache.backend.describe()
            self.spy = _spy(cache.backend)
        try:
            for i in range(self.a.steps):
                if i > 0 and self.steps:
                    est = self.steps[-1]["wall_s"]  # the warm-up step pays one-time costs: use the latest
                    if time.monotonic() + est > self.soft_deadline:
                        self.stopped_early = True
                        break
                self.phase = f"step {i}"
                self.steps.append(self._step(i, model, names, cache))
        finally:
            if cache is not None:
                self.phase = "close"
                cache.close()  # removes module hooks, saved-tensor hooks and the run directories
                self.leftover_files = sum(len(fs) + len(ds) for _, ds, fs in os.walk(self.dir))
            self.phase = "done"

    def _step(self, i: int, model: Net, names: list[str], cache: Any) -> dict[str, Any]:
        dev, mode = self.dev, _mode(i)
        w0 = time.monotonic()
        model.zero_grad(set_to_none=True)
        gc.collect()
        _sync(dev)
        rec: dict[str, Any] = {"step": i, "mode": mode}
        mem0 = 0
        if dev.type == "cuda":
            mem0 = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        s0 = None
        if cache is not None:
            cache.reset_peak()
            s0 = _stats(cache)
        tracker = track_saved_tensors(self.a.min_bytes, list(model.parameters())) if cache is None \
            else contextlib.nullcontext()
        with tracker as res:
            t0 = time.perf_counter()
            loss = model(self.inputs[i]).float().pow(2).mean()
            if cache is not None and mode != "natural":
                _sync(dev)
                t1 = time.perf_counter()
                cache.wait_io()  # every store done: backward reads everything back from the backend
                t2 = time.perf_counter()
                rec["forward_s"], rec["wait_stores_s"] = t1 - t0, t2 - t1
            tb = time.perf_counter()
            loss.backward()
            if cache is not None:
                cache.wait_io()
            _sync(dev)
            t3 = time.perf_counter()
        rec["time_s"] = t3 - t0
        if cache is not None and mode != "natural":
            rec["backward_s"] = t3 - tb
        if dev.type == "cuda":
            rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated(dev) - mem0
        if cache is not None:
            s1 = _stats(cache)
            rec["stats"] = {k: s1[k] - s0[k] for k in STAT_KEYS}  # type: ignore[index]
            rec["saved_peak_bytes"] = cache.stats_snapshot().peak_resident_all_bytes
        else:
            rec["saved_peak_bytes"] = res.peak
        grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
        lossv = loss.detach().clone()
        del loss
        if self.ref is None:
            self.keep.append({"loss": lossv, "grads": grads})
        else:
            rec.update(_compare(self.ref[i], lossv, grads, names))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.a.lr)
        rec["wall_s"] = time.monotonic() - w0
        return rec


def _spy(backend: Any) -> dict[str, Any]:
    """Count the backend's calls and keep every exception it raises, whatever its type: the cache turns OSError and
    RuntimeError into its own errors, but another exception in a store job ends in a future nobody reads."""
    spy: dict[str, Any] = {"write": 0, "write_bytes": 0, "read": 0, "read_bytes": 0, "delete": 0, "exceptions": [],
                           "write_devices": set(), "read_devices": set()}
    lock = threading.Lock()

    def wrap(meth: str) -> None:
        orig = getattr(backend, meth)

        def call(*args: Any) -> Any:
            try:
                r = orig(*args)
            except BaseException as e:
                with lock:
                    spy["exceptions"].append(f"{meth}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
                raise
            with lock:
                spy[meth] += 1
                if meth == "write":
                    spy["write_bytes"] += args[1].numel()
                    spy["write_devices"].add(str(args[1].device))
                elif meth == "read":
                    spy["read_bytes"] += args[1]
                    spy["read_devices"].add(str(r.device))
                    if r.numel() != args[1] or str(r.device) != str(args[2]):
                        spy["exceptions"].append(f"read returned {r.numel()} bytes on {r.device}, "
                                                 f"wanted {args[1]} on {args[2]}")
            return r

        setattr(backend, meth, call)  # instance attribute: only this cache's backend is wrapped

    for meth in ("write", "read", "delete"):
        wrap(meth)
    return spy


def _compare(ref: dict[str, Any], loss: torch.Tensor, grads: list[torch.Tensor | None],
             names: list[str]) -> dict[str, Any]:
    bad = []
    for name, g0, g1 in zip(names, ref["grads"], grads, strict=True):
        if g0 is None or g1 is None:
            if (g0 is None) != (g1 is None):
                bad.append({"param": name, "why": "grad is None in one run only"})
            continue
        if g0.shape != g1.shape or g0.dtype != g1.dtype or not torch.equal(g0, g1):
            d = (g0.float() - g1.float()).abs()
            bad.append({"param": name, "max_abs_diff": float(d.max()), "n_diff": int((d != 0).sum()),
                        "nan": bool(torch.isnan(g1).any())})
    return {"loss_equal": bool(torch.equal(ref["loss"], loss)), "loss": float(loss), "grads_equal": not bad,
            "n_grad_mismatch": len(bad), "grad_mismatch": bad[:8]}


def _run_in_thread(fn: Callable[[], None], timeout: float, name: str = "") -> dict[str, Any]:
    """Run ``fn`` in a daemon thread; {} when it returned, its error and traceback when it raised, or the stacks of
    the threads involved when it is still running after ``timeout`` seconds (it is abandoned)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # recorded, never lost: the next backend still runs
            box["error"] = f"{type(e).__name__}: {e}"
            box["exc"] = e
            box["traceback"] = traceback.format_exc()

    th = threading.Thread(target=target, name=f"check-{getattr(fn, 'name', name)}", daemon=True)
    th.start()
    th.join(max(0.1, timeout))
    if th.is_alive():
        frames = sys._current_frames()
        stacks = {t.name: "".join(traceback.format_stack(frames[t.ident]))[-4000:]
                  for t in threading.enumerate()
                  if t.ident in frames and (t is th or t.name.startswith(("flowlane", "ThreadPool")))}
        return {"timeout": True, "phase": getattr(fn, "phase", name), "stacks": stacks}
    return box


# ------------------------------------------------------------------------------------------------- summary
def _summarize(name: str, run: Run, box: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"steps_done": len(run.steps), "stopped_early_for_time": run.stopped_early}
    if run.describe is not None:
        out["backend_describe"] = run.describe
    if run.leftover_files is not None:
        out["files_left_after_close"] = run.leftover_files
    if run.spy is not None:
        out["backend_calls"] = {k: sorted(v) if isinstance(v, set) else v for k, v in run.spy.items()}
    checks: list[str] = []
    if box.get("timeout"):
        out["status"] = "timeout"
        out["timeout"] = {k: box[k] for k in ("phase", "stacks")}
    elif isinstance(box.get("exc"), BackendUnavailableError):
        out["status"] = "unavailable"
        out["reason"] = box["error"]
    elif "error" in box:
        out["status"] = "error"
        out["error"] = box["error"]
        out["traceback"] = box["traceback"]
    if run.ref is not None:
        eq = [s for s in run.steps if s.get("loss_equal") and s.get("grads_equal")]
        out["steps_equal"] = len(eq)
        if len(eq) != len(run.steps):
            checks.append(f"{len(run.steps) - len(eq)} of {len(run.steps)} steps not bitwise equal to the baseline")
    if not run.steps and "status" not in out:
        checks.append("no step ran")
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for s in run.steps:
        by_mode.setdefault(s["mode"], []).append(s)
    for mode, ss in sorted(by_mode.items()):
        m: dict[str, Any] = {"n": len(ss), "time_s_median": _median([s["time_s"] for s in ss]),
                             "saved_peak_bytes_max": max(s["saved_peak_bytes"] for s in ss)}
        if "peak_mem_bytes" in ss[0]:
            m["peak_mem_bytes_max"] = max(s["peak_mem_bytes"] for s in ss)
        if "stats" in ss[0]:
            for k in ("bytes_written", "bytes_read", "forwards", "cancellations", "sync_loads"):
                m[f"{k}_per_step"] = _median([float(s["stats"][k]) for s in ss])
            rt = [s for s in ss if "wait_stores_s" in s and s["stats"]["bytes_written"]]
            if rt:
                m["write_GBps"] = _median([s["stats"]["bytes_written"] / max(1e-9, s["forward_s"] + s["wait_stores_s"])
                                           / 1e9 for s in rt])
                m["read_GBps"] = _median([s["stats"]["bytes_read"] / max(1e-9, s["backward_s"]) / 1e9 for s in rt])
        out[mode] = m
    total = {k: sum(s.get("stats", {}).get(k, 0) for s in run.steps) for k in STAT_KEYS} if run.ref else {}
    if run.describe is not None:
        out["stats_total"] = total
        for k in ("io_errors", "fallbacks", "version_errors"):
            if total[k]:
                checks.append(f"{k}={total[k]} (on_io_error='raise'; the backend's I/O failed)")
        if name != "null":
            rt = [s for s in run.steps if s["mode"] != "natural"]
            if rt and not all(s["stats"]["bytes_read"] > 0 for s in rt):
                checks.append("a roundtrip step read nothing back from the backend (the read path did not run)")
            if rt and not all(s["stats"]["bytes_written"] > 0 for s in rt):
                checks.append("a roundtrip step wrote nothing (nothing was offloaded: check min_bytes)")
        if run.spy is not None and run.spy["exceptions"]:
            checks.append(f"the backend raised {len(run.spy['exceptions'])} time(s) (see backend_calls.exceptions)")
        if run.leftover_files:
            checks.append(f"{run.leftover_files} files/dirs left in the offload directory after close()")
    if base is not None:
        for mode in ("warmup", "natural", "roundtrip"):
            b = base.get("timed") if mode != "warmup" else base.get("warmup")
            if mode in out and b:
                r = out[mode]
                r["time_ratio_vs_baseline"] = _ratio(r["time_s_median"], b["time_s_median"])
                r["saved_peak_ratio_vs_baseline"] = _ratio(r["saved_peak_bytes_max"], b["saved_peak_bytes_max"])
                if "peak_mem_bytes_max" in r:
                    r["peak_mem_ratio_vs_baseline"] = _ratio(r["peak_mem_bytes_max"], b.get("peak_mem_bytes_max"))
    out["checks_failed"] = checks
    if "status" not in out:
        out["status"] = "passed" if not checks else ("mismatch" if any("bitwise" in c for c in checks)
                                                      else "failed_checks")
    return out


def _baseline_summary(run: Run) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, ss in (("warmup", run.steps[:1]), ("timed", run.steps[1:])):
        if ss:
            out[key] = {"n": len(ss), "time_s_median": _median([s["time_s"] for s in ss]),
                        "saved_peak_bytes_max": max(s["saved_peak_bytes"] for s in ss)}
            if "peak_mem_bytes" in ss[0]:
                out[key]["peak_mem_bytes_max"] = max(s["peak_mem_bytes"] for s in ss)
    return out


def _fmt(x: float | None, scale: float = 1.0, nd: int = 1) -> str:
    return "-" if x is None else f"{x / scale:.{nd}f}"


def _table(res: dict[str, Any]) -> str:
    cuda = res["device"] == "cuda"
    mem = "peak_mem_bytes_max" if cuda else "saved_peak_bytes_max"
    memr = "peak_mem_ratio_vs_baseline" if cuda else "saved_peak_ratio_vs_baseline"
    rows = [("run", "status", "equal", f"{'GPU' if cuda else 'saved'} MiB rt", "x base", "step ms nat", "x base",
             "step ms rt", "x base", "wr MiB/st", "wr GB/s", "rd GB/s", "fwd/canc nat")]
    b = res.get("baseline", {})
    bt = b.get("timed", {}) or b.get("warmup", {})
    if b:
        rows.append(("baseline", b.get("status", "?"), "-", _fmt(bt.get(mem), MiB), "1.00",
                     _fmt(bt.get("time_s_median"), 1e-3), "1.00", "-", "-", "-", "-", "-", "-"))
    br = res.get("baseline_repeat", {})
    if br:
        rows.append(("baseline_repeat", br.get("status", "?"), f"{br.get('steps_equal', 0)}/{br.get('steps_done', 0)}",
                     *("-",) * 10))
    for name, r in res.get("backends", {}).items():
        rt = r.get("roundtrip") or r.get("warmup") or {}
        nat = r.get("natural") or {}
        eq = f"{r['steps_equal']}/{r['steps_done']}" if r.get("steps_done") else "-"
        fc = "-" if not nat else f"{_fmt(nat.get('forwards_per_step'), nd=0)}/{_fmt(nat.get('cancellations_per_step'), nd=0)}"
        rows.append((name, r.get("status", "?"), eq, _fmt(rt.get(mem), MiB), _fmt(rt.get(memr), nd=2),
                     _fmt(nat.get("time_s_median"), 1e-3), _fmt(nat.get("time_ratio_vs_baseline"), nd=2),
                     _fmt(rt.get("time_s_median"), 1e-3), _fmt(rt.get("time_ratio_vs_baseline"), nd=2),
                     _fmt(rt.get("bytes_written_per_step"), MiB), _fmt(rt.get("write_GBps"), nd=2),
                     _fmt(rt.get("read_GBps"), nd=2), fc))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("rt = roundtrip steps (warm-up if none): all stores finish before backward; nat = natural steps. "
                 + ("GPU MiB = max_memory_allocated during the step minus memory held before it."
                    if cuda else "saved MiB = peak bytes of saved activations alive (the cache's accounting)."))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="offload_gpu_check.json", help="JSON result path (written atomically)")
    p.add_argument("--steps", type=int, default=5, help="steps per run: 1 warm-up + alternating natural/roundtrip")
    p.add_argument("--backends", default=None,
                   help="comma list (cuda default: posix,pinned_cpu,kvikio; cpu default: posix,pinned_cpu,null)")
    p.add_argument("--require", default="", help="comma list of backends that must be available (else exit 1)")
    p.add_argument("--dir", default=None, help="where offload files go (a private subdirectory is made and removed; "
                                               "default: the system temp directory)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--min-bytes", type=int, default=None, help="default: half of one b*s*h activation")
    p.add_argument("--keep-last-k", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--o-direct", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--kvikio-compat", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (cpu default 1: with OpenMP on a loaded host, 2 threads made the "
                        "same step 100x slower in some threads than others; cuda default: torch's choice)")
    p.add_argument("--budget-s", type=float, default=75.0,
                   help="soft time budget from process start; runs share what is left, stuck runs are abandoned")
    p.add_argument("--hard-s", type=float, default=86.0, help="faulthandler kills the process at this age")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    big = dict(hidden=1024, heads=8, seq=1024, batch=4, blocks=8, dtype="bfloat16")
    small = dict(hidden=64, heads=4, seq=64, batch=2, blocks=4, dtype="float32")
    for k, v in (big if cuda else small).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.hidden % a.heads:
        p.error("--hidden must be a multiple of --heads")
    if a.threads is None and not cuda:
        a.threads = 1
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    if a.steps < 1:
        p.error("--steps must be >= 1")
    a.backends = [b for b in (a.backends or ("posix,pinned_cpu,kvikio" if cuda else "posix,pinned_cpu,null"))
                  .split(",") if b]
    a.require = [b for b in a.require.split(",") if b]
    for b in a.backends + a.require:
        if b not in ALL_BACKENDS:
            p.error(f"unknown backend {b!r}; choose from {ALL_BACKENDS}")
    elem = torch.empty(0, dtype=getattr(torch, a.dtype)).element_size()
    if a.min_bytes is None:
        a.min_bytes = max(4096, a.batch * a.seq * a.hidden * elem // 2)
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    age0 = _process_age()
    if age0 > 30.0:  # implausible for interpreter start + imports (a sandbox's /proc may disagree): count from now
        age0 = 0.0
    t_start = time.monotonic() - age0
    deadline = t_start + a.budget_s
    faulthandler.dump_traceback_later(max(5.0, a.hard_s - age0), exit=True)  # last resort: never outlive the limit
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read at first matmul)
    if a.kvikio_compat != "auto":
        os.environ["KVIKIO_COMPAT_MODE"] = a.kvikio_compat.upper()  # before kvikio is imported below
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    out_path = Path(a.out)
    dev = torch.device(a.device)
    res: dict[str, Any] = {"label": "?", "device": a.device, "complete": False, "python": platform.python_version(),
                           "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node()}
    with contextlib.suppress(ImportError):
        import numpy  # noqa: PLC0415

        res["numpy"] = numpy.__version__
    if dev.type == "cuda" and not torch.cuda.is_available():
        res.update(label="not run: --device cuda but torch.cuda.is_available() is False", exit_code=2)
        write_json(out_path, res)
        print(res["label"])
        return 2
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    res["label"] = f"measured on {name}"
    if dev.type == "cuda":
        res["cuda_driver"] = _driver_version()
        res["gpu_mem_total_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    res["kvikio"] = {"probed": False}  # probed just before the first run that may use it (import can fail or hang)
    a.workdir = tempfile.mkdtemp(prefix="flowlane-gpucheck-", dir=a.dir)
    res["config"] = {k: v for k, v in vars(a).items()}
    res["config"]["dir_fstype"] = _fs_type(a.workdir)
    res["config"]["cpu_threads"] = torch.get_num_threads()
    res["backends"] = {}
    print(f"{res['label']}: torch {torch.__version__}, cuda {torch.version.cuda}, kvikio "
          f"{res['kvikio'].get('version', res['kvikio'].get('error', 'not probed'))}; model {a.blocks}x Block "
          f"h={a.hidden} s={a.seq} b={a.batch} {a.dtype}, min_bytes={a.min_bytes}, steps={a.steps}, "
          f"dir={a.workdir} ({res['config']['dir_fstype']})", flush=True)

    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    with torch.device(dev):
        base_model = Net(a.hidden, a.heads, a.blocks).to(dtype)
    base_model.requires_grad_(True)
    g = torch.Generator(device=dev).manual_seed(1234)
    inputs = [torch.randn(a.batch, a.seq, a.hidden, generator=g, device=dev, dtype=dtype) for _ in range(a.steps)]

    timed_out = False
    runs = ["baseline", "baseline_repeat", *a.backends]
    weights = {"baseline": 0.3, "baseline_repeat": 0.3, "null": 0.5, "pinned_cpu": 0.7}
    ref: list[dict[str, Any]] | None = None
    base_sum: dict[str, Any] | None = None
    rc = 0
    for idx, rname in enumerate(runs):
        now = time.monotonic()
        left = [weights.get(r, 1.0) for r in runs[idx:]]
        share = max(0.0, deadline - now) * left[0] / sum(left)
        hard = max(3.0, min(max(0.0, deadline - now) - 2.0 * (len(left) - 1), max(2.0 * share, 10.0)))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        run = Run(rname, a, dev, base_model, inputs, ref if rname != "baseline" else None,
                  math.inf if rname == "baseline" else now + share)  # the baseline must do every step
        if rname in ("kvikio", "auto") and not res["kvikio"].get("probed", True):
            res["kvikio"] = _probe_kvikio(min(20.0, hard))
            timed_out |= bool(res["kvikio"].get("timeout"))
        if rname == "kvikio" and dev.type != "cuda":
            box: dict[str, Any] = {"exc": BackendUnavailableError("kvikio needs --device cuda (GPU tensors and a "
                                                                  "CUDA driver); this run is on CPU"),
                                   "error": "BackendUnavailableError: kvikio needs --device cuda"}
        elif rname in ("kvikio", "auto") and res["kvikio"].get("timeout"):
            box = {"timeout": True, "phase": "import kvikio", "stacks": res["kvikio"].get("stacks", {})}
        elif rname == "kvikio" and not res["kvikio"].get("importable"):
            box = {"exc": BackendUnavailableError(res["kvikio"].get("error")),
                   "error": f"BackendUnavailableError: kvikio not importable: {res['kvikio'].get('error')}"}
        else:
            box = _run_in_thread(run, hard)
        timed_out |= bool(box.get("timeout"))
        if rname == "baseline":
            base_sum = _baseline_summary(run)
            base_sum["steps_done"] = len(run.steps)
            if "error" in box or box.get("timeout") or len(run.steps) < a.steps:
                base_sum["status"] = "error" if not box.get("timeout") else "timeout"
                base_sum.update({k: box[k] for k in ("error", "traceback", "phase", "stacks") if k in box})
                res["baseline"] = base_sum
                res["exit_code"] = rc = 1
                break
            base_sum["status"] = "ok"
            base_sum["losses"] = [float(k["loss"]) for k in run.keep]
            ref = run.keep
            res["baseline"] = base_sum
        elif rname == "baseline_repeat":
            s = _summarize(rname, run, box, base_sum)
            s["status"] = "deterministic" if s["status"] == "passed" else s["status"]
            res["baseline_repeat"] = s
        else:
            s = _summarize(rname, run, box, base_sum)
            if s["status"] == "mismatch" and res["baseline_repeat"]["status"] != "deterministic":
                s["status"] = "inconclusive"
                s["checks_failed"].append("the baseline itself is not bitwise reproducible on this machine")
            res["backends"][rname] = s
        print(f"[{time.monotonic() - t_start:5.1f}s] {rname}: "
              f"{(res['backends'].get(rname) or res.get(rname) or {}).get('status')}", flush=True)
        res["elapsed_s"] = time.monotonic() - t_start
        write_json(out_path, res)

    failed = [n for n, r in res["backends"].items() if r["status"] not in ("passed", "unavailable")]
    missing = [n for n in a.require if res["backends"].get(n, {}).get("status") in (None, "unavailable")]
    if res.get("baseline_repeat", {}).get("status") not in (None, "deterministic"):
        failed.append("baseline_repeat")
    rc = 1 if (rc or failed or missing) else 0
    res.update(complete=True, failed=failed, required_but_unavailable=missing, exit_code=rc,
               passed=rc == 0, elapsed_s=time.monotonic() - t_start)
    write_json(out_path, res)
    shutil.rmtree(a.workdir, ignore_errors=True)
    for n, r in res["backends"].items():
        if r["status"] not in ("passed",):
            why = r.get("reason") or r.get("error") or "; ".join(r.get("checks_failed", [])) or r.get("status")
            print(f"{n}: {r['status']}: {why}")
    print(f"wrote {out_path} ({res['label']}; torch {res['torch']}, cuda {res['cuda']}; kvikio "
          f"{res['kvikio'].get('version', '-')}, compat_mode {res['kvikio'].get('compat_mode', '-')}); exit {rc}")
    print(_table(res), flush=True)
    faulthandler.cancel_dump_traceback_later()
    if timed_out:  # a stuck worker thread would block interpreter exit (executor threads are joined at exit)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
