"""The notebooks as a lab: objectives, measured times, prerequisites, a recap, and at least two
predict-then-run exercises each, whose checks accept the solution and refuse a wrong answer with a
hint; no internal wording; numbers carry their label."""

import functools
import json
import re

import pytest

from colo_kit.labs import lab
from colo_kit.paths import REPO_ROOT
from colo_kit.results import UNMEASURED, machine_label
from record.notebooks import NOTEBOOKS, SOURCES, TIMES, measured_times, parse_source
from record.refresh import refresh_tables

SRCS = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
EXERCISES = lab.exercises()


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_each_check_accepts_its_solution_and_refuses_every_wrong_answer(key, capsys):
    ex = EXERCISES[key]
    assert lab.verdict(key, ex.solution) is True
    assert lab.check(key, ex.solution) is None  # a cell shows the message only, no stray True/False
    assert capsys.readouterr().out.startswith("✔ right")
    assert len(ex.wrong) >= 5, f"{key}: list at least 5 plausible wrong answers"
    for wrong in ex.wrong:
        assert lab.verdict(key, wrong) is False, f"{key} accepted the wrong answer {wrong!r}"
        lab.check(key, wrong)
        out = capsys.readouterr().out
        assert "✔" not in out
        form = ex.form_error(wrong)  # what to write instead, when the answer is in no form the exercise reads
        assert (f"✎ {key}: {form}" if form else f"Hint: {ex.hint}") in out, out
        if not form and not ex.options:
            assert lab.read_number(wrong, ex.share) is not None  # a wrong number gets the hint, not a form lesson
    if isinstance(ex.solution, (int, float)) and not isinstance(ex.solution, bool):
        assert f"{ex.solution:g}" not in ex.hint.split(), f"{key}: the hint gives the answer away"
    assert lab.verdict(key, ...) is None  # the placeholder a cell starts with: Run All passes through
    lab.check(key, ...)
    assert "write your prediction" in capsys.readouterr().out


# Right answers as a learner writes them, and wrong ones in the same forms: the forms must not let a wrong one in.
NATURAL = {
    "00.prompts_per_step": (["two", "two prompts", "2 prompts", " 2 ", "2.0", "4/2", "Two."], ["two or sixteen", "16 prompts"]),
    "02.max_num_seqs": (["sixty-four"], []),
    "03.amdahl": (["1.3x", "1.30", "1.3×"], ["1.5x", "30%", "3/2"]),
    "04.bytes_per_param": (["16 bytes", "sixteen", "16 bytes per parameter", "32/2"],
                           ["8 bytes", "16 or 8", "16%", "16 billion", "16 hundred"]),
    "06.slots": (["six", "6 slots", "6 adapters"], ["five", "5 slots", "six or seven", "about six"]),
    "06.best_hit_rate": (["7/8", "87.5%", 87.5, "87.5", "0.875", "87.5 %", "87.5 percent", "seven eighths"],
                         ["1/8", "12.5%", "100%", 8, "75%", 1.0, "one eighth", "7 eighths", "0.875 thousand"]),
}


@pytest.mark.parametrize("key", sorted(NATURAL))
def test_a_number_written_naturally_is_read_as_that_number(key, capsys):
    right, wrong = NATURAL[key]
    for answer in right:
        if key == "02.max_num_seqs" or answer == "seven eighths":  # compound number words are not read
            assert lab.verdict(key, answer) is False
            lab.check(key, answer)
            assert "write one number" in capsys.readouterr().out
            continue
        assert lab.verdict(key, answer) is True, f"{key} refused the right answer {answer!r}"
    for answer in wrong:
        assert lab.verdict(key, answer) is False, f"{key} accepted the wrong answer {answer!r}"


