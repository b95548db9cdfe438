"""The kit's lessons as a static website: every lesson readable with the outputs of an executed Run All, without
running anything.

    python docs/site/build.py [--out build/site]     # `make site`; then open build/site/html/index.html

Sphinx with myst-nb renders what this script stages under `<out>/src` (nothing is executed):

- the home page from README.md, the instructor's guide from docs/INSTRUCTOR.md, and the record's freshness report
  from `python -m record.status --markdown`, run now;
- one page per lesson from its executed copy, `results/gpu_check/NN_*.ipynb` where a GPU run kept one, else
  `results/cpu_check/NN_*.ipynb`; the other machine's outputs are one click away (its executed notebook as a page of
  its own, or the HTML copy of its run). A line under the title names the machine and the date of the run, and says
  so when the lesson's code cells have changed since that run;
- the package's reference from its docstrings (autosummary over `colo_kit`; importing a module starts nothing).

Plotly charts stay interactive offline (plotly.js is served from the site itself); widgets are drawn as their last
state, since nothing runs behind them. Commit hashes are left off the pages: the record keeps them.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TIERS = ("gpu", "cpu")  # the page is built from the first tier with an executed copy
MACHINE = {"gpu": "GPU", "cpu": "CPU"}
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
STALE = "These outputs come from an earlier version of this lesson: its code has changed since this run."


def lessons(repo: Path = REPO) -> list[str]:
    """The lessons' names ("00_quickstart", ...), from notebooks/NN_*.ipynb."""
    return [p.stem for p in sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb"))]


def modules(repo: Path = REPO) -> list[str]:
    """Every module of the package and of its command line, by dotted name; `__main__` left out (importing it runs
    the CLI)."""
    names = []
    for f in sorted([*(repo / "colo_kit").rglob("*.py"), *(repo / "colo_kit_cli").rglob("*.py")]):
        parts = f.relative_to(repo).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def code_cells(nb: dict) -> list[str]:
    """What a lesson runs: its code cells' sources. The headers' markdown is left out, since `make numbers` rewrites
    the measured times in them after the run that measured them."""
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "code"]


def is_stale(executed: Path, lesson: Path) -> bool:
    """True when the executed copy ran other code cells than the lesson has now."""
    return code_cells(json.loads(executed.read_text())) != code_cells(json.loads(lesson.read_text()))


def with_current_prose(executed: Path, lesson: Path) -> dict:
    """The executed copy, with the lesson's markdown as it reads now when the copy ran the lesson's cells as they are:
    `make numbers` rewrites the measured times in the headers after the run that measured them, so the copy's own
    header would show the time before its run. A copy that ran other code keeps the prose it ran with."""
    nb, now = json.loads(executed.read_text()), json.loads(lesson.read_text())
    if [c["cell_type"] for c in nb["cells"]] == [c["cell_type"] for c in now["cells"]] and not is_stale(executed, lesson):
        for cell, current in zip(nb["cells"], now["cells"]):
            if cell["cell_type"] == "markdown":
                cell["source"] = current["source"]
    return nb


def runs(results: Path) -> dict[str, dict[str, dict]]:
    """{lesson: {tier: its whole Run All record}} from results/<tier>_check.json, each with a `machine` and `date`."""
    from colo_kit.results import measured_runs

    return measured_runs(results)


def where(rec: dict | None, tier: str) -> str:
    """A run as a reader names it: "CPU laptop (2 cores), 2026-12-06"."""
    rec = rec or {}
    return f"{rec.get('machine') or MACHINE[tier]}, {rec.get('date') or 'date not recorded'}"


def without_hashes(text: str) -> str:
    """`text` with the commits the record names left off (the pages speak of machines and dates)."""
    text = re.sub(r"\bat ([0-9a-f]{7,40}) \((\d{4}-\d\d-\d\d)\)", r"on \2", text)
    return re.sub(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}, ", "", text)


# --- widgets as their last state ---------------------------------------------------------------------------------

