"""`make site`: the site builds from the committed executed notebooks (nothing executed) with Sphinx's warnings as
errors, every lesson has its page, no link inside the site points at a file it lacks, and a lesson page says in one
line that its outputs come from an earlier version of the lesson exactly when the executed copy ran other code than
the lesson has now (the record reports, it does not gate: a stale copy is named, never a failure).

One build per module (about 30 s on 2 cores), many cheap checks on it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parent.parent
LESSONS = sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _site():
    spec = importlib.util.spec_from_file_location("site_build", REPO / "docs" / "site" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


site = _site()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    (out / "html" / "api").mkdir(parents=True)  # a page an earlier build made for a module that has since gone
    (out / "html" / "api" / "colo_kit.gone.html").write_text("<html>an old module</html>")
    try:
        info = site.build(out)  # -W: a broken cross-reference or toctree entry is an error, and the build fails
    except SystemExit as exc:  # `make site`'s one-line exit; raised here it would tangle pytest's fixture teardown
        pytest.fail(str(exc), pytrace=False)
    return out / "html", info


def test_the_reference_has_a_page_per_module_and_none_for_a_module_that_has_gone(built):
    html, _ = built
    pages = {p.stem for p in (html / "api").glob("*.html")}
    assert {"colo_kit.colocate.engine", "colo_kit_cli", "colo_kit_cli.plan"} <= pages
    assert set(site.modules()) <= pages and "colo_kit.gone" not in pages


def _code(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("href", "src") and v:
                self.links.append(v)


def test_every_lesson_has_a_page_built_from_its_newest_executed_copy(built):
    html, info = built
    assert sorted(info) == LESSONS
    for name in LESSONS:
        assert (html / "lessons" / f"{name}.html").is_file(), f"no page for {name}"
        gpu, cpu = (REPO / "results" / f"{t}_check" / f"{name}.ipynb" for t in ("gpu", "cpu"))
        want = gpu if gpu.exists() else cpu if cpu.exists() else None
        assert info[name]["executed"] == (str(want) if want else None)


def test_a_lesson_page_names_an_earlier_version_exactly_when_its_copy_ran_other_code(built):
    html, info = built
    for name in LESSONS:
        page = (html / "lessons" / f"{name}.html").read_text()
        assert "Outputs:" in page, f"{name}: no line saying where its outputs come from"
        executed = info[name]["executed"]
        stale = bool(executed) and _code(Path(executed)) != _code(REPO / "notebooks" / f"{name}.ipynb")
        assert (site.STALE in page) == stale, f"{name}: the stale line is {'missing' if stale else 'shown'}"


def test_a_changed_code_cell_is_named_on_the_page(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(REPO / "results", results, ignore=shutil.ignore_patterns("runs", "*.log", "*.txt"))
    name = LESSONS[0]
    copy = results / "cpu_check" / f"{name}.ipynb"
    nb = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["source"] = "print('an earlier version')\n"
    copy.write_text(json.dumps(nb))
    (results / "gpu_check" / f"{name}.ipynb").unlink(missing_ok=True)
    info = site.stage(tmp_path / "src", REPO, results)
    assert info[name]["stale"]
    assert site.STALE in (tmp_path / "src" / "lessons" / f"{name}.ipynb").read_text()


def test_a_copy_that_ran_the_same_code_reads_with_the_lessons_prose_as_it_is_now(tmp_path):
    # `make numbers` writes a run's time into the header after that run: the copy's own header is one run behind
    results = tmp_path / "results"
    shutil.copytree(REPO / "results", results, ignore=shutil.ignore_patterns("runs", "*.log", "*.txt"))
    name = LESSONS[0]
    nb = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())
    prose = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    now = "".join(prose[-1]["source"])
    prose[-1]["source"] = "Time (Run All, measured): ~9.9 min, the header before this run\n"
    (results / "cpu_check" / f"{name}.ipynb").write_text(json.dumps(nb))
    (results / "gpu_check" / f"{name}.ipynb").unlink(missing_ok=True)
    info = site.stage(tmp_path / "src", REPO, results)
    page = json.loads((tmp_path / "src" / "lessons" / f"{name}.ipynb").read_text())
    text = json.dumps(page)
    assert not info[name]["stale"] and "the header before this run" not in text
    assert any("".join(c["source"]) == now for c in page["cells"] if c["cell_type"] == "markdown")


def test_no_link_inside_the_site_points_at_a_missing_file(built):
    html, _ = built
    broken = []
    for page in html.rglob("*.html"):
        parser = _Links()
        parser.feed(page.read_text(errors="replace"))
        for link in parser.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("#", "mailto:", "javascript:", "data:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(html)} -> {link}")
    assert not broken, f"{len(broken)} broken links, e.g. {broken[:5]}"


def test_the_other_machines_outputs_are_one_click_away(built):
    html, info = built
    for name in LESSONS:
        if info[name]["tier"] is None:
            continue
        page = (html / "lessons" / f"{name}.html").read_text()
        other = "CPU" if info[name]["tier"] == "gpu" else "GPU"
        other_copies = [REPO / "results" / f"{other.lower()}_check" / f"{name}.{e}" for e in ("ipynb", "html")]
        if any(p.exists() for p in other_copies):
            assert f"{other} outputs" in page, f"{name}: no link to the {other} outputs"


def test_charts_work_offline_and_search_is_built(built):
    html, _ = built
    assert (html / "_static" / "plotly.min.js").stat().st_size > 1_000_000
    assert (html / "search.html").exists() and (html / "searchindex.js").exists()
    pages = [p.read_text() for p in (html / "lessons").glob("*.html")]
    assert any("Plotly.newPlot" in p for p in pages)
    assert not any("cdn.plot.ly" in p for p in pages), "a lesson page loads plotly.js from a CDN"
    assert not any("widget-state+json" in p or "unpkg.com" in p for p in pages), "a page loads the widget manager"


def test_pages_name_no_commit_of_the_record(built):
    html, _ = built
    commits = set()
    for tier in ("cpu", "gpu"):
        path = REPO / "results" / f"{tier}_check.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        commits |= {n["commit"][:7] for n in (record.get("notebooks") or {}).get("notebooks", []) if n.get("commit")}
    pages = [p for p in html.rglob("*.html") if "api" not in p.parts and p.parent.name not in ("cpu_check", "gpu_check")]
    found = {c: p.name for p in pages for c in commits if re.search(rf"\b{c}", p.read_text())}
    assert not found, f"commits on the pages: {found}"
