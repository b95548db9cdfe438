"""The freshness report: for every number a learner reads, the machine and commit that measured it, and how many
commits have changed the code it measures since (`make numbers-status`; `python -m record.status [--json|--markdown]`).

A committed record grows older than the kit each time the code it measures changes; whether that matters is a
judgment, so this is a report, never a test gate. It reads only `results/*.json` and git (no GPU, vLLM or network):

- per results file: the machine (the record's `env`, else its items' `machine`, else a name like `*_1xh200.json`),
  the commit that measured it (the newest its items name, else the last commit that wrote the file) and its date,
  the commits since that changed the code it measures (`MEASURES`), and the notebooks and README that read it;
- per notebook, in `results/cpu_check.json` and `results/gpu_check.json`: its Run All's status, machine, commit,
  date, and whether it ran the notebook's current source (`record.refresh.source_digest`);
- what is owed: records a notebook or README names that are not committed, Run Alls at the current source, and goals
  a record does not meet (the planner's largest error over 10%, a `*goal_met: false`).

A commit this clone lacks (shallow clone, another machine's) reads "commit not in this clone"; a results file that is
not valid JSON gets one line and the report goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from textwrap import fill

from colo_kit.paths import REPO_ROOT
from colo_kit.results import CHECKS, LESSONS, machine_label
from record import race
from record.refresh import source_digest

_CHECK = "colo_kit colo_kit_cli/notebooks.py notebooks/src scripts/check.py scripts/check_plugin.py"
# results file: the code whose changes make its numbers older than the kit (a line ending in \ goes on)
_TABLE = f"""
speed_1xh200.json: colo_kit/grpo colo_kit/colocate colo_kit/memory record/speed.py record/race.py scripts/speed_bench.py \
scripts/gpu/speed.sh
speed_1xh100.json: colo_kit/grpo colo_kit/colocate colo_kit/memory record/speed.py record/race.py scripts/speed_bench.py \
scripts/gpu/speed.sh
gen_latency_1xh200.json: colo_kit/colocate scripts/gpu/gen_latency.py
gen_in_trainer_1xh200.json: colo_kit/grpo colo_kit/colocate scripts/gpu/gen_in_trainer.py
kernel_kill_1xh200.json: colo_kit/colocate colo_kit/async_lora colo_kit/procs.py colo_kit/gpu_free.py scripts/gpu/kernel_kill.py
engine_bench.json: colo_kit/colocate scripts/engine_bench.py scripts/gpu/engine_bench.sh
share_by_hand_1xh100.json: colo_kit/labs/pitfalls.py colo_kit/memory colo_kit/grpo colo_kit/colocate scripts/share_by_hand.py
tp_gpu.json: colo_kit/parallel colo_kit/colocate scripts/tp_tuning.py scripts/gpu/tp_tuning.sh
pingpong_cpu.json: colo_kit/serving colo_kit_cli/bench.py
pingpong_gpu.json: colo_kit/serving colo_kit_cli/bench.py scripts/gpu/pingpong.sh
pingpong_gpu_partial.json: colo_kit/serving colo_kit_cli/bench.py scripts/gpu/pingpong.sh
planner_validation.json: colo_kit/memory record/planner_validation.py results/planner_measured_peaks.json \
results/zero3_run.json results/speed_1xh200.json
zero3_run.json: colo_kit/memory colo_kit/grpo colo_kit_cli/plan.py scripts/zero3_run.py scripts/gpu/zero3.sh
two_machines_cpu.json: colo_kit/parallel colo_kit/memory scripts/two_machines.py scripts/two_machines.sh
server_node_cpu.json: colo_kit/grpo colo_kit/serving scripts/server_node.py scripts/server_node.sh
math500_checker.json: colo_kit/answers scripts/bench_checker.py
math500_checker_gpu_host.json: colo_kit/answers scripts/bench_checker.py
math500_gpu.json: colo_kit/answers scripts/gpu/math500.sh
async_lora_gpu.json: colo_kit/async_lora scripts/gpu/async_lora.sh
proxy_bench.json: colo_kit/async_lora colo_kit_cli/proxy.py scripts/bench_proxy.py
proxy_bench_gpu_host.json: colo_kit/async_lora colo_kit_cli/proxy.py scripts/bench_proxy.py
proxy_prefix_hits.json: colo_kit/async_lora scripts/prefix_hit_rate.py
router_vs_proxy_cpu.json: colo_kit/async_lora colo_kit_cli/proxy.py record/router_compare.py scripts/router_compare.py \
scripts/router_compare.sh
{CHECKS["cpu"]}: {_CHECK}
{CHECKS["gpu"]}: {_CHECK}
cpu_check_00_avx2.json: {_CHECK}
cold_start_1xh100.json: {_CHECK} scripts/gpu/cold_start.py
{LESSONS}: record/lessons.py record/race.py record/speed.py record/router_compare.py colo_kit/serving/pingpong.py \
results/speed_1xh200.json results/speed_1xh100.json results/gen_latency_1xh200.json results/router_vs_proxy_cpu.json \
results/share_by_hand_1xh100.json"""
MEASURES = {name: tuple(paths.split()) for name, paths in (line.split(":", 1) for line in _TABLE.strip().splitlines())}
PLANNER_GOAL = 0.10  # the planner's largest error against a measured peak
NOT_IN_CLONE = "commit not in this clone"


def git(root: Path, *args: str) -> str | None:
    """git's stdout in `root`, or None where git fails or is missing."""
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