def test_a_refused_form_says_what_to_write_and_a_wrong_number_gets_the_hint(capsys):
    lab.check("00.prompts_per_step", "2 or 16")
    assert capsys.readouterr().out.strip() == "✎ 00.prompts_per_step: write one number, like 0.5 (7/8 and two work too)"
    lab.check("06.best_hit_rate", "most of them")
    assert "like 0.5 or 50%" in capsys.readouterr().out
    lab.check("00.prompts_per_step", "16 prompts")
    assert "Hint: the batch holds whole groups" in capsys.readouterr().out
    lab.check("03.amdahl", "30%")  # a percentage where no share is asked is a form to correct, not a wrong value
    assert "write one number" in capsys.readouterr().out
    assert lab.read_number("1/0") is None and lab.read_number(float("nan")) is None and lab.read_number(True) is None


@pytest.mark.parametrize("key", sorted(k for k, e in EXERCISES.items() if e.options))
def test_a_choice_takes_only_its_options_or_their_letters(key, capsys):
    ex = EXERCISES[key]
    right = next(o for o in ex.options if ex.accept(o))
    letter = "abcdefgh"[ex.options.index(right)]
    assert lab.verdict(key, letter) is True and lab.verdict(key, right.upper()) is True
    assert lab.verdict(key, f"I think {right}") is False  # free text around the option is not an option
    lab.check(key, f"I think {right}")
    out = capsys.readouterr().out
    assert "answer with one of" in out and all(repr(o) in out for o in ex.options)


@pytest.mark.parametrize("key", sorted(k for k, e in EXERCISES.items() if e.options))
def test_each_choice_cell_shows_its_options(key):
    src = next(p for p in SRCS if p.stem.startswith(key[:2]))
    cells = _cells(src)
    at = next(i for i, c in enumerate(cells) if f'lab.check("{key}"' in c["source"])
    shown = (cells[at - 1]["source"] + cells[at]["source"]).lower()
    for option in EXERCISES[key].options:
        assert option.lower() in shown, f"{src.name}: {key}'s question must list the option {option!r}"


def _cells(src):
    return _parsed(src.read_text())


@functools.lru_cache(maxsize=None)
def _parsed(text: str) -> list[dict]:
    """jupytext's parse of a source, once per text: the many tests of one notebook read the same cells."""
    return parse_source(text)


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_each_notebook_opens_with_objectives_time_and_prerequisites_and_ends_with_a_recap(src):
    cells = _cells(src)
    head = cells[0]["source"]
    objectives = re.search(r"\*\*You will\*\*(.*?)\n\n", head, re.S)
    assert objectives, f"{src.name}: the first cell needs '**You will**' and a list of objectives"
    n = len(re.findall(r"^- ", objectives.group(1), re.M))
    assert 3 <= n <= 5, f"{src.name}: {n} objectives; give 3 to 5"
    assert "**Time**" in head and "**Before this" in head, src.name
    tail = "\n".join(c["source"] for c in cells[-3:] if c["type"] == "markdown")
    assert "## Recap" in tail and "**Next" in tail, f"{src.name}: end with '## Recap' and '**Next**'"


def _stated_minutes(head: str, tier: str) -> float | None:
    m = re.search(rf"{tier}[^·\n]*?~?(\d+(?:\.\d+)?) min", head)
    return float(m.group(1)) if m else None


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_the_times_a_notebook_states_are_the_measured_ones(src):
    """The source types no time (it says {{measured_times}}); the notebook a learner opens states each
    tier's measured time and the file it comes from (no commit: the lesson shows the number, the record its history)."""
    assert TIMES in _cells(src)[0]["source"], f"{src.name}: the header says {TIMES}, the build writes the times"
    import nbformat

    head = nbformat.read(NOTEBOOKS / (src.stem + ".ipynb"), as_version=4).cells[0].source
    for name in ("cpu_check.json", "gpu_check.json"):
        record = json.loads((REPO_ROOT / "results" / name).read_text())
        nb = {n["notebook"]: n for n in record["notebooks"]["notebooks"]}[src.stem]
        if not nb["status"].startswith(("completed", "executed every cell")):  # failed or cut: no time to state
            unmeasured = UNMEASURED["cpu" if name == "cpu_check.json" else "gpu"]
            assert f"{unmeasured}: not measured" in head, f"{src.stem}.ipynb: its {name} run {nb['status']}, " \
                                                          "yet the header states a time"
            continue
        tier = re.escape(nb.get("machine") or machine_label(record["env"]))  # the machine it ran on, by name
        stated = _stated_minutes(head, tier)
        assert stated is not None, f"{src.stem}.ipynb: no {tier} time; run `python scripts/check.py refresh`"
        assert abs(stated - nb["seconds"] / 60) <= 0.05 + 1e-9, f"{src.stem}.ipynb: says {stated} min on {tier}, " \
                                                         f"measured {nb['seconds']} s; run `python scripts/check.py refresh`"
        assert f"`results/{name}`" in head and not re.search(r"\b[0-9a-f]{7,40}\b", head), head


