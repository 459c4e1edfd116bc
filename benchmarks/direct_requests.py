"""PyTorch-Direct request-count model (issue 39; label: modelled, not measured): 128-B PCIe read requests per
gathered row under the thesis' naive and circular-shift mappings, flowlane's unshifted and aligned per-row kernels,
and the minimum, for row sizes 256 B - 16 KiB, the thesis' 2048-2076 B alignment sweep (Fig. 4.7) and column-masked
gathers (DGS feature sampling: N_f of 512 fp32 columns).

    .venv-llm/bin/python -m benchmarks.direct_requests --out results/direct/request_model.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flowlane.direct.requests import SCHEMES, mean_requests, request_counts  # noqa: E402
from flowlane.sim.output import write_json  # noqa: E402
from flowlane.testing.provenance import provenance  # noqa: E402

LABEL = "modelled: 128-B requests per warp instruction (flowlane.direct.requests), not measured"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/direct/request_model.json")
    p.add_argument(
        "--rows", type=int, default=2000, help="random rows per point (the digest's prototype drew 2,000)"
    )
    a = p.parse_args(argv)
    if a.rows < 1:
        raise SystemExit(f"--rows={a.rows} must be >= 1")
    scaled = {s: request_counts([0, 2, 4], 11, 4, s, warp=4, line_bytes=16).tolist() for s in SCHEMES}
    sizes = [
        {"row_bytes": b, "dtype": "float32", **mean_requests(b, 4, n_rows=a.rows)}
        for b in (256, 512, 1024, 2048, 2052, 4096, 8192, 16384)
    ]
    sizes += [
        {"row_bytes": b, "dtype": "bfloat16", **mean_requests(b, 2, n_rows=a.rows)} for b in (2048, 2050)
    ]
    sweep = [{"row_bytes": b, **mean_requests(b, 4, n_rows=a.rows)} for b in range(2048, 2080, 4)]
    rows = np.random.default_rng(0).integers(0, 1_000_000, a.rows)
    masked = []
    for n_f in (512, 256, 128, 64, 32):
        r = {
            "columns": n_f,
            "range_aligned": float(request_counts(rows, 512, 4, "row_aligned", cols=(0, n_f)).mean()),
            "range_misaligned_aligned_kernel": float(
                request_counts(rows, 512, 4, "row_aligned", cols=(1, n_f)).mean()
            )
            if n_f < 512
            else None,
            "random_list_min": float(
                request_counts(
                    rows,
                    512,
                    4,
                    "min",
                    cols=np.sort(np.random.default_rng(1).choice(512, n_f, replace=False)),
                ).mean()
            ),
        }
        masked.append(r)
    doc = {
        "label": LABEL,
        "thesis_scaled_example": {
            "rows": [0, 2, 4],
            "per_row": scaled,
            "thesis": {"flat": "node 2: 7", "flat_shift": "node 2: 5"},
        },
        "row_sizes": sizes,
        "alignment_sweep_fp32": sweep,
        "masked_2048B_rows": masked,
        "provenance": provenance(),
    }
    write_json(a.out, doc)
    print(LABEL)
    print(
        f"thesis example (nodes 0, 2, 4): naive {scaled['flat']} = {sum(scaled['flat'])}, "
        f"circular shift {scaled['flat_shift']} = {sum(scaled['flat_shift'])}"
    )
    print(f"{'row B':>6} {'dtype':>8} " + " ".join(f"{s:>11}" for s in SCHEMES))
    for r in sizes:
        print(f"{r['row_bytes']:>6} {r['dtype']:>8} " + " ".join(f"{r[s]:>11.2f}" for s in SCHEMES))
    for r in masked:
        print(
            f"masked {r['columns']:>3}/512 cols: aligned range {r['range_aligned']:.2f}, "
            f"random list (min) {r['random_list_min']:.2f} requests/row"
        )
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
