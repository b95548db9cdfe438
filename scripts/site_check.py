"""The built site in headless Chromium: the home page, every lesson page and the search page load with no console
error, a plotly chart answers a hover with a value, and a search finds a lesson; a screenshot of each page.

    make site && /tmp/selenv/bin/python scripts/site_check.py [--html build/site/html] [--shots build/site/shots]

Needs selenium and Debian's `chromium` + `chromium-driver`; runs offline (the site carries plotly.js itself). The site
is served over http.server from a thread, as a reader's `python -m http.server` would serve it. Exit 0 when every
check passed; each failure is named in one line.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = "/usr/bin/chromium"
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def hover_value(driver) -> str | None:
    """Hover the middle of the first plotly chart's plot area, then along it; the hover label's text, or None."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    plots = driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
    if not plots:
        return None
    drag = plots[0].find_element(By.CSS_SELECTOR, ".nsewdrag")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", drag)
    time.sleep(1)  # the theme scrolls smoothly
    w, h = drag.size["width"], drag.size["height"]
    for fx in (0.5, 0.25, 0.75, 0.1, 0.9, 0.6, 0.4):
        for fy in (0.5, 0.3, 0.7):
            ActionChains(driver).move_to_element_with_offset(drag, int(w * (fx - 0.5)), int(h * (fy - 0.5))).perform()
            time.sleep(0.3)
            text = " ".join(t.text for t in plots[0].find_elements(By.CSS_SELECTOR, ".hoverlayer text") if t.text)
            if text.strip():
                return text.strip()
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=Path, default=REPO / "build" / "site" / "html")
    ap.add_argument("--shots", type=Path, default=REPO / "build" / "site" / "shots")
    a = ap.parse_args(argv)
    if not (a.html / "index.html").exists():
        ap.error(f"--html {a.html}: no index.html there; run `make site` first")
    from selenium.webdriver.common.by import By

    a.shots.mkdir(parents=True, exist_ok=True)
    server, base = serve(a.html)
    driver = browser()
    failures, hovered = [], None
    pages = ["index.html", *sorted(f"lessons/{p.name}" for p in (a.html / "lessons").glob("[0-9][0-9]_*.html")),
             # a machine's outputs kept only as nbconvert's HTML copy, served as it is beside the lessons
             *sorted(str(p.relative_to(a.html)) for p in a.html.glob("*_check/[0-9][0-9]_*.html")),
             "search.html?q=colocate"]
    try:
        for page in pages:
            driver.get(f"{base}/{page}")
            time.sleep(1.5 if "search" in page else 0.8)
            errors = console_errors(driver)
            title = driver.title
            charts = driver.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
            note = f"{len(charts)} charts"
            panels = driver.find_elements(By.CSS_SELECTOR, ".w-static")
            if panels and not (a.shots / "widgets.png").exists():  # a control panel, drawn as its last state
                driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", panels[0])
                time.sleep(1)  # the theme scrolls smoothly
                driver.save_screenshot(str(a.shots / "widgets.png"))
            note += f", {len(panels)} widget panels"
            if charts and hovered is None:
                hovered = hover_value(driver)
                note += f", hover: {hovered!r}"
                driver.save_screenshot(str(a.shots / "hover.png"))  # the chart with its hover label
            if "search" in page:
                time.sleep(2)
                found = driver.find_elements(By.CSS_SELECTOR, "#search-results li, ul.search li")
                note = f"{len(found)} results for 'colocate'"
                if not found:
                    failures.append(f"{page}: the search found nothing")
            driver.execute_script("window.scrollTo(0, 0);")
            time.sleep(1)
            shot = a.shots / (page.replace("/", "_").split("?")[0].removesuffix(".html") + ".png")
            driver.save_screenshot(str(shot))
            print(f"[site-check] {page}: {title!r}, {note}, {len(errors)} console errors -> {shot}")
            failures += [f"{page}: console error: {e[:300]}" for e in errors]
        if hovered is None:
            failures.append("no plotly chart answered a hover with a value")
    finally:
        driver.quit()
        server.shutdown()
    for f in failures:
        print(f"[site-check] FAIL {f}")
    print(f"[site-check] {'all checks passed' if not failures else f'{len(failures)} failures'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