@pytest.mark.parametrize("doc", ["README.md", "docs/INSTRUCTOR.md"])
def test_the_docs_tables_hold_the_measured_times_and_peaks(doc):
    text = (REPO_ROOT / doc).read_text()
    assert refresh_tables(text) == text, f"{doc}: its times or peaks are not the committed check runs'; " \
                                         "run `python scripts/check.py refresh`"


def test_a_record_read_whole_is_footnoted_with_the_machine_and_date_it_names(tmp_path):
    """`results.record_footnote`: the footnote under a record a lesson reads itself (05's GPU comparison), the machine
    from the record's own `env`, not a fixed name."""
    from colo_kit.results import record_footnote

    h100 = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "mem_gib": 79.6}], "cpu_count": 16}
    (tmp_path / "run_a.json").write_text(json.dumps({"env": h100, "date": "2026-12-06"}))
    (tmp_path / "run_b.json").write_text(json.dumps({"env": {"gpus": [], "cpu_count": 2}}))
    assert record_footnote("run_a", tmp_path) == "measured on 1×H100, 2026-12-06 (results/run_a.json)"
    assert record_footnote("run_b.json", tmp_path) == "measured on CPU laptop (2 cores) (results/run_b.json)"


def test_each_number_names_the_machine_it_was_measured_on_even_when_the_gpu_check_spans_two_kinds(
        tmp_path, monkeypatch):
    """A lent GPU node is an H200 one day and an H100 the next: the header, the docs' tables and the "What you should
    see" boxes name the machine of each record (its `machine`, or its file's `env` for a record older than that),
    never a fixed "1×H200"."""
    h100 = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "mem_gib": 79.2}], "cpu_count": 16}
    h200 = {"gpus": [{"index": 0, "name": "NVIDIA H200", "mem_gib": 140.4}], "cpu_count": 16}
    assert machine_label(h100) == "1×H100" and machine_label({"gpus": h200["gpus"] * 2}) == "2×H200"
    assert machine_label({"cpu_count": 2}) == "CPU laptop (2 cores)"

    def nb(stem, seconds, **extra):
        return {"notebook": stem, "status": "completed", "seconds": seconds, "commit": "c" * 40,
                "peak_rss_gib": 1.0, "peak_gpu_gib": 20.0, **extra}

    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path))
    (tmp_path / "cpu_check.json").write_text(json.dumps({"env": {"cpu_count": 4}, "notebooks": {"notebooks": [
        nb("00_quickstart", 30, facts={"00.k": {"tok_per_s": 912.0}})]}}))
    # a record older than `machine`: every item ran on the H100 its env names
    (tmp_path / "gpu_check.json").write_text(json.dumps({"env": h100, "notebooks": {"notebooks": [
        nb("00_quickstart", 120, facts={"00.k": {"tok_per_s": 20810.4}}), nb("02_sleep_mode", 60)]}}))
    head = measured_times("00_quickstart")
    assert head.startswith("CPU laptop (4 cores) ~0.5 min · 1×H100 ~2.0 min") and "H200" not in head, head
    instructor = (REPO_ROOT / "docs" / "INSTRUCTOR.md").read_text()
    text = refresh_tables(instructor)
    assert "| slot | notebook | Run All: CPU laptop (4 cores) / 1×H100 |" in text
    assert "| notebook | what runs | peak, CPU laptop (4 cores) | peak, 1×H100 |" in text and "1×H200" not in text
    assert "the 1-GPU times below are from 1×H100)" in refresh_tables((REPO_ROOT / "README.md").read_text())

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj.data))
    lab.see("00.k", "a test box", tok_per_s=15000.0, tp2_over_tp1=None, kv_tokens=1036, steps=40)
    assert "this run: tok_per_s 15,000, tp2_over_tp1 n/a, kv_tokens 1,036, steps 40" in shown[0]
    assert "measured on CPU laptop (4 cores): tok_per_s 912 " in shown[0]
    assert "measured on 1×H100: tok_per_s 20,810 (`results/gpu_check.json`" in shown[0], shown[0]

    # the next call lands on an H200: its item says so, and each cell of a mixed column names its own machine
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    record["notebooks"]["notebooks"][1].update(machine="1×H200")
    (tmp_path / "gpu_check.json").write_text(json.dumps(record))
    text = refresh_tables(instructor)
    assert "| slot | notebook | Run All: CPU laptop (4 cores) / 1×H100 and 1×H200 |" in text
    assert "| `02_sleep_mode` | one engine and a trainer model | not recorded yet | 20.0 GiB (1×H200) |" in text
    assert "| `00_quickstart` | one trainer with its engine | 1.0 GiB | 20.0 GiB (1×H100) |" in text
    assert "1×H200 ~1.0 min" in measured_times("02_sleep_mode")


