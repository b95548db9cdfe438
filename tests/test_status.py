"""The freshness report (`record.status`, `make numbers-status`): it runs on the committed records, names every
results file a notebook reads, counts the commits after a record with real git, and survives a malformed record.
A report, not a gate: nothing here asserts that a record is fresh."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from colo_kit.paths import REPO_ROOT
from colo_kit.results import CHECKS, LESSONS
from record import status

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args: str, root=REPO_ROOT) -> str:
    out = subprocess.run([sys.executable, "-m", "record.status", "--root", str(root), *args], cwd=REPO_ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def committed() -> tuple[str, dict]:
    """The report on this clone's committed records: the text table and the --json one."""
    return _cli(), json.loads(_cli("--json"))


def notebooks_read() -> set[str]:
    """Every results file the notebooks' sources name or read a shown number from, found here by grep."""
    lessons = json.loads((REPO_ROOT / "results" / LESSONS).read_text())
    names: set[str] = set()
    for src in (REPO_ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"):
        text = src.read_text()
        names |= set(re.findall(r"results/(\w+\.json)", text)) | set(re.findall(r'results_dir\(\) / "(\w+\.json)"', text))
        names |= {f"{n}.json" for n in re.findall(r'results\.load\("(\w+?)(?:\.json)?"', text)}
        for key in re.findall(r'results\.shown\("([^"]+)"\)', text):
            names |= {LESSONS, lessons[key]["source"].removeprefix("results/")}
        if "{{measured_times}}" in text:  # the header's Run All times come from the check runs
            names |= set(CHECKS.values())
    return names


def test_the_report_names_every_results_file_a_notebook_reads(committed):
    text, rep = committed
    expected = notebooks_read()
    assert {"speed_1xh200.json", "lessons.json", "cpu_check.json"} <= expected  # the grep found the usual ones
    reported = {f["file"] for f in rep["files"]}
    for name in expected:
        assert name in text, f"{name}: a notebook reads it, the report does not name it"
        present = (REPO_ROOT / "results" / name).exists()
        assert (name in reported) if present else any(o.startswith(f"results/{name}:") for o in rep["owed"]), name


def test_every_record_a_notebook_reads_names_the_code_it_measures(committed):
    _, rep = committed
    read = notebooks_read()
    unmapped = sorted(f["file"] for f in rep["files"] if f["file"] in read and f["file"] not in status.MEASURES)
    assert not unmapped, f"{unmapped}: a notebook reads them, and the report cannot say how much code came after them"


def test_the_report_covers_every_committed_record_and_each_notebooks_run_all(committed):
    text, rep = committed
    on_disk = {p.name for p in (REPO_ROOT / "results").glob("*.json")}
    assert {f["file"] for f in rep["files"]} | {p.split(":")[0].removeprefix("results/") for p in rep["problems"]} \
        == on_disk
    for f in rep["files"]:
        assert f["machine"] and set(f) >= {"commit", "date", "commits_after", "read_by", "in_clone"}
    stems = {p.stem for p in (REPO_ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")}
    for tier, name in CHECKS.items():
        if (REPO_ROOT / "results" / name).exists():
            runs = {r["notebook"] for r in rep["notebook_runs"] if r["tier"] == tier}
            missing = stems - runs
            assert all(any(m[:2] in o for o in rep["owed"]) for m in missing), missing
    assert all(len(line) <= 130 for line in text.splitlines())


def test_json_and_markdown_parse(committed):
    _, rep = committed
    assert set(rep) == {"files", "notebook_runs", "owed", "problems"}
    md = _cli("--markdown").splitlines()
    assert md[0].startswith("| results file |") and md[1].startswith("|---")
    assert all(line.startswith("| ") for line in md[2:md.index("")])


def _git(root, *args) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path):
    """A real git repository: a record committed at one commit, then a change to the code it measures."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "results").mkdir()
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "bench.py").write_text("x = 1\n")
    (tmp_path / "other.txt").write_text("a\n")
    (tmp_path / "results" / "x.json").write_text(json.dumps({"env": {"cpu_count": 2}}))
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "record")
    measured = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "code" / "bench.py").write_text("x = 2\n")
    _git(tmp_path, "commit", "-q", "-am", "code change")
    return tmp_path, measured


def test_commits_after_counts_only_the_code_a_record_measures(repo):
    root, measured = repo
    assert status.commits_after(root, measured, ("code",)) == 1
    assert status.commits_after(root, measured, ("code/bench.py",)) == 1
    assert status.commits_after(root, measured, ("other.txt",)) == 0
    assert status.commits_after(root, _git(root, "rev-parse", "HEAD"), ("code",)) == 0
    assert status.commits_after(root, "0123456789abcdef", ("code",)) is None  # not in this clone: no crash
    row = next(f for f in status.report(root)["files"] if f["file"] == "x.json")
    assert row["commit"] == measured[:len(row["commit"])] and row["in_clone"] and row["machine"].startswith("CPU")


def test_a_commit_not_in_this_clone_is_said_not_raised(repo):
    root, _ = repo
    (root / "results" / "y.json").write_text(json.dumps({"commit": "0123456789abcdef", "env": {"cpu_count": 2}}))
    text = _cli(root=root)
    assert re.search(r"^y\.json .*" + re.escape(status.NOT_IN_CLONE), text, re.M), text


def test_a_malformed_record_gets_one_line_and_the_report_goes_on(repo):
    root, _ = repo
    (root / "results" / "broken.json").write_text('{"env": {"cpu_count": 2}, ')
    text = _cli(root=root)
    assert len([line for line in text.splitlines() if "broken.json" in line]) == 1
    assert re.search(r"^x\.json ", text, re.M)  # the good record is still reported
    rep = json.loads(_cli("--json", root=root))
    assert [p for p in rep["problems"] if "broken.json" in p] and "x.json" in {f["file"] for f in rep["files"]}


def test_the_makefile_runs_the_report():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^numbers-status:", makefile, re.M)
    assert "numbers-status" in next(line for line in makefile.splitlines() if line.startswith(".PHONY"))
    out = subprocess.run(["make", "-n", "numbers-status"], cwd=REPO_ROOT, env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "record.status" in out.stdout, out.stdout + out.stderr


def test_readmes_copy_of_the_report_does_not_count_as_reading_a_record(repo):
    root, _ = repo
    copy = "## How fresh are the numbers\n\n| `x.json` | CPU laptop (2 cores) | 0 |\n"
    (root / "README.md").write_text(f"# kit\n\n{copy}\n## Tests\n\nnothing here\n")
    assert next(f for f in status.report(root)["files"] if f["file"] == "x.json")["read_by"] == []
    (root / "README.md").write_text(f"# kit\n\n{copy}\n## Tests\n\nmeasured in `results/x.json`\n")
    assert next(f for f in status.report(root)["files"] if f["file"] == "x.json")["read_by"] == ["README"]


def test_a_race_short_of_its_goals_is_owed_in_the_report():
    """The newest 1.5B race of a speed file: fewer than five seeds, or the recipe under 4x the tokens/s or 2x sooner
    by the median, is a line in the report's "Owed" list; a race that meets them is none."""
    def race(seeds, tokens, sooner):
        configs = {"trl_defaults": {"seeds": list(range(seeds))},
                   "recipe": {"seeds": list(range(seeds)), "tokens_per_s_vs_defaults": tokens,
                              "time_to_reward_median_vs_defaults": sooner}}
        return {"summary": {"qwen2.5-1.5b": {"older": {"configs": {}}, "newest": {"configs": configs}}}}

    assert status.race_goals("speed_1xh100.json", race(5, 4.58, 2.28)) == []
    short = status.race_goals("speed_1xh200.json", race(2, 4.39, 1.9))
    assert len(short) == 3 and all(line.startswith("results/speed_1xh200.json: ") for line in short)
    assert "2 seed(s) of trl_defaults" in short[0] and "1.9x" in short[2]
    assert status.race_goals("gpu_check.json", race(2, 1.0, 1.0)) == []  # only race files


def test_the_report_judges_the_race_of_seeds_from_its_records():
    """The race judged is the one notebook 04 charts: the newest that ran only the defaults and the recipe, not a
    newer race of knobs; its medians are summarized again from its records (a file merged before the summary had
    spreads stores none)."""
    def rec(config, seed, tps, reached_at, commit):
        return {"config": config, "seed": seed, "model": "qwen2.5-1.5b", "commit": commit, "budget_s": 80.0,
                "grpo_config": {"learning_rate": 5e-4}, "completions_per_generation": 64,
                "rows": [{"t_s": 1.0, "reward": -2000.0}, {"t_s": float(reached_at), "reward": -900.0}],
                "steady": {"completion_tokens_per_s": tps, "s_per_step": 1.0, "per_cycle": []},
                "nvml_peak_gib": 70.0, "planner_peak_gib": 66.5, "phase_s_per_step": {}, "switch": {}}

    def speed_file(recipe_times):
        seeds = [rec("trl_defaults", i, 1000.0, t, "aaa") for i, t in enumerate([20, 30, 40, 50, 60])]
        seeds += [rec("recipe", i, 4000.0, t, "aaa") for i, t in enumerate(recipe_times)]
        knobs = [rec("trl_defaults", 0, 1000.0, 40, "bbb"), rec("spg8", 0, 3000.0, 90, "bbb")]
        summary = {"lr=0.0005, 80 s, at aaa": {"configs": {"trl_defaults": {}, "recipe": {}}},
                   "lr=0.0005, 80 s, at bbb": {"configs": {"trl_defaults": {}, "spg8": {}}}}
        return {"summary": {"qwen2.5-1.5b": summary}, "records": seeds + knobs}

    # five seeds each, 4x the tokens/s, median 20 s against 40 s: every goal met, though the knob race has one seed
    assert status.race_goals("speed_1xh200.json", speed_file([10, 15, 20, 25, 30])) == []
    short = status.race_goals("speed_1xh200.json", speed_file([10, 15, 25, 35]))
    assert short == ["results/speed_1xh200.json: the 1.5B race of seeds at aaa has 4 seed(s) of recipe (goal: 5)"]
    slow = status.race_goals("speed_1xh200.json", speed_file([10, 15, 25, 35, 45]))
    assert len(slow) == 1 and "median time to the threshold is 1.6x" in slow[0] and "at aaa" in slow[0]


def test_the_instructors_guide_counts_as_a_reader(repo):
    """docs/INSTRUCTOR.md quotes records too (the first Run All on a fresh machine): the report names it as a reader."""
    root, _ = repo
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "INSTRUCTOR.md").write_text("# guide\n\nMeasured (`results/x.json`): 247.6 s, then 92.8 s.\n")
    row = next(f for f in status.report(root)["files"] if f["file"] == "x.json")
    assert row["read_by"] == ["INSTRUCTOR"]
    assert "INSTRUCTOR" in status.text(status.report(root)).split("x.json", 1)[1].splitlines()[0]
