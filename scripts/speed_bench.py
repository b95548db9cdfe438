"""One configuration of `record.speed`'s chain in this process, or the merge of several into one JSON.

    python scripts/speed_bench.py run --config spg8 --model qwen2.5-1.5b --seeds 0,1 --budget-s 45 --out part.json
    python scripts/speed_bench.py merge parts/*.json --out results/speed_1xh100.json [--into results/speed_1xh100.json]

The `recipe` configuration is what `colo-kit plan --recommend` writes for the GPU the seed runs on (`record.speed.run_seed`
reads its memory with NVML); each record names that GPU, so keep one result file per GPU (`scripts/gpu/speed.sh` names it).

`scripts/gpu/speed.sh` runs one process per configuration and seed. Seeds given together here share the process
and its vLLM engine (`colo_kit.colocate.engine_reuse.reuse_engines`: each new trainer pushes its own weights into it
before its first generation), and the second trainer's peak then carries what the first left behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(args) -> int:
    import colo_kit

    colo_kit.setup()
    from colo_kit.colocate.engine_reuse import release_engines, reuse_engines
    from colo_kit.env import describe
    from record.store import commit
    from record.speed import STOP_PAST_FRACTION, run_seed

    reuse_engines()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = {"config": args.config, "model": args.model, "env": describe(), "commit": commit(), "records": []}
    try:
        for seed in args.seeds:
            t = time.time()
            rec = run_seed(args.config, model=args.model, seed=seed, budget_s=args.budget_s, learning_rate=args.learning_rate,
                           max_completion_length=args.max_completion_length,
                           stop_past=STOP_PAST_FRACTION if args.stop_past_threshold else None)
            part["records"].append(rec)
            s = rec["steady"]
            print(f"[speed] {args.config} seed {seed}: {rec['steps_done']} steps, "
                  f"{s['completion_tokens_per_s']} tok/s, {s['s_per_step']} s/step, "
                  f"NVML peak {rec['nvml_peak_gib']} GiB (planner {rec['planner_peak_gib']}), "
                  f"startup {rec['startup_s']} s, {time.time() - t:.0f} s in all", flush=True)
            out.write_text(json.dumps(part, indent=1, default=str))  # a later seed cut by the timeout keeps this one
    finally:
        release_engines()
    return 0


def _key(record: dict) -> tuple:
    return (record["config"], record["model"], record["seed"], record["grpo_config"].get("learning_rate"),
            record.get("budget_s"), record.get("commit"))


def merge(args) -> int:
    from record.race import summarize

    records, parts, old = [], [], {}
    if args.into and Path(args.into).exists():
        old = json.loads(Path(args.into).read_text())
        records, parts = old.get("records", []), old.get("parts", [])
    for path in args.parts:
        part = json.loads(Path(path).read_text())
        # each record knows the commit it ran at: the summary compares only records of one race (record.race.race)
        part["records"] = [{**r, "commit": r.get("commit") or part.get("commit")} for r in part["records"]]
        # a configuration run again at the same commit, budget and learning rate replaces its earlier records
        keys = {_key(r) for r in part["records"]}
        records = [r for r in records if _key(r) not in keys] + part["records"]
        lrs = sorted({r["grpo_config"].get("learning_rate") for r in part["records"]})
        parts.append({**{k: part.get(k) for k in ("config", "model", "commit", "env")}, "learning_rates": lrs,
                      "seeds": [r["seed"] for r in part["records"]]})
    by_model = {}
    for r in records:
        by_model.setdefault(r["model"], []).append(r)
    result = {"note": args.note or (old.get("note") if args.into and Path(args.into).exists() else None),
              "benchmark": "record.speed: TRL's colocate defaults against the kit's chain, one knob at a time",
              "method": __import__("record.speed", fromlist=["x"]).__doc__,
              "summary": {m: summarize(rs) for m, rs in by_model.items()}, "parts": parts, "records": records}
    from record.store import write_text_atomic

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(result, indent=1, default=str))  # a cut write never replaces the record
    print(json.dumps(result["summary"], indent=1, default=str)[:6000])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", required=True)
    r.add_argument("--model", default="tiny")
    r.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0])
    r.add_argument("--budget-s", type=float, default=45.0)
    r.add_argument("--learning-rate", type=float, default=None, help="instead of the task's (record.speed.TASK)")
    r.add_argument("--max-completion-length", type=int, default=None, help="instead of the task's")
    r.add_argument("--stop-past-threshold", action="store_true",
                   help="also stop a seed once its running mean reward is past the race's threshold "
                        "(record.speed.STOP_PAST_FRACTION of its first generation's)")
    r.add_argument("--out", required=True)
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="*", help="part JSONs; none with --into: summarize that file's records again")
    m.add_argument("--out", required=True)
    m.add_argument("--into", default=None, help="an earlier merged JSON whose records are kept")
    m.add_argument("--note", default=None, help="how the parts were made (kept by later merges --into this file)")
    args = ap.parse_args(argv)
    if args.cmd == "merge" and not args.parts and not args.into:
        ap.error("merge: give part JSONs, or --into FILE to summarize its records again")
    return run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    sys.exit(main())
