"""Hector's typed linear and compact materialization on one GPU (issue 40), torch only (no DGL).

Edgewise typed linear ``Y[e] = X[src[e]] @ W[etype[e]]`` in bf16 on skewed synthetic typed graphs
(flowlane.hector.typed_graph), the shapes of research/gpu-anchors.md (2M edges x 8 / 64 types x dim 64; 1M x 16 x 256):

* ``replicated``: ``bmm(X[src], W[etype])`` (per-edge weight copies: PyG FastRGCNConv; skipped with the bytes it
  would need when that exceeds 85 % of free GPU memory);
* ``loop``: flowlane.hector.segment_mm(gemm="loop") over type-sorted edges (one matmul per type);
* ``grouped_mm``: the raw ``torch._grouped_mm`` call on the same sorted rows (the goal's reference);
* ``flowlane_auto``: segment_mm(gemm="auto"), what the layers use (expected to pick grouped_mm);
* ``compact``: flowlane.hector.materialize over unique (source, type) rows, then the gather to edges
  (``compact_rows`` only = the GEMM alone).

Times are CUDA-event medians of ``--reps`` (forward; and forward + backward for loop / grouped_mm / compact), peak
memory is ``torch.cuda.max_memory_allocated`` above the inputs. Checks (exit 1 on failure): every variant's output
equals the loop's (bf16: max |diff| <= 2e-2 x max |y|; bitwise equality is recorded), gradients of grouped_mm and
compact are as close to an fp32 reference as the bf16 loop's (within 2e-2, or 1.5x the loop's own error), compact
rows == #unique (src, type) pairs. Without CUDA it runs tiny sizes on the CPU (float32, same checks) so the logic can
be tried anywhere.

Two more checks in bf16 on either device (``bf16_checks`` in the JSON):

* ``gather_rows_hub``: 4,096 gradients of 1.0 into one row must sum to exactly 4,096 (a running bf16 sum stops at
  256); torch's own ``index_select`` backward on the same case is recorded beside it (CUDA's bf16 ``index_add``).
* ``layers``: the layers' bf16 paths against the same ops in fp32 (output, dx, dW; rel. max error <= 5e-2): the RGCN
  path (``materialize`` over compact rows + ``EdgeAggregator`` with a per-edge norm: the gather + ``index_add``
  fallback) and the attention path (``gather_dot`` scores, ``edge_softmax``, multi-head aggregation). The old path,
  ``index_select`` + a bf16 ``index_add``, is recorded beside it (measured 0.16-0.22 dx error on an H200).

Run: ``python3 tests/gpu/hector_ops.py --out $OUT/hector_ops.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from flowlane.hector import (  # noqa: E402
    EdgeAggregator,
    compact_rows,
    edge_softmax,
    gather_dot,
    gather_rows,
    materialize,
    segment_mm,
    type_order,
    typed_graph,
)
from flowlane.testing.provenance import provenance  # noqa: E402

GPU_CASES = [(2_000_000, 8, 64), (2_000_000, 64, 64), (1_000_000, 16, 256)]
CPU_CASES = [(20_000, 8, 32), (20_000, 16, 64)]


def _timer(dev: torch.device, reps: int):
    def run(fn) -> float:
        fn()  # warm-up
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    return run


def _peak(dev: torch.device, fn) -> float | None:
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _err(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (y.float() - ref.float()).abs().max().item()
    s = ref.float().abs().max().item()
    return {"max_abs_diff": d, "rel": d / max(s, 1e-30), "bitwise_equal": bool(torch.equal(y, ref))}


def run_case(
    edges: int, types: int, dim: int, dev: torch.device, dtype: torch.dtype, reps: int, tol: float
) -> dict:
    g = typed_graph(num_nodes=max(edges // 10, 16), num_edges=edges, num_etypes=types, seed=0)
    n = max(edges // 10, 16)
    src, et = g["src"].to(dev), g["etype"].to(dev)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(n, dim, generator=gen) / dim**0.5).to(dev, dtype)
    w = (torch.randn(types, dim, dim, generator=gen) / dim**0.5).to(dev, dtype)
    order, ptr = type_order(et, types)
    src_sorted = src[order]
    rows = compact_rows(src, et, n, types)
    offs = ptr[1:].to(dev, torch.int32)
    t = _timer(dev, reps)
    res: dict = {
        "edges": edges,
        "types": types,
        "dim": dim,
        "dtype": str(dtype),
        "nodes": n,
        "compact_rows": rows.num_rows,
        "compaction_ratio": rows.ratio,
        "unique_pairs_checked": rows.num_rows == int(torch.unique(et * n + src).numel()),
        "times_s": {},
        "fwd_bwd_s": {},
        "peak_gib": {},
        "errors": {},
        "failed": [],
    }
    if not res["unique_pairs_checked"]:
        res["failed"].append("compact row count != #unique (src, type) pairs")

    def loop():
        return segment_mm(x.index_select(0, src_sorted), w, ptr, gemm="loop")

    ref = loop()
    variants = {
        "loop": loop,
        "grouped_mm": lambda: torch._grouped_mm(x.index_select(0, src_sorted), w, offs=offs),
        "flowlane_auto": lambda: segment_mm(x.index_select(0, src_sorted), w, ptr, gemm="auto"),
        "compact_rows": lambda: materialize(x, w, rows, gemm="auto"),
        "compact": lambda: gather_rows(materialize(x, w, rows, gemm="auto"), rows.edge_row),
    }
    need = edges * dim * dim * x.element_size()
    free = torch.cuda.mem_get_info()[0] if dev.type == "cuda" else None
    if free is not None and need > 0.85 * free:
        res["errors"]["replicated"] = (
            f"skipped: W[etype] needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        )
    else:
        variants["replicated"] = lambda: torch.bmm(
            x.index_select(0, src).unsqueeze(1), w.index_select(0, et)
        ).squeeze(1)
    res["path_auto_picks"] = (
        "grouped_mm"
        if dev.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and dim % 8 == 0
        else "loop"
    )
    for name, fn in variants.items():
        if name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            res["errors"][name] = "torch has no _grouped_mm"
            continue
        try:
            y = fn()
            if name == "compact_rows":  # rows -> edges -> type-sorted edge order (the loop's order)
                y_e = y.index_select(0, rows.edge_row)[order]
            else:
                y_e = y[order] if name in ("compact", "replicated") else y  # edge order -> sorted order
            e = _err(y_e, ref)
            res.setdefault("equality_vs_loop", {})[name] = e
            if e["rel"] > tol:
                res["failed"].append(f"{name}: output differs from the loop's (rel {e['rel']:.2e} > {tol})")
            del y, y_e
            res["times_s"][name] = t(fn)
            res["peak_gib"][name] = _peak(dev, fn)
        except Exception as exc:  # noqa: BLE001 - recorded; a failing flowlane path is a failure, a baseline is not
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[:400]
            if name in ("loop", "flowlane_auto", "compact", "compact_rows"):
                res["failed"].append(f"{name} raised {type(exc).__name__}: {exc}"[:400])
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # forward + backward, gradients checked against the loop's
    gy = torch.randn(edges, dim, generator=gen).to(dev, dtype)  # upstream gradient, type-sorted edge order
    gy_edges = gy.index_select(0, torch.argsort(order))  # the same gradient in edge order

    def fb(kind: str):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        if kind == "compact":
            gather_rows(materialize(xx, ww, rows, gemm="auto"), rows.edge_row).backward(gy_edges)
        else:
            segment_mm(xx.index_select(0, src_sorted), ww, ptr, gemm=kind).backward(gy)
        return xx.grad, ww.grad

    kinds = ["loop", "compact"] + (["grouped_mm"] if res["path_auto_picks"] == "grouped_mm" else [])
    # Gradients are checked against an fp32 reference (the loop on upcast inputs), not against the bf16 loop: dx
    # sums the rows of every edge of a source (hub sources: thousands), and bf16 sums in different orders differ by
    # far more than one rounding. A flowlane path passes when it is within tol of the reference or no further from
    # it than 1.5x the bf16 loop (the baseline's own error).
    xx32, ww32 = x.detach().float().clone().requires_grad_(), w.detach().float().clone().requires_grad_()
    segment_mm(xx32.index_select(0, src_sorted), ww32, ptr, gemm="loop").backward(gy.float())
    grads_ref = (xx32.grad, ww32.grad)
    loop_err: dict[str, float] = {}
    for kind in kinds:
        try:
            gx, gw = fb(kind)
            for gname, a_, b_ in (("dx", gx, grads_ref[0]), ("dW", gw, grads_ref[1])):
                e = _err(a_, b_)
                res.setdefault("grad_error_vs_fp32", {})[f"{kind}.{gname}"] = e
                if kind == "loop":
                    loop_err[gname] = e["rel"]
                bound = max(tol, 1.5 * loop_err.get(gname, 0.0))
                if e["rel"] > bound:
                    res["failed"].append(
                        f"{kind}: {gname} is {e['rel']:.2e} from the fp32 reference (> {bound:.2e})"
                    )
            res["fwd_bwd_s"][kind] = t(lambda k=kind: fb(k))
        except Exception as exc:  # noqa: BLE001 - recorded as a failure of that flowlane path
            res["errors"][f"fwd_bwd.{kind}"] = f"{type(exc).__name__}: {exc}"[:400]
            res["failed"].append(f"fwd_bwd {kind} raised {type(exc).__name__}: {exc}"[:400])
    ts = res["times_s"]
    if "grouped_mm" in ts and "flowlane_auto" in ts:
        res["auto_over_grouped_mm"] = ts["flowlane_auto"] / ts["grouped_mm"]
    if "compact" in ts and "flowlane_auto" in ts:
        res["compact_time_saving"] = 1 - ts["compact"] / ts["flowlane_auto"]
        res["compact_rows_saving"] = 1 - rows.ratio
    return res


LAYER_TOL = 5e-2
LAYER_CASE_GPU, LAYER_CASE_CPU = (2_000_000, 8, 64, 4), (20_000, 8, 32, 2)  # edges, types, dim, heads


def gather_rows_hub(dev: torch.device) -> dict:
    """4,096 gradients of 1.0 into one bf16 row: gather_rows must give 4,096 (fp32 sums, one rounding)."""
    index = torch.zeros(4096, dtype=torch.int64, device=dev)
    ones = torch.ones(4096, 8, dtype=torch.bfloat16, device=dev)
    y = torch.zeros(1, 8, dtype=torch.bfloat16, device=dev, requires_grad=True)
    gather_rows(y, index).backward(ones)
    y2 = y.detach().clone().requires_grad_()
    y2.index_select(0, index).backward(ones)
    got, torch_own = y.grad.float().max().item(), y2.grad.float().max().item()
    return {"want": 4096.0, "gather_rows": got, "torch_index_select_backward": torch_own, "ok": got == 4096.0}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)


def layer_paths(dev: torch.device, edges: int, types: int, dim: int, heads: int) -> dict:
    """The layers' bf16 paths (flowlane ops as dgl_plugin.hector composes them) against the same ops in fp32."""
    n = max(edges // 10, 16)
    g = typed_graph(num_nodes=n, num_edges=edges, num_etypes=types, seed=1)
    src, dst, et = (g[k].to(dev) for k in ("src", "dst", "etype"))
    rows = compact_rows(src, et, n, types)
    agg = EdgeAggregator(dst, rows.edge_row, n, rows.num_rows)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x0 = (torch.randn(n, dim, generator=gen) / dim**0.5).to(dev)
    w0 = (torch.randn(types, dim, dim, generator=gen) / dim**0.5).to(dev)
    norm = torch.rand(edges, generator=gen).to(dev)
    gy = torch.randn(n, dim, generator=gen).to(dev)
    d = dim // heads

    def rgcn(x, w, old=False):
        m = materialize(x, w, rows, gemm="loop" if x.dtype == torch.float32 else "auto")
        if (
            old
        ):  # the path before gather_rows: a bf16 index_add sums every edge of a row (and of a destination)
            e = m.index_select(0, rows.edge_row) * norm.to(m.dtype).unsqueeze(-1)
            return m.new_zeros(n, dim).index_add_(0, dst, e)
        return agg(m, norm)

    def attention(x, w, old=False):
        m = materialize(x, w, rows, gemm="loop" if x.dtype == torch.float32 else "auto").view(-1, heads, d)
        q = x.view(n, heads, d)
        s = gather_dot(m, rows.edge_row, q, dst)  # (E, heads)
        a = edge_softmax(s, dst, n)
        if old:
            e = m.index_select(0, rows.edge_row) * a.unsqueeze(-1)
            return m.new_zeros(n, heads, d).index_add_(0, dst, e).view(n, dim)
        return agg(m, a).view(n, dim)

    res: dict = {"edges": edges, "types": types, "dim": dim, "heads": heads, "compaction_ratio": rows.ratio}
    failed: list[str] = []
    for name, fn in (("rgcn", rgcn), ("attention", attention)):
        x32, w32 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = fn(x32, w32)
        ref.backward(gy)
        for variant, old in (("flowlane", False), ("old_index_add", True)):
            xb, wb = x0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
            try:
                out = fn(xb, wb, old)
                out.backward(gy.bfloat16())
                e = {"out": _rel(out, ref), "dx": _rel(xb.grad, x32.grad), "dW": _rel(wb.grad, w32.grad)}
            except Exception as exc:  # noqa: BLE001 - recorded; flowlane's own path raising is a failure
                e = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            res[f"{name}.{variant}"] = e
            if variant == "flowlane":
                bad = {k: v for k, v in e.items() if k == "error" or v > LAYER_TOL}
                if bad:
                    failed.append(f"{name} bf16 vs fp32: {bad} (tol {LAYER_TOL})")
    res["failed"] = failed
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    doc = {
        "label": "measured on one GPU" if cuda else "CPU dry run (tiny sizes; not a GPU figure)",
        "torch": torch.__version__,
        "has_grouped_mm": hasattr(torch, "_grouped_mm"),
        "cases": [],
        "provenance": provenance(device=torch.cuda.get_device_name(0) if cuda else "cpu"),
    }
    t0 = time.perf_counter()
    for edges, types, dim in GPU_CASES if cuda else CPU_CASES:
        r = run_case(edges, types, dim, dev, dtype, a.reps if cuda else 2, tol)
        doc["cases"].append(r)
        ts = r["times_s"]
        print(
            f"E={edges:,} T={types} d={dim}: ratio {r['compaction_ratio']:.2f} | "
            + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in ts.items())
            + (f" | FAILED {r['failed']}" if r["failed"] else ""),
            flush=True,
        )
    hub = gather_rows_hub(dev)
    layers = layer_paths(dev, *(LAYER_CASE_GPU if cuda else LAYER_CASE_CPU))
    doc["bf16_checks"] = {"gather_rows_hub": hub, "layers": layers}
    print(f"bf16 gather_rows hub: {hub}", flush=True)
    print(
        "bf16 layer paths vs fp32 (rel. max error): "
        + "  ".join(f"{k} {v}" for k, v in layers.items() if "." in k)
        + (f" | FAILED {layers['failed']}" if layers["failed"] else ""),
        flush=True,
    )
    doc["wall_s"] = time.perf_counter() - t0
    doc["ok"] = not any(c["failed"] for c in doc["cases"]) and hub["ok"] and not layers["failed"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"{'OK' if doc['ok'] else 'FAILED'}: wrote {out} in {doc['wall_s']:.1f} s")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