def test_refresh_rewrites_a_stale_time_and_peak():
    text = (REPO_ROOT / "docs" / "INSTRUCTOR.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `04_zero3_72b_recipe` |"))
    stale = row.rsplit("|", 3)[0] + "| 99.9 GiB | 99.9 GiB |"
    assert refresh_tables(text.replace(row, stale)) == text


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_each_notebook_has_two_checked_exercises_with_a_collapsed_solution(src):
    cells = _cells(src)
    keys = []
    for i, c in enumerate(cells):
        for key in re.findall(r'lab\.check\("([^"]+)"', c["source"]):
            assert key in EXERCISES, f"{src.name}: no exercise {key}"
            assert key.startswith(src.stem[:2] + "."), f"{src.name}: {key} belongs to another notebook"
            after = cells[i + 1]["source"] if i + 1 < len(cells) else ""
            assert "<details>" in after and "Solution" in after, f"{src.name}: {key} needs a collapsed solution next"
            assert re.search(r"=\s*\.\.\.", c["source"]), f"{src.name}: {key}'s cell must start from the ... placeholder"
            keys.append(key)
    assert len(set(keys)) >= 2, f"{src.name}: {len(set(keys))} exercises; give at least 2"


INTERNAL = re.compile(r"\bissue \d+|the issue'?s?\b|the team|this session|\bowed\b|\blent\b|\bin CI\b|as in CI|"
                      r"kit bug|by mistake|\.\./shared", re.I)