def _widget_html(model_id: str, state: dict, seen: set) -> str:
    """One widget (and the widgets inside it) as static HTML: its description and value as the run left them."""
    if model_id in seen or model_id not in state:
        return ""
    seen = seen | {model_id}
    model = state[model_id]
    name, s = model.get("model_name", ""), model.get("state", {})
    kids = [c.removeprefix("IPY_MODEL_") for c in s.get("children", []) if isinstance(c, str)]
    if kids:
        inner = "".join(_widget_html(k, state, seen) for k in kids)
        titles = s.get("titles") or s.get("_titles") or []
        if isinstance(titles, dict):
            titles = [titles.get(str(i), "") for i in range(len(kids))]
        if titles and any(titles):
            inner = "".join(f'<div class="w-tab"><b>{html.escape(str(t or ""))}</b>{_widget_html(k, state, seen)}</div>'
                            for t, k in zip(titles, kids))
        flow = "w-row" if name.startswith("HBox") else "w-col"
        return f'<div class="w-box {flow}">{inner}</div>'
    desc = html.escape(str(s.get("description") or ""))
    label = f'<span class="w-desc">{desc}</span> ' if desc else ""
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="w-html">{label}{s.get("value", "")}</div>'
    if name == "LabelModel":
        return f'<div class="w-html">{html.escape(str(s.get("value", "")))}</div>'
    if name == "ButtonModel":
        return f'<button class="w-button" disabled>{desc}</button>'
    if name == "OutputModel":
        return "".join(_output_html(o) for o in s.get("outputs", []))
    if name in ("FloatProgressModel", "IntProgressModel"):
        return (f'<div class="w-field">{label}<progress value="{s.get("value", 0)}" max="{s.get("max", 100)}">'
                f'{s.get("value", "")}</progress></div>')
    if "_options_labels" in s:
        idx = s.get("index")
        labels = s["_options_labels"]
        picked = [labels[i] for i in (idx if isinstance(idx, list) else [idx]) if isinstance(i, int) and i < len(labels)]
        value = ", ".join(picked)
    else:
        value = s.get("value", "")
        if isinstance(value, list):
            value = " – ".join(str(v) for v in value)
    return f'<div class="w-field">{label}<span class="w-value">{html.escape(str(value))}</span></div>'


def _output_html(output: dict) -> str:
    """An output kept inside an Output widget, as HTML."""
    if output.get("output_type") == "stream":
        return f"<pre>{html.escape(_text(output.get('text', '')))}</pre>"
    data = output.get("data", {})
    if "text/html" in data:
        return _text(data["text/html"])
    if PLOTLY in data:
        return _plotly_html(data[PLOTLY])
    return f"<pre>{html.escape(_text(data.get('text/plain', '')))}</pre>"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _plotly_html(fig: dict) -> str:
    import plotly.io as pio

    drawn = pio.to_html(dict(fig), include_plotlyjs=False, full_html=False, config={"responsive": True})
    # the theme loads its scripts (plotly.js among them) at the end of the page: draw once they have run
    return re.sub(r"(<script[^>]*>)(.*?)(</script>)",
                  lambda m: f'{m[1]}window.addEventListener("DOMContentLoaded", function () {{{m[2]}}});{m[3]}',
                  drawn, flags=re.S)


def for_the_page(nb: dict) -> dict:
    """`nb` with every widget drawn as its last state and every plotly figure as HTML that the site's own plotly.js
    draws; the widget state is dropped (nothing runs behind it, and its loader would come from a CDN)."""
    nb = copy.deepcopy(nb)
    state = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if not data:
                continue
            if WIDGET_VIEW in data:
                drawn = _widget_html(data[WIDGET_VIEW].get("model_id", ""), state, set())
                output["data"] = {"text/html": f'<div class="w-static">{drawn}</div>'} if drawn else \
                    {"text/plain": _text(data.get("text/plain", ""))}
            elif PLOTLY in data:
                output["data"] = {"text/html": _plotly_html(data[PLOTLY])}
    return nb


def with_line(nb: dict, line: str) -> dict:
    """`nb` with `line` under its title (the first cell's first line)."""
    nb = copy.deepcopy(nb)
    first = nb["cells"][0]
    src = _text(first["source"])
    title, _, rest = src.partition("\n")
    first["source"] = f"{title}\n\n{line}\n\n{rest}"
    return nb


# --- staging -----------------------------------------------------------------------------------------------------