@lru_cache(maxsize=None)
def commit_info(root: Path, commit: str) -> tuple[str, str] | None:
    """(short hash, YYYY-MM-DD) of `commit`, or None when this clone does not have it."""
    m = re.match(r"[0-9a-f]{4,40}", commit or "")
    out = m and git(root, "show", "-s", "--format=%h %cs", m[0] + "^{commit}", "--")
    return tuple(out.split()[:2]) if out else None


@lru_cache(maxsize=None)
def commits_after(root: Path, commit: str, paths: tuple[str, ...]) -> int | None:
    """How many commits after `commit`, up to HEAD, changed `paths`; None when `commit` is not in this clone."""
    if not paths or commit_info(root, commit) is None:
        return None
    out = git(root, "rev-list", "--count", f"{commit_info(root, commit)[0]}..HEAD", "--", *paths)
    return int(out) if out and out.isdigit() else None


def newest(root: Path, commits: list[str]) -> str | None:
    """The newest of `commits` this clone has (by commit date), else the first named, else None."""
    known = [c for c in commits if commit_info(root, c)]
    out = git(root, "rev-list", "--no-walk=sorted", *[commit_info(root, c)[0] for c in known]) if known else None
    return out.split()[0] if out else (commits[0] if commits else None)


def item_commits(data: dict) -> list[str]:
    """The commits a record's items say they ran at: its own, its notebooks' and tests', its records' and variants'."""
    found = [data.get("commit")]
    for part in ("notebooks", "tests"):
        if isinstance(data.get(part), dict):
            found += [i.get("commit") for i in data[part].get(part) or [] if isinstance(i, dict)]
    variants = data.get("variants")
    for group in (data.get("records"), list(variants.values()) if isinstance(variants, dict) else variants):
        found += [i.get("commit") for i in group or [] if isinstance(i, dict)] if isinstance(group, list) else []
    return list(dict.fromkeys(c for c in found if isinstance(c, str) and c))


def machine_of(name: str, data: dict) -> str:
    env = data.get("env") or data.get("describe")
    if isinstance(env, dict) and (env.get("gpus") or env.get("cpu_count")):
        return machine_label(env)
    items = data.get("notebooks", {}).get("notebooks", []) if isinstance(data.get("notebooks"), dict) else []
    items = items or [e for e in data.values() if isinstance(e, dict) and "source" in e]  # lessons.json's entries
    if machines := sorted({i["machine"] for i in items if isinstance(i, dict) and i.get("machine")}):
        return " and ".join(machines)
    m = re.search(r"_(\d+)x(h\d+)", name, re.I)
    return f"{m[1]}×{m[2].upper()}" if m else "not recorded"


