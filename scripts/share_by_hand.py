"""Notebook 04's break-it on a GPU, recorded: TRL's colocate defaults (1.5B, batch 8, gradient checkpointing) trained
for two steps at each engine share picked by hand and at the planner's own share, each in a child process
(`colo_kit.labs.pitfalls.share_by_hand`), with the GPU's NVML peak against the planner's prediction and the line that
says where a run stopped. On a CPU the lesson shows this record.

    source .gpu/env.sh && COLO_KIT_CACHE=/root/cache python scripts/share_by_hand.py --shares 0.3,0.9
    # -> results/share_by_hand_1xh100.json (named after the GPU), or --out PATH

A run in which no share trained at all writes to results/runs/ instead of replacing the committed record.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def shares(text: str) -> list[float]:
    """'0.3,0.9' -> [0.3, 0.9]; each a fraction of the GPU in (0, 1]."""
    from colo_kit_cli.commands import UsageError

    out = []
    for part in text.split(","):
        try:
            u = float(part)
        except ValueError:
            raise UsageError(f"--shares {text!r}: {part!r} is not a number; give fractions of the GPU, e.g. 0.3,0.9") from None
        if not 0 < u <= 1:
            raise UsageError(f"--shares {text!r}: {u} is not in (0, 1]; vLLM's gpu_memory_utilization is a fraction "
                             "of the whole GPU, e.g. 0.3,0.9")
        out.append(u)
    return out


def main(argv: list[str] | None = None) -> int:
    from colo_kit_cli.commands import ArgumentParser, writable_file
    from colo_kit.env import describe, visible_gpus
    from colo_kit.labs.pitfalls import TRL_DEFAULTS, share_by_hand
    from colo_kit.paths import results_dir
    from record.store import commit, publish

    ap = ArgumentParser(prog="scripts/share_by_hand.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="0.3,0.9", help="the shares picked by hand, comma-separated (default 0.3,0.9)")
    ap.add_argument("--out", help="default results/share_by_hand_1x<gpu>.json")
    a = ap.parse_args(argv)
    by_hand = shares(a.shares)
    gpus = visible_gpus()
    if not gpus:
        from colo_kit_cli.commands import UsageError

        raise UsageError("no GPU visible: the break-it trains on a GPU (on a CPU, notebook 04 shows the H100 record)")
    tag = next((w.lower() for w in gpus[0]["name"].split() if any(ch.isdigit() for ch in w)), "gpu")
    out_path = writable_file(a.out or results_dir() / f"share_by_hand_1x{tag}.json", "--out")
    t0 = time.time()
    rows, _ = share_by_hand(by_hand)  # each share by hand, then the planner's, each in a child process
    for row in rows:
        row["completed"] = row.get("two steps (measured)") == "ran"
        print(row, flush=True)
    record = {"what": " ".join(__doc__.split("\n\n")[0].split()), "env": describe(), "commit": commit(),
              "date": time.strftime("%Y-%m-%d"), "settings": TRL_DEFAULTS, "max_steps": 2, "rows": rows,
              "wall_s": round(time.time() - t0, 1)}
    where = publish(out_path, record, ok=any(r["completed"] for r in rows))
    print(f"wrote {where}")
    return 0


if __name__ == "__main__":
    from colo_kit_cli.commands import run

    raise SystemExit(run(main, sys.argv[1:], "scripts/share_by_hand.py"))
