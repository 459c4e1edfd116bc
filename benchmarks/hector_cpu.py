"""Hector's RGCN / RGAT / HGT layers vs DGL's own modules on CPU (issue 40): time and peak memory, equal results.

For each synthetic skewed typed graph (flowlane.hector.typed_graph: hub sources, Zipf relations; 1e5-1e6 edges,
10 edges per node, 16 relations, 4 node types; thesis settings: in = out = 64, one head, one layer) and each model:

* DGL's module, given its best path: edges (and nodes) sorted by type and ``presorted=True`` (``segment_mm``), and
  Hector's layer holding the same weights (``load_state_dict`` / ``HectorRGAT.from_dgl``). RGCN: ``RelGraphConv``;
  HGT: ``HGTConv``; RGAT: ``HeteroGraphConv({r: GATConv})`` on the relation heterograph.
* one training step = forward + backward of ``out.square().mean()``; both implementations alternate rep by rep in one
  process (the machine is shared and its load drifts), and ``speedup`` is the median over reps of the paired ratio
  DGL step / Hector step of the same rep (see :func:`summarise`: the ratio of the two separate medians, kept as
  ``speedup_of_medians``, pairs a DGL rep with a Hector rep from another moment and so mixes load changes in).
* results: outputs and gradients (input and every parameter) compared, max abs / relative error recorded.
* Hector's one-off preprocessing (sorting, unique (node, relation) rows, sparse structure; cached per graph) is timed
  separately, on the first step.
* peak memory: see ``MEMORY_METHOD`` (a fresh process per case, one warm step, freed heap returned to the OS, then
  the rise of the peak RSS over one step). ``--refill-memory FILE`` re-measures it for the rows of a result file.

Label: measured on CPU (this machine, ``torch.get_num_threads()`` recorded). Writes ``results/hector/cpu.json`` and
``cpu.png``. ``--summarise FILE`` recomputes the summary fields of a result file from its stored per-rep times
(nothing is re-measured; the file records that it was recomputed). Usage: ``.venv-gnn/bin/python benchmarks/hector_cpu.py [--edges 100000 1000000] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("rgcn", "rgat", "hgt")
DIM, HEADS, NUM_RELS, NUM_NTYPES, DEGREE = 64, 1, 16, 4, 10


def build(model: str, edges: int, seed: int = 0, hub_alpha: float = 2.5):
    """Graph, inputs and the (DGL, Hector) pair with equal weights: returns (run_dgl, run_hector, hector_layer, x)."""
    import dgl
    import torch

    from dgl_plugin.hector import (
        HectorHGTConv,
        HectorRelGraphConv,
        HectorRGAT,
        hetero_rgat_reference,
        to_relation_graph,
    )
    from flowlane.hector import typed_graph

    torch.manual_seed(seed)
    n = max(edges // DEGREE, 16)
    gd = typed_graph(
        num_nodes=n,
        num_edges=edges,
        num_etypes=NUM_RELS,
        num_ntypes=NUM_NTYPES,
        hub_alpha=hub_alpha,
        seed=seed,
    )
    order = torch.sort(gd["etype"], stable=True).indices  # DGL's best path: edges presorted by type
    src, dst, et = gd["src"][order], gd["dst"][order], gd["etype"][order]
    g = dgl.graph((src, dst), num_nodes=n)
    x = torch.randn(n, DIM, requires_grad=True)
    if model == "rgcn":
        ref = dgl.nn.RelGraphConv(DIM, DIM, NUM_RELS, self_loop=True)
        hec = HectorRelGraphConv(DIM, DIM, NUM_RELS, self_loop=True)
        hec.load_state_dict(ref.state_dict())
        return (lambda: ref(g, x, et, presorted=True)), (lambda: hec(g, x, et)), hec, ref, x
    if model == "hgt":
        nt = gd["ntype"]
        ref = dgl.nn.HGTConv(DIM, DIM // HEADS, HEADS, NUM_NTYPES, NUM_RELS, dropout=0.0)
        hec = HectorHGTConv(DIM, DIM // HEADS, HEADS, NUM_NTYPES, NUM_RELS, dropout=0.0)
        hec.load_state_dict(ref.state_dict())
        return (
            (lambda: ref(g, x, nt, et, presorted=True)),
            (lambda: hec(g, x, nt, et, presorted=True)),
            hec,
            ref,
            x,
        )
    if model == "rgat":
        ref, names = hetero_rgat_reference(DIM, DIM // HEADS, HEADS, NUM_RELS)
        hg = to_relation_graph(src, dst, et, n, NUM_RELS)
        hec = HectorRGAT.from_dgl(ref, names)
        return (lambda: ref(hg, {"n": x})["n"]), (lambda: hec(g, x, et)), hec, ref, x
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def _step(run, params):
    import torch

    out = run()
    grads = torch.autograd.grad(out.square().mean(), params)
    return out.detach(), [gr.detach() for gr in grads]


def _ref_params(model, ref, x):
    # HectorRGAT stacks the per-relation GATConv weights: compare the input gradient + output
    if model == "rgat":
        return [x]
    return [x, *ref.parameters()]


def _hec_params(model, hec, x):
    return [x] if model == "rgat" else [x, *hec.parameters()]


def time_case(model: str, edges: int, reps: int, hub_alpha: float) -> dict:
    import torch

    run_d, run_h, hec, ref, x = build(model, edges, hub_alpha=hub_alpha)
    pd, ph = _ref_params(model, ref, x), _hec_params(model, hec, x)
    t0 = time.perf_counter()
    out_h, g_h = _step(run_h, ph)  # first call: preprocessing + one step
    first_h = time.perf_counter() - t0
    t0 = time.perf_counter()
    out_d, g_d = _step(run_d, pd)
    first_d = time.perf_counter() - t0
    err = (out_h - out_d).abs().max().item()
    scale = out_d.abs().max().item()
    gerr = max(
        (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(g_h, g_d, strict=True)
    )
    td, th = [], []
    for _ in range(reps):
        for run, ps, acc in ((run_d, pd, td), (run_h, ph, th)):
            t = time.perf_counter()
            _step(run, ps)
            acc.append(time.perf_counter() - t)
    lay = hec._layouts._layout
    rows = lay.src_rows
    res = {
        "model": model,
        "edges": edges,
        "nodes": lay.num_src,
        "relations": NUM_RELS,
        "dim": DIM,
        "heads": HEADS,
        "hub_alpha": hub_alpha,
        "compaction_ratio_src": round(rows.ratio, 4),
        "compaction_ratio_dst": round(lay.dst_rows.ratio, 4),
        "materialization": "compact" if rows.compact else "vanilla",
        "dgl_steps_s": td,
        "hector_steps_s": th,
        "hector_first_step_s": first_h,
        "dgl_first_step_s": first_d,
        "max_abs_err_out": err,
        "max_rel_err_out": err / max(scale, 1e-30),
        "max_rel_err_grads": gerr,
        "grads_compared": "input + every parameter" if model != "rgat" else "input (weights are restacked)",
    }
    summarise(res)
    if model == "rgat":
        res["reorder_plan"] = {k: {"fold": p.fold, "reason": p.reason} for k, p in hec.last_plan.items()}
    del torch
    return res


STEP = "forward + backward of out.square().mean(); DGL and Hector alternated rep by rep; medians of reps"
SPEEDUP_METHOD = (
    "speedup = median over reps of dgl_steps_s[i] / hector_steps_s[i] (the two steps of rep i ran back to back); "
    "speedup_of_medians = median(dgl) / median(hector); speedup_min_vs_min = min(dgl) / min(hector)"
)


def summarise(r: dict) -> dict:
    """Fill a row's summary fields from its per-rep times ``dgl_steps_s`` / ``hector_steps_s`` (see SPEEDUP_METHOD)."""
    td, th = r["dgl_steps_s"], r["hector_steps_s"]
    if not td or len(td) != len(th):
        raise ValueError(f"{r['model']} {r['edges']}: per-rep times of unequal length {len(td)} / {len(th)}")
    med_d, med_h = statistics.median(td), statistics.median(th)
    r["dgl_step_s"], r["hector_step_s"] = med_d, med_h
    r["speedup"] = statistics.median(d / h for d, h in zip(td, th, strict=True))
    r["speedup_paired_ratios"] = [d / h for d, h in zip(td, th, strict=True)]
    r["speedup_of_medians"] = med_d / med_h
    r["speedup_min_vs_min"] = min(td) / min(th)
    r["hector_preprocess_s_est"] = max(r["hector_first_step_s"] - med_h, 0.0)
    return r


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