def stage(src: Path, repo: Path = REPO, results: Path | None = None) -> dict[str, dict]:
    """Write the site's sources into `src`; return, per lesson, where its page came from: {"tier", "stale",
    "executed"} (tier None: no executed copy, a page of the bare lesson)."""
    results = results or repo / "results"
    if src.exists():
        shutil.rmtree(src)
    for sub in ("lessons", "_static", "_extra"):
        (src / sub).mkdir(parents=True)
    for f in ("conf.py", "site.css", "favicon.svg"):
        shutil.copy(HERE / f, src / ("" if f == "conf.py" else "_static") / f)
    (src / "api.rst").write_text((HERE / "api.rst").read_text() + "".join(f"   {m}\n" for m in modules(repo)))
    import plotly

    shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", src / "_static" / "plotly.min.js")
    built = time.strftime("%Y-%m-%d", time.gmtime())
    recs, pages, info = runs(results), [], {}
    for name in lessons(repo):
        lesson = repo / "notebooks" / f"{name}.ipynb"
        copies = {t: results / f"{t}_check" / f"{name}.ipynb" for t in TIERS}
        have = [t for t in TIERS if copies[t].exists()]
        tier = have[0] if have else None
        links = []
        for other in TIERS:
            if other == tier:
                continue
            rec = recs.get(name, {}).get(other)
            if copies[other].exists():  # the other machine's executed copy: a page of its own, out of the menu
                page = f"{name}.{other}"
                stale = is_stale(copies[other], lesson)
                head = (f"*{MACHINE[other]} outputs of this lesson: one Run All on {where(rec, other)}."
                        + (f" {STALE}" if stale else "") + f" The lesson's page: [{name}]({name}.ipynb).*")
                nb = with_line(for_the_page(with_current_prose(copies[other], lesson)), head)
                nb.setdefault("metadata", {})["orphan"] = True
                (src / "lessons" / f"{page}.ipynb").write_text(json.dumps(nb))
                links.append(f"[{MACHINE[other]} outputs]({page}.ipynb) ({where(rec, other)})")
            elif (html_copy := results / f"{other}_check" / f"{name}.html").exists():
                (src / "_extra" / f"{other}_check").mkdir(exist_ok=True)
                # its charts drawn by the site's own plotly.js (the copy asks a CDN for the same version)
                page_html = re.sub(r'<script[^>]*src="https://cdn\.plot\.ly/plotly-[^"]*"[^>]*>',
                                   '<script src="../_static/plotly.min.js">', html_copy.read_text())
                # nbconvert's page asks CDNs for require.js and MathJax too: offline they are console errors, and
                # the outputs need neither (plotly.js above draws the charts; the lesson's maths is on its page)
                page_html = re.sub(r'<script[^>]*src="https://cdnjs\.cloudflare\.com/[^"]*"[^>]*>\s*</script>', "",
                                   page_html)
                # the widgets' manager comes from unpkg too: without it a widget is not drawn (the lesson's own
                # pages draw each one's last state)
                page_html = re.sub(r"<script>\s*\(function\(\) \{\s*function addWidgetsRenderer\(\).*?</script>", "",
                                   page_html, count=1, flags=re.S)
                page_html = re.sub(r"(</code>)(,)? (at|commit) [0-9a-f]{7,40}(?=[,)])", r"\1", page_html)  # no commits
                # the site's icon, which the copy would ask for at the root
                page_html = page_html.replace(
                    "<head>", '<head><link rel="icon" href="../_static/favicon.svg" type="image/svg+xml">', 1)
                (src / "_extra" / f"{other}_check" / html_copy.name).write_text(page_html)
                # no executed notebook to compare: the record's digest of the lesson's source it ran says it
                src_py = repo / "notebooks" / "src" / f"{name}.py"
                older = bool(rec and rec.get("source_sha256") and src_py.exists()
                             and rec["source_sha256"] != hashlib.sha256(src_py.read_bytes()).hexdigest()[:16])
                links.append(f'<a href="../{other}_check/{html_copy.name}">{MACHINE[other]} outputs</a> '
                             f"({where(rec, other)}, its HTML copy" + (", from an earlier version of this lesson"
                                                                        if older else "") + ")")
        if tier:
            stale = is_stale(copies[tier], lesson)
            nb = for_the_page(with_current_prose(copies[tier], lesson))
            line = f"Outputs: one Run All on {where(recs.get(name, {}).get(tier), tier)}."
            line += f" {STALE}" if stale else ""
        else:
            stale, nb = False, json.loads(lesson.read_text())
            line = "Outputs: none yet; this page shows the lesson as it is stored (`make numbers` executes it)."
        line += (" Also: " + " · ".join(links) + ".") if links else ""
        (src / "lessons" / f"{name}.ipynb").write_text(json.dumps(with_line(nb, f"*{line}*")))
        pages.append(f"lessons/{name}")
        info[name] = {"tier": tier, "stale": stale, "executed": str(copies[tier]) if tier else None, "line": line}

    readme = without_hashes((repo / "README.md").read_text())
    title, _, rest = readme.partition("\n")
    toc = "\n".join(pages)
    (src / "index.md").write_text(
        f"{title}\n\n*This page is the kit's README; the numbers in its tables come from the lab record, each table "
        f"naming its machine (site built {built}).*\n{rest}\n\n"
        f"```{{toctree}}\n:caption: Lessons\n:maxdepth: 1\n\n{toc}\n```\n\n"
        "```{toctree}\n:caption: Reference\n:maxdepth: 1\n\ninstructor\napi\nstatus\n```\n")
    instructor = without_hashes((repo / "docs" / "INSTRUCTOR.md").read_text())
    title, _, rest = instructor.partition("\n")
    (src / "instructor.md").write_text(
        f"{title}\n\n*From docs/INSTRUCTOR.md; its times and peaks come from the lab record's Run All records "
        f"(site built {built}).*\n{rest}")
    status = subprocess.run([sys.executable, "-m", "record.status", "--markdown"], cwd=repo, capture_output=True,
                            text=True, timeout=120)
    report = without_hashes(status.stdout) if status.returncode == 0 else \
        f"```\n`python -m record.status --markdown` failed:\n{status.stderr[-2000:]}\n```\n"
    (src / "status.md").write_text(
        "# How fresh are the numbers\n\n"
        f"*Generated by `python -m record.status --markdown` when this site was built ({built}), from the committed "
        "results and git: for each results file a lesson or the README reads, the machine that measured it, when, and "
        "how many changes to the code it measures came after.*\n\n" + report)
    return info