def readers(root: Path) -> dict[str, set[str]]:
    """{results file name: the notebooks ("00".."06"), "README" and "INSTRUCTOR" (docs/INSTRUCTOR.md) that name it or
    read a number from it}."""
    out: dict[str, set[str]] = {}
    lessons = _load(root / "results" / LESSONS)[0] or {}
    sources = sorted((root / "notebooks" / "src").glob("[0-9][0-9]_*.py")) + [root / "README.md"]
    sources.append(root / "docs" / "INSTRUCTOR.md")
    for src in filter(Path.exists, sources):
        text, who = src.read_text(), src.name[:2] if src.suffix == ".py" else src.stem
        if who == "README":  # README's copy of this report does not count as reading a record
            text = re.sub(r"\n## How fresh.*?(?=\n## |\Z)", "", text, flags=re.S)
        names = re.findall(r"results/(\w+)\.json", text) + re.findall(r'results_dir\(\) / "(\w+)\.json"', text)
        names += re.findall(r'results\.load\("(\w+)', text)
        if src.suffix == ".md":  # README's tables name a record by its file name alone
            names += [n for n in re.findall(r"\b(\w+)\.json\b", text) if (root / "results" / f"{n}.json").exists()]
        for key in re.findall(r'results\.shown\("([^"]+)"\)', text):
            names += [LESSONS.removesuffix(".json"), *re.findall(r"results/(\w+)\.json", str(lessons.get(key, "")))]
        if "{{measured_times}}" in text:  # the header's Run All times, from the check runs
            names += [c.removesuffix(".json") for c in CHECKS.values()]
        for n in names:
            out.setdefault(f"{n}.json", set()).add(who)
    return out