@pytest.mark.parametrize("path", SRCS + [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_no_internal_wording(path):
    hits = [line for line in path.read_text().splitlines() if INTERNAL.search(line)]
    assert not hits, f"{path.name} speaks of issues, sessions, the team or its machines: {hits[:3]}"


# A number a learner reads with a unit of speed, memory or size, or a ratio: its paragraph says where it
# comes from. The words: quoted (the post), modelled (from which costs), measured (which JSON).
# (×H200 counts GPUs; a 95% interval is a definition, not a claim)
CLAIM = re.compile(r"\d(?:[\d.,]*)(?:×(?![A-Za-z])|(?<!95) ?%| ?GiB| ?GB| ?MB| ?tok/s| ?tokens/s| min\b| h \d)")
LABEL = re.compile(r"quoted|modelled|measured|the post|post \d|\.json|planner|model says|by construction", re.I)


@pytest.mark.parametrize("path", SRCS + [REPO_ROOT / "README.md"], ids=lambda p: p.name)
def test_every_numeric_claim_carries_its_label(path):
    text = path.read_text()
    if path.suffix == ".py":  # the markdown of a notebook source
        text = "\n".join(c["source"] for c in _parsed(text) if c["type"] == "markdown")
    unlabelled = []
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith(("|---", "```")) or "<details>" in para:
            continue
        if CLAIM.search(para) and not LABEL.search(para):
            unlabelled.append(para.strip()[:160])
    assert not unlabelled, f"{path.name}: numbers without quoted/modelled/measured and a source: {unlabelled[:3]}"


# Phrases that give an exercise's answer away. Run All runs every cell, so none of them may appear in a cell
# before the exercise's question (checked on the sources: prose, code and the comments in code).
REVEALS = {
    "00.prompts_per_step": ["two prompts", "2 prompts"],
    "00.broken_sync": ["gap grows", "would grow"],
    "00.reward_value": ["-|20 - 20|", "−|20 − 20|"],
    "01.two_gpus": ["about tie", "normalised **1.0", "~1× per device"],
    "01.eight_gpus": ["gen(7b) > gen(b)", "gen(7·b) > gen(b)"],
    "02.max_num_seqs": ["8 × 2 × 4", "**64**"],
    "02.no_buffer_restore": ["PR #16889", "copies every named buffer"],
    "03.tp_seed": ["they diverge", "drift apart"],
    "03.amdahl": ["1.30", "1.3×", "FloatSlider(value=1.5"],  # a slider set to the question's g shows the answer
    "04.bytes_per_param": ["16 bytes"],
    "04.host_memory": ["16 bytes × 72.7B", "1.1 TiB", "more than its 560"],
    "05.checker": ["½ and 0.5 are one number", "1/2 and 0.5"],
    "05.none_gold": ["TRL ignores a None", "None where gold"],
    "06.slots": ["max-loras 6", "max_staleness + 2", "6 loaded at once"],
    "06.shared_name": ["keys cached KV blocks by", "by the adapter's name"],
    "06.best_hit_rate": ["7/8", "0.875"],
}


def test_every_exercise_lists_what_would_give_it_away():
    assert set(REVEALS) == set(EXERCISES)


@pytest.mark.parametrize("key", sorted(EXERCISES))
def test_no_answer_shows_before_its_question(key):
    src = next(p for p in SRCS if p.stem.startswith(key[:2]))
    cells = _cells(src)
    at = next(i for i, c in enumerate(cells) if f'lab.check("{key}"' in c["source"])
    question = at - 1  # the markdown cell that asks; what it says before its "### Exercise" heading comes first too
    head = cells[question]["source"].split("### Exercise")[0]
    before = "\n".join([c["source"] for c in cells[:question]] + [head])
    for phrase in REVEALS[key]:
        assert phrase not in before, f"{src.name}: {phrase!r} appears before {key}'s question"


POSTS = ("https://huggingface.co/blog/vllm-colocate", "https://huggingface.co/blog/asyncgrpo-lora-hfjobs")


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_a_notebook_that_quotes_a_post_links_it(src):
    text = src.read_text()
    quotes_second = "second post" in text
    assert POSTS[1] in text if quotes_second else True, f"{src.name}: link the second post"
    if re.search(r"\bthe (first )?post\b|post 1\b", text, re.I) and not quotes_second:
        assert POSTS[0] in text, f"{src.name}: link the first post"


def test_the_readme_links_both_posts():
    readme = (REPO_ROOT / "README.md").read_text()
    assert all(url in readme for url in POSTS)


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_a_notebook_fits_its_slot_in_words(src):
    """A 20-minute slot holds about 2,500 words of prose beside the cells that run."""
    words = sum(len(c["source"].split()) for c in _cells(src) if c["type"] == "markdown")
    assert words <= 2500, f"{src.name}: {words} words of markdown; cut to 2,500 (the history belongs to the record)"
