"""Sphinx settings for the kit's website; docs/site/build.py stages this file with the pages it generates."""

import os
import sys
from pathlib import Path

REPO = Path(os.environ.get("COLO_KIT_REPO", Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(REPO))

project = "colo_kit"
author = "colo_kit"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.autosummary"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
# the pages are rendered from notebooks executed by `make numbers`: nothing runs here
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # the README and the lessons start sections below the page title's level

autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "none"
autodoc_member_order = "bysource"

html_theme = "furo"
html_title = "colo_kit"
html_static_path = ["_static"]
html_extra_path = ["_extra"]
html_css_files = ["site.css"]
html_js_files = ["plotly.min.js"]  # the charts work offline: plotly.js comes from the site, not a CDN
html_show_sourcelink = False
html_copy_source = False

# docstrings are written as plain text with `code` in single backticks (as in markdown): read those as code, and give
# a list or an indented block the blank line RST wants around it
default_role = "code"


def _blank_lines_for_rst(app, what, name, obj, options, lines):
    out = []
    for line in lines:
        prev = out[-1] if out else ""
        indent = len(line) - len(line.lstrip())
        prev_indent = len(prev) - len(prev.lstrip())
        listish = prev.lstrip().startswith(("- ", "* ")) or (prev_indent and any(
            p.lstrip().startswith(("- ", "* ")) for p in out[-6:]))
        item = line.lstrip().startswith(("- ", "* "))
        if line.strip() and prev.strip() and ((item and not listish and indent == prev_indent)
                                              or (indent > prev_indent and not listish)
                                              or (indent < prev_indent and not item)):
            out.append("")
        out.append(line)
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _blank_lines_for_rst)
html_favicon = "_static/favicon.svg"
