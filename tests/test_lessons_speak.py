"""The kit and its record stay apart, and the kit speaks to learners: no commit hashes or run histories in what a
learner opens (the lessons, the package, the recipe `plan --recommend` writes); the record's history stays in
results/."""

import ast
import re

import pytest

from colo_kit.paths import REPO_ROOT

# a commit as git prints one: 7 to 40 hex digits with a letter and a digit among them (a word like "deadbeef" or a
# number like 1234567 is not one)
COMMIT = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
KIT = sorted([*(REPO_ROOT / "colo_kit").rglob("*.py"), *(REPO_ROOT / "colo_kit_cli").rglob("*.py")])  # and its commands
LESSONS = sorted((REPO_ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))


def _hashes(text: str) -> list[str]:
    return COMMIT.findall(text)


def test_the_commit_pattern_finds_commits_and_nothing_else():
    assert _hashes("at 32f45d7 the race and e271166ab") == ["32f45d7", "e271166ab"]
    assert _hashes("deadbeef 1234567 0x7fffffff sha256 cafe12 models/abc1234def_x") == []


@pytest.mark.parametrize("path", LESSONS + KIT, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_commit_hash_in_what_a_learner_opens(path):
    hits = [(i, line.strip()[:100]) for i, line in enumerate(path.read_text().splitlines(), 1) if _hashes(line)]
    assert not hits, f"{path.relative_to(REPO_ROOT)}: commit hashes belong to the record, not the lesson: {hits[:3]}"


@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "qwen2.5-7b"])
def test_the_recipe_yaml_gives_one_sentence_per_field_and_no_history(model):
    from colo_kit.memory.planner import Plan
    from colo_kit.memory.recipe import recipe, to_yaml

    text = to_yaml(recipe(Plan(model=model)))
    assert not _hashes(text), _hashes(text)
    lines = text.splitlines()
    for comment, field in zip(lines, lines[1:]):
        if comment.startswith("# ") and not field.startswith("#") and ":" in field:
            reason = comment[2:]
            # one sentence: no full stop inside it (a decimal point or an abbreviation like "e.g." is not one)
            inner = re.findall(r"[a-z)\]]\. [A-Z(]", reason.rstrip("."))
            assert not inner, f"{field.split(':')[0]}: its reason is more than one sentence: {reason[:160]}"
            assert len(reason) <= 260, f"{field.split(':')[0]}: its reason is {len(reason)} characters: {reason[:160]}"


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", KIT + LESSONS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_the_kit_and_its_lessons_never_import_the_record(path):
    """The lessons read a committed result through colo_kit.results; the record's machinery (record/) judges and
    writes results, and a learner's kit works without it."""
    assert "record" not in _imports(path), f"{path.relative_to(REPO_ROOT)} imports record/"


def test_every_entry_a_lesson_shows_is_derived_from_a_committed_record():
    """results/lessons.json holds only what record.lessons derives from the committed records: each entry names a
    committed source file, and each key a notebook reads is there."""
    import json

    shown = json.loads((REPO_ROOT / "results" / "lessons.json").read_text())
    for key, entry in shown.items():
        assert (REPO_ROOT / entry["source"]).is_file(), (key, entry["source"])
        assert entry["machine"] and ({"rows", "costs", "configs"} & set(entry)), key
    read = {k for src in LESSONS for k in re.findall(r'results\.shown\("([^"]+)"\)', src.read_text())}
    assert read and read <= set(shown), sorted(read - set(shown))