def build(out: Path, repo: Path = REPO, results: Path | None = None, strict: bool = True) -> dict[str, dict]:
    """Stage into `out/src` and build the HTML into `out/html`; Sphinx's warnings are errors (`strict`) and go to
    `out/warnings.txt`. Returns `stage`'s account of the lesson pages."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sphinx.cmd.build") is not None
    except ImportError:  # a `sphinx` that is not Sphinx (a leftover folder on the path)
        found = False
    if not found:  # a Python the kit's requirements were not installed in
        raise SystemExit(f"Sphinx is not installed in {sys.executable}: `make venv` installs it "
                         "(requirements/common.txt), or `pip install sphinx`")
    info = stage(out / "src", repo, results)
    # Sphinx builds over what is there and never removes a page: a module or HTML copy the site no longer has would
    # stay published, so every build starts from an empty html/
    shutil.rmtree(out / "html", ignore_errors=True)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-w", str(out / "warnings.txt"),
           *(["-W", "--keep-going"] if strict else []), str(out / "src"), str(out / "html")]
    env = {**__import__("os").environ, "COLO_KIT_REPO": str(repo)}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"sphinx-build failed (exit {proc.returncode}); warnings in {out / 'warnings.txt'}:\n"
                         + (proc.stderr or proc.stdout)[-4000:])
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "build" / "site", help="where src/ and html/ go")
    a = ap.parse_args(argv)
    t0 = time.time()
    info = build(a.out.resolve())
    for name, i in info.items():
        print(f"[site] {name}: {i['tier'] or 'no'} outputs" + (" (from an earlier version)" if i["stale"] else ""))
    print(f"[site] built in {time.time() - t0:.0f} s -> {a.out / 'html' / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