def _load(path: Path) -> tuple[dict | None, str | None]:
    """(the record, None), or (None, one line naming the file and what is wrong)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"results/{path.name}: not valid JSON ({e}); skipped"
    return (data, None) if isinstance(data, dict) else (None, f"results/{path.name}: not a JSON object; skipped")


def _when(root: Path, commit: str | None, rel: str) -> dict:
    """The commit that measured a number, its date, and whether this clone has it; the last commit that wrote `rel`
    stands in for a record that names none."""
    if not commit:
        last = git(root, "log", "-1", "--format=%h %cs", "--", rel)
        if not last:
            return {"commit": None, "date": None, "in_clone": False, "note": "not committed"}
        commit = last.split()[0]
    info = commit_info(root, commit)
    return {"commit": info[0] if info else commit[:9], "date": info[1] if info else None, "in_clone": bool(info)}


def report(root: Path = REPO_ROOT) -> dict:
    root = Path(root).resolve()
    read, problems, files, runs, owed, goals = readers(root), [], [], [], [], []
    for path in sorted((root / "results").glob("*.json")):
        data, problem = _load(path)
        if problem:
            problems.append(problem)
            continue
        paths = MEASURES.get(path.name, ())
        when = _when(root, newest(root, item_commits(data)), f"results/{path.name}")
        files.append({"file": path.name, "machine": machine_of(path.name, data), **when, "measures": list(paths),
                      "commits_after": commits_after(root, when["commit"] or "", paths),
                      "read_by": sorted(read.get(path.name, ()))})
        goals += [f"results/{path.name}: {key} is false" for key in _false_goals(data)]
        goals += race_goals(path.name, data)
    for name, who in sorted(read.items()):
        if not (root / "results" / name).exists():
            writers = sorted(str(p.relative_to(root)) for p in (root / "scripts").rglob("*.[ps][yh]")
                             if name in p.read_text(errors="replace")) if (root / "scripts").exists() else []
            owed.append(f"results/{name}: named by {', '.join(sorted(who))}, not committed"
                        + (f" (written by {', '.join(writers)})" if writers else ""))
    srcs = {p.stem: p for p in (root / "notebooks" / "src").glob("[0-9][0-9]_*.py")}
    for tier, name in CHECKS.items():
        data = _load(root / "results" / name)[0] or {}
        items = data.get("notebooks", {}).get("notebooks", []) if isinstance(data.get("notebooks"), dict) else []
        last, rerun = {i["notebook"]: i for i in items if isinstance(i, dict) and i.get("notebook")}, []
        for nb in sorted(set(last) | set(srcs)):
            if (rec := last.get(nb)) is None:
                rerun.append(f"{nb[:2]} (none recorded)")
                continue
            status = str(rec.get("status", ""))
            status = ("completed" if status.startswith(("completed", "executed every cell")) else
                      "cut" if status.startswith(("cut", "not run")) else "failed")
            current = nb in srcs and rec.get("source_sha256") == source_digest(srcs[nb])
            when = _when(root, rec.get("commit"), f"results/{name}")
            paths = (f"notebooks/src/{nb}.py", "colo_kit")
            runs.append({"notebook": nb, "tier": tier, "file": name, "status": status,
                         "machine": rec.get("machine") or machine_of(name, data), **when, "current_source": current,
                         "commits_after": commits_after(root, when["commit"] or "", paths)})
            if status != "completed" or not current:
                rerun.append(nb[:2] if status == "completed" else f"{nb[:2]} ({status})")
        if rerun:
            owed.append(f"results/{name}: a {tier.upper()} Run All of notebooks {', '.join(rerun)} at their current source")
    validation = _load(root / "results" / "planner_validation.json")[0] or {}
    if isinstance(err := validation.get("max_abs_error"), (int, float)) and err > PLANNER_GOAL:
        goals.append(f"results/planner_validation.json: the planner's largest error is {err:.1%} "
                     f"(goal {PLANNER_GOAL:.0%})")
    return {"files": files, "notebook_runs": runs, "owed": owed + goals, "problems": problems}


SEEDS_GOAL, TOKENS_GOAL, SOONER_GOAL = 5, 4.0, 2.0  # per configuration; x TRL's defaults; median x sooner


def race_goals(name: str, data: dict) -> list[str]:
    """The speed goals a race file (`speed_1x<gpu>.json`) does not meet yet in the race of seeds notebook 04 charts
    (the newest 1.5B race that ran only TRL's defaults and the recipe; the newest 1.5B race when none did): at least
    five seeds each, 4x their tokens/s, the threshold 2x sooner by the median."""
    races = (data.get("summary") or {}).get("qwen2.5-1.5b") if name.startswith("speed_1x") else None
    if not isinstance(races, dict) or not races:
        return []
    key = race.seeds_race(data) or next(reversed(races))
    summary = race.summarize_again(data, "qwen2.5-1.5b", key)[1] or races[key]
    configs = summary.get("configs", {})
    where, out = f"results/{name}: the 1.5B race of seeds at {key.rsplit(' at ', 1)[-1]}" if " at " in key \
        else f"results/{name}: the 1.5B race of seeds", []
    for config in ("trl_defaults", "recipe"):
        seeds = len((configs.get(config) or {}).get("seeds", []))
        if seeds < SEEDS_GOAL:
            out.append(f"{where} has {seeds} seed(s) of {config} (goal: {SEEDS_GOAL})")
    recipe = configs.get("recipe") or {}
    for field, goal, what in (("tokens_per_s_vs_defaults", TOKENS_GOAL, "tokens/s"),
                              ("time_to_reward_median_vs_defaults", SOONER_GOAL, "median time to the threshold")):
        if not isinstance(recipe.get(field), (int, float)) or recipe[field] < goal:
            got = f"{recipe[field]}x TRL's defaults" if isinstance(recipe.get(field), (int, float)) else "not measured"
            out.append(f"{where}: the recipe's {what} is {got} (goal: {goal:g}x TRL's defaults)")
    return out


def _false_goals(data, where: str = "") -> list[str]:
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in ([f"{where}{key}"] if key.endswith("goal_met") and v is False
                                                         else _false_goals(v, f"{where}{key}."))]
    return []


def _since(row: dict) -> str:
    if not row["in_clone"]:
        return row.get("note") or NOT_IN_CLONE
    return "no code mapped" if row["commits_after"] is None else str(row["commits_after"])


def _readers(who: list[str]) -> str:
    nbs = [w for w in who if w[:2].isdigit()]
    docs = [w for w in ("README", "INSTRUCTOR") if w in who]
    return " ".join((["all notebooks"] if len(nbs) >= 7 else nbs) + docs) or "—"


def text(rep: dict) -> str:
    def _at(r: dict) -> str:
        return f"{r['commit'] or '—'} {r['date'] or ''}".strip()

    def _cut(machine: str, width: int = 22) -> str:
        return machine if len(machine) <= width else machine[:width - 1] + "…"

    lines = ["Numbers a learner reads, by results file (a report, not a test: `make numbers-status`)",
             f"{'results file':<28} {'machine':<22} {'measured at':<19} {'code commits since':<24} read by"]
    lines += [f"{r['file']:<28} {_cut(r['machine']):<22} {_at(r):<19} {_since(r):<24} {_readers(r['read_by'])}"
              for r in rep["files"]]
    lines += ["", "Run All of each notebook (results/cpu_check.json, results/gpu_check.json)",
              f"{'notebook':<24} {'kind':<4} {'status':<9} {'machine':<22} {'measured at':<19} {'commits since':<24} "
              "source"]
    lines += [f"{r['notebook']:<24} {r['tier']:<4} {r['status']:<9} {_cut(r['machine']):<22} {_at(r):<19} {_since(r):<24} "
              f"{'current' if r['current_source'] else 'older than now'}" for r in rep["notebook_runs"]]
    lines += ["", "Owed"] + [fill(o, 128, initial_indent="- ", subsequent_indent="  ") for o in rep["owed"] or ["nothing"]]
    problems = [fill(p, 128, initial_indent="- ", subsequent_indent="  ") for p in rep["problems"]]
    return "\n".join(lines + (["", "Problems", *problems] if problems else []))


def markdown(rep: dict) -> str:
    lines = ["| results file | machine | measured at | code commits since | read by |",
             "|---|---|---|---|---|"]
    lines += [f"| `{r['file']}` | {r['machine']} | {r['commit'] or '—'}, {r['date'] or '?'} | {_since(r)} | "
              f"{_readers(r['read_by'])} |" for r in rep["files"] if r["read_by"] and r["file"] not in CHECKS.values()]
    for tier, name in CHECKS.items():
        rs = [r for r in rep["notebook_runs"] if r["tier"] == tier]
        done = sum(r["status"] == "completed" for r in rs)
        lines.append(f"| `{name}` (Run All) | {' and '.join(sorted({r['machine'] for r in rs})) or '—'} | "
                     f"{done} of {len(rs)} notebooks completed, {sum(r['current_source'] for r in rs)} at their "
                     f"current source | {max((r['commits_after'] or 0 for r in rs), default=0)} at most | all notebooks |")
    return "\n".join(lines + [""] + [f"- open: {o}" for o in rep["owed"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m record.status", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="the whole report as JSON")
    parser.add_argument("--markdown", action="store_true", help="a summary table for README.md")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the clone to report on")
    args = parser.parse_args(argv)
    rep = report(args.root)
    try:
        print(json.dumps(rep, indent=1, ensure_ascii=False) if args.json else markdown(rep) if args.markdown else text(rep))
    except BrokenPipeError:  # `make numbers-status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