MEMORY_METHOD = (
    "a fresh process per (graph, model, implementation): one warm step (Hector's graph layout is "
    "cached per graph), gc + malloc_trim(0) so freed heap goes back to the OS, peak RSS reset "
    "(/proc/self/clear_refs 5), one step; figure = VmHWM - VmRSS before that step"
)


def memory_case(model: str, edges: int, impl: str, hub_alpha: float) -> dict:
    import ctypes
    import gc

    run_d, run_h, hec, ref, x = build(model, edges, hub_alpha=hub_alpha)
    run, ps = (run_d, _ref_params(model, ref, x)) if impl == "dgl" else (run_h, _hec_params(model, hec, x))
    _step(run, ps)  # warm, both implementations alike
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kib("VmRSS")
    _step(run, ps)
    return {"peak_rise_mib": (_rss_kib("VmHWM") - base) / 1024}


def measure_memory(r: dict) -> None:
    """Fill ``dgl_peak_mib`` / ``hector_peak_mib`` of one result row (subprocesses, see MEMORY_METHOD)."""
    for impl in ("dgl", "hector"):
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--memory-case",
                r["model"],
                str(r["edges"]),
                impl,
                "--hub-alpha",
                str(r["hub_alpha"]),
            ],
            capture_output=True,
            text=True,
            timeout=3600,
            cwd=ROOT,
        )
        if p.returncode != 0:
            raise RuntimeError(f"memory case {r['model']} {r['edges']} {impl} failed: {p.stderr[-2000:]}")
        r[f"{impl}_peak_mib"] = json.loads(p.stdout.strip().splitlines()[-1])["peak_rise_mib"]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['model']}\n{r['edges']:,}\nratio {r['compaction_ratio_src']:.2f}" for r in rows]
    xs = range(len(rows))
    w = 0.38
    axes[0].bar([i - w / 2 for i in xs], [r["dgl_step_s"] * 1e3 for r in rows], w, label="DGL module")
    axes[0].bar([i + w / 2 for i in xs], [r["hector_step_s"] * 1e3 for r in rows], w, label="Hector layer")
    for i, r in enumerate(rows):
        axes[0].text(
            i,
            max(r["dgl_step_s"], r["hector_step_s"]) * 1e3,
            f"{r['speedup']:.2f}x",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("forward + backward (ms, median)")
    axes[1].bar([i - w / 2 for i in xs], [r.get("dgl_peak_mib", 0) for r in rows], w, label="DGL module")
    axes[1].bar([i + w / 2 for i in xs], [r.get("hector_peak_mib", 0) for r in rows], w, label="Hector layer")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("peak RSS rise in one step (MiB)")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.suptitle(
        "Hector vs DGL modules, CPU (measured), dim 64, 1 head, 16 relations\n"
        "bar labels: speedup = median over reps of the paired DGL / Hector step ratio"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edges", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--hub-alpha",
        type=float,
        nargs="+",
        default=[2.5],
        help="source-weight Pareto tails to run (2.5: ~49 %% compaction; 2.0: ~25 %%, like FB15k's 26 %%)",
    )
    ap.add_argument("--no-memory", action="store_true", help="skip the per-case peak-memory subprocesses")
    ap.add_argument("--out", default=str(ROOT / "results" / "hector" / "cpu.json"))
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a result file")
    ap.add_argument(
        "--summarise",
        metavar="JSON",
        help="recompute a result file's summary fields (speedup, medians) from its stored per-rep times, and replot",
    )
    ap.add_argument(
        "--refill-memory", metavar="JSON", help="re-measure the peak memory of every row of a result file"
    )
    ap.add_argument("--memory-case", nargs=3, metavar=("MODEL", "EDGES", "IMPL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.replot:
        plot(json.loads(Path(a.replot).read_text())["rows"], Path(a.replot).with_suffix(".png"))
        return
    if a.summarise:
        path = Path(a.summarise)
        doc = json.loads(path.read_text())
        for r in doc["rows"]:
            old = r["speedup"]
            summarise(r)
            print(
                f"{r['model']:5s} {r['edges']:>9,} alpha {r['hub_alpha']}: speedup {old:.2f}x -> {r['speedup']:.2f}x"
            )
        doc["step"] = STEP
        doc["speedup_method"] = SPEEDUP_METHOD
        doc["summary_recomputed"] = (
            "summary fields recomputed by `benchmarks/hector_cpu.py --summarise` from the per-rep times stored "
            "in this file (dgl_steps_s, hector_steps_s); nothing re-measured"
        )
        path.write_text(json.dumps(doc, indent=1))
        plot(doc["rows"], path.with_suffix(".png"))
        return
    if a.memory_case:
        m, e, impl = a.memory_case
        print(json.dumps(memory_case(m, int(e), impl, a.hub_alpha[0])))
        return
    import dgl
    import torch

    from flowlane.testing.provenance import provenance

    if a.refill_memory:
        path = Path(a.refill_memory)
        doc = json.loads(path.read_text())
        for r in doc["rows"]:
            measure_memory(r)
            print(
                f"{r['model']:5s} {r['edges']:>9,} alpha {r['hub_alpha']}: peak MiB {r['dgl_peak_mib']:.0f} -> "
                f"{r['hector_peak_mib']:.0f}",
                flush=True,
            )
        doc["memory_method"], doc["memory_provenance"] = MEMORY_METHOD, provenance()
        path.write_text(json.dumps(doc, indent=1))
        plot(doc["rows"], path.with_suffix(".png"))
        return

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    doc = {
        "label": "measured on CPU",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dgl": dgl.__version__,
        "goal": ">= 1.5x faster than DGL's modules at equal results, no per-edge weight copies (issue 40)",
        "step": STEP,
        "speedup_method": SPEEDUP_METHOD,
        "complete": False,
        "rows": rows,
        "memory_method": MEMORY_METHOD,
        "provenance": provenance(),
    }
    for e, alpha, m in ((e, alpha, m) for e in a.edges for alpha in a.hub_alpha for m in a.models):
        r = time_case(m, e, a.reps, alpha)
        if not a.no_memory:
            measure_memory(r)
        rows.append(r)
        print(
            f"{m:5s} {e:>9,} edges  alpha {alpha}  ratio {r['compaction_ratio_src']:.2f}  DGL {r['dgl_step_s'] * 1e3:8.1f} ms"
            f"  Hector {r['hector_step_s'] * 1e3:8.1f} ms  {r['speedup']:.2f}x  peak MiB "
            f"{r.get('dgl_peak_mib', float('nan')):.0f} -> {r.get('hector_peak_mib', float('nan')):.0f}  "
            f"rel err out {r['max_rel_err_out']:.1e} grads {r['max_rel_err_grads']:.1e}",
            flush=True,
        )
        out.write_text(json.dumps(doc, indent=1))  # after every case: a long run keeps what it measured
    doc["complete"] = True
    out.write_text(json.dumps(doc, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
