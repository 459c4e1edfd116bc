"""``offload_bench.py`` at hidden 8192 with the caching allocator's expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), as its own check of ``run_all.sh``: beside the default
allocator's run it tells the allocator's cached split blocks from blocks awaiting a store's copy in the reserved peak
(results/gpu/README.md, fifth session). Any other argument is passed on.

    python3 tests/gpu/offload_bench_expandable.py --out $OUT/offload_bench_expandable.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload_bench  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--alloc-conf", "expandable_segments:True", "--only-hidden", "8192"]
    sys.exit(offload_bench.main())
