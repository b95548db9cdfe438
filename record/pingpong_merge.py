"""A server-vs-colocate sweep run in stages (scripts/gpu/pingpong.sh: the server, then colocate) merged into one
results file, the ping-pong model attached, and its charts written beside the runs:

    python -m record.pingpong_merge results/pingpong_gpu.json PART.json...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from colo_kit.paths import runs_dir
from colo_kit.serving.bench_results import attach_model, merge_results, write_plots


def main(out: str, parts: list[str]) -> dict:
    loaded = [json.loads(Path(p).read_text()) for p in parts if Path(p).exists()]
    merged = attach_model(merge_results(loaded))
    Path(out).write_text(json.dumps(merged, indent=1))
    print(f"[record] plots: {write_plots(merged, runs_dir() / (Path(out).stem + '.html'))}")
    print(json.dumps({k: merged.get(k) for k in ("summary", "colocate_variants", "model_validation")}, indent=1))
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m record.pingpong_merge OUT.json PART.json...")
    main(sys.argv[1], sys.argv[2:])
