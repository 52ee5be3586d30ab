"""The course's static site (`make site`) in headless Chromium, opened from disk and from a static server.

- The site is built once per session into ``build/site/`` by ``site/build.py`` (Sphinx's rebuild is incremental:
  a few seconds when nothing changed), or taken as it is from ``$COURSE_SITE`` (a folder built before).
- Every page (home, results, search, index, each ``site/*.md`` page, each notebook's), over ``file://`` and over
  ``http://127.0.0.1:<port>/`` (Python's ``http.server`` in a thread): no console error, no uncaught exception, no
  failed request, no request off this machine (each is aborted and reported), every ``<img>`` loaded
  (``naturalWidth > 0``), every formula typeset by MathJax, no error output, no traceback, no empty widget. A
  notebook's page shows as many pictures and ✅ / ❌ / ⏳ as its worked notebook saved (a worked lesson has no ❌ or
  ⏳; the start notebook's legend may), and its header links the learner notebook, which is there. The home page
  links every lesson, the start notebook, each ``site/*.md`` page and the results page; the search finds a lesson
  from disk.
- A static scan of the built HTML, CSS and JS: nothing loaded from http(s) (plain ``<a href>`` links out are fine).
- A planted page proves the page check fails on each kind of problem it looks for.
- Screenshots of the home page, a lesson page and the results page go to ``artifacts/site/``.
The browser is conftest's ``browser`` (the system Chromium; skipped with the reason when there is none, failed
when ``COURSE_E2E_REQUIRED=1``).
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading

try:
    import fcntl
except ImportError:          # Windows: no lock (run the browser tests on one worker there)
    fcntl = None
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from conftest import ROOT, _unavailable

SITE_ARTIFACTS = ROOT / "artifacts" / "site"
LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))   # 00_start_here among them
GUIDES = sorted(p.stem for p in (ROOT / "site").glob("*.md"))                     # site/install.md, ...
PAGES = (["index.html", "results.html", "search.html", "genindex.html"] + [f"{g}.html" for g in GUIDES]
         + [f"lessons/{s}.html" for s in LESSONS])
SCREENSHOT_LESSON = "02_flash_attention_v1"   # math, plots and a widget's still frame
VIEWPORT = {"width": 1280, "height": 900}
# What a lesson page must never show: MyST-NB's classes for error and stderr outputs, docutils' messages for
# what it could not render, a widget's view (only its still PNG may show), a traceback in any output.
BAD_SELECTORS = {
    "an error output": ".output.traceback, .cell_output .traceback",
    "a stderr output": ".output.stderr",
    "a rendering error": ".system-message, .problematic",
    "a widget view": ".jupyter-widgets, script[type='application/vnd.jupyter.widget-view+json']",
    "a MathJax error": "mjx-merror",
}
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|\w+Error: .*\n.*File \"")
# A CDN or font host a page might load from; in a JS file any such address must be listed here, with the reason
# it is never fetched.
CDN_HOSTS = re.compile(r"https?://(cdn\.|cdnjs\.|unpkg\.com|fonts\.googleapis|fonts\.gstatic|ajax\.googleapis"
                       r"|code\.jquery|stackpath\.|maxcdn\.|use\.fontawesome|polyfill\.io)[^\s\"'`)]*")
JS_CDN_ALLOWED = {
    # MathJax 3's speech-rule engine and its XPath polyfill: loaded only by the accessibility explorer of
    # MathJax's context menu, which site/conf.py turns off (options.enableMenu = False).
    "_static/mathjax/tex-chtml.js": ("https://cdn.jsdelivr.net/npm/speech-rule-engine@",
                                     "https://cdn.jsdelivr.net/npm/sre-mathmaps-ie@",
                                     "https://cdn.jsdelivr.net/npm/wicked-good-xpath@"),
}


# ------------------------------------------------------------------ the built site
@pytest.fixture(scope="session")
def site() -> Path:
    """The built site: ``$COURSE_SITE`` as it is, else ``build/site/`` built (or brought up to date) now, once per
    test run: under pytest-xdist the first worker builds, holding a lock, and the others find it done."""
    given = os.environ.get("COURSE_SITE")
    if given:
        folder = Path(given).resolve()
        if not (folder / "index.html").exists():
            pytest.fail(f"COURSE_SITE={given}: no index.html there", pytrace=False)
        return folder
    try:
        import myst_nb  # noqa: F401
    except ImportError:
        _unavailable("the site's tools are not installed (pip install -e '.[site]'; `make setup` does)")
    folder = ROOT / "build" / "site"
    folder.parent.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    with open(ROOT / "build" / ".site-test.lock", "a+") as lock:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        if run_id and lock.read().strip() == run_id and (folder / "index.html").exists():
            return folder                      # another worker of this run built it
        run = subprocess.run([sys.executable, str(ROOT / "site" / "build.py"), "--repo", str(ROOT),
                              "--out", str(folder)], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            pytest.fail(f"site/build.py failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}", pytrace=False)
        lock.seek(0)
        lock.truncate()
        lock.write(run_id)
    return folder


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def server(site):
    """The built site served by Python's http.server on a free loopback port, in a thread."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="session")
def site_artifacts():
    SITE_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return SITE_ARTIFACTS


def base_url(scheme: str, site: Path, server: str | None) -> str:
    return site.as_uri() + "/" if scheme == "file" else server


# ------------------------------------------------------------------ one page in the browser
def _local(url: str, base: str) -> bool:
    return url.startswith(base) or url.startswith(("data:", "blob:", "about:"))


def open_page(context, url: str, base: str):
    """Open url in a new page of context; returns (page, problems): every console error, uncaught exception,
    failed or refused request, HTTP error and request that would leave the site (aborted)."""
    page = context.new_page()
    problems: list[str] = []
    refused: set[str] = set()
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))
    page.on("requestfailed", lambda r: None if r.url in refused else
            problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

    def route(r):
        if _local(r.request.url, base):
            r.continue_()
        else:
            refused.add(r.request.url)
            problems.append(f"off-site request: {r.request.url}")
            r.abort()
    page.route("**/*", route)
    page.goto(url, wait_until="load")
    # MathJax typesets after load, the fonts come after; images below the fold are asked for now
    page.evaluate("""async () => {
        if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
        await document.fonts.ready;
        await Promise.all([...document.images].map(img => { img.loading = 'eager';
            return img.complete ? null : new Promise(done => { img.onload = img.onerror = done; }); }));
    }""")
    return page, problems


def page_problems(page) -> list[str]:
    """What is wrong with the page as shown: images not loaded, formulas not typeset, error outputs, tracebacks."""
    problems = []
    for src in page.evaluate("[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"):
        problems.append(f"image not shown: {src}")
    untypeset = page.evaluate("[...document.querySelectorAll('.math')].filter(e => !e.querySelector('mjx-container'))"
                              ".map(e => e.textContent.slice(0, 60))")
    problems += [f"formula not typeset: {t!r}" for t in untypeset]
    for what, selector in BAD_SELECTORS.items():
        n = page.locator(selector).count()
        if n:
            problems.append(f"{n} x {what} ({selector})")
    text = page.inner_text("body")
    if TRACEBACK.search(text):
        problems.append("a traceback in the page: " + TRACEBACK.search(text).group(0)[:80])
    return problems


def saved_pictures(stem: str) -> int:
    """How many pictures the worked notebook saved (each image/png output, a widget's still frame included)."""
    nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


def widget_frame_index(stem: str) -> int | None:
    """Which of the notebook's pictures is its first widget's still frame (None: it has no widget)."""
    nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    pictures = [o["data"] for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    return next((i for i, d in enumerate(pictures) if "application/vnd.jupyter.widget-view+json" in d), None)


VERDICTS = ("✅", "❌", "⏳")


def saved_verdicts(stem: str) -> dict:
    """How many of each verdict the worked notebook's saved outputs show."""
    nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for c in nb["cells"] for o in c.get("outputs", []))
    return {v: text.count(v) for v in VERDICTS}


@pytest.fixture(scope="session")
def context(browser):
    ctx = browser.new_context(viewport=VIEWPORT, accept_downloads=False)
    yield ctx
    ctx.close()


# Every page opened from disk (file://); over a static server (http://) the pages of each kind, which share their
# template and static files: the home page, the results, the search page and one lesson.
HTTP_PAGES = ("index.html", "results.html", "search.html", f"lessons/{SCREENSHOT_LESSON}.html")


@pytest.mark.parametrize("scheme, path", [("file", p) for p in PAGES] + [("http", p) for p in PAGES if p in HTTP_PAGES])
def test_page_loads_clean(context, site, server, site_artifacts, scheme, path):
    base = base_url(scheme, site, server)
    page, problems = open_page(context, base + path, base)
    try:
        problems += page_problems(page)
        if path.startswith("lessons/"):
            stem = Path(path).stem
            shown, saved = page.locator("div.cell_output img").count(), saved_pictures(stem)
            if shown != saved:
                problems.append(f"{shown} pictures in the page, {saved} saved in solutions/{stem}.ipynb")
            outputs = "\n".join(page.eval_on_selector_all("div.cell_output", "els => els.map(e => e.innerText)"))
            shown, saved = {v: outputs.count(v) for v in VERDICTS}, saved_verdicts(stem)
            if shown != saved:
                problems.append(f"verdicts in the page {shown}, saved in the notebook {saved}")
            if not stem.startswith("00") and (saved["❌"] or saved["⏳"]):   # the start notebook's legend may
                problems.append(f"a worked lesson with {saved['❌']} ❌ and {saved['⏳']} ⏳ in its outputs")
            link = page.locator("a.course-download")
            if link.count() != 1:
                problems.append(f"{link.count()} learner-notebook links in the header, not 1")
            else:
                target = urljoin(page.url, link.get_attribute("href"))
                learner = json.loads(Path(urlparse(target).path).read_text() if scheme == "file" else
                                     context.request.get(target).text())
                if any(c.get("outputs") for c in learner["cells"]) or Path(target).name != f"{stem}.ipynb":
                    problems.append(f"the header's link is not the learner notebook {stem}.ipynb: {target}")
        if scheme == "file" and path == "index.html":   # the whole page in one window (the sidebar is sticky)
            height = min(page.evaluate("document.documentElement.scrollHeight"), 3000)
            page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
            page.screenshot(path=str(site_artifacts / "home.png"))
        if scheme == "file" and path == "results.html":
            page.screenshot(path=str(site_artifacts / "results.png"))
        if scheme == "file" and path == f"lessons/{SCREENSHOT_LESSON}.html":
            # the title and the header block; a formula; the widget's still frame
            page.screenshot(path=str(site_artifacts / f"lesson-{SCREENSHOT_LESSON}.png"))
            page.locator("div.math").first.scroll_into_view_if_needed()
            page.screenshot(path=str(site_artifacts / f"lesson-{SCREENSHOT_LESSON}-math.png"))
            frame = widget_frame_index(SCREENSHOT_LESSON)
            if frame is not None:
                page.locator("div.cell_output img").nth(frame).scroll_into_view_if_needed()
                page.screenshot(path=str(site_artifacts / f"lesson-{SCREENSHOT_LESSON}-widget.png"))
    finally:
        page.close()
    assert not problems, f"{scheme}: {path}:\n  " + "\n  ".join(problems)


def test_home_links_every_lesson_and_the_results(context, site):
    base = base_url("file", site, None)
    page, problems = open_page(context, base + "index.html", base)
    try:
        links = page.eval_on_selector_all("article a[href]", "els => els.map(e => e.getAttribute('href'))")
        hrefs = {urljoin(page.url, h).split("#")[0] for h in links}
    finally:
        page.close()
    wanted = {base + p for p in PAGES if p not in ("index.html", "search.html", "genindex.html")}
    numbers = {s[:2] for s in LESSONS}
    assert {f"{i:02d}" for i in range(1, 13)} <= numbers, f"solutions/ has lessons {sorted(numbers)}"
    assert not wanted - hrefs, f"the home page's text does not link: {sorted(wanted - hrefs)}"
    for p in wanted:
        assert Path(urlparse(p).path).exists(), f"the home page links {p}, which was not built"
    assert not problems, "\n".join(problems)


def test_search_works_from_disk(context, site):
    """Sphinx's search runs in the page (searchindex.js), so it works opened from disk too."""
    base = base_url("file", site, None)
    page, problems = open_page(context, base + "search.html?q=online+softmax", base)
    try:
        page.wait_for_selector("ul.search li a", timeout=15_000)
        found = page.eval_on_selector_all("ul.search li a", "els => els.map(e => e.getAttribute('href'))")
    finally:
        page.close()
    assert any("01_online_softmax" in h for h in found), found
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ nothing from the network
LOADING_TAGS = re.compile(r"<(script|link|img|iframe|source|video|audio|embed|object|input)\b[^>]*>", re.I | re.S)
LOADING_ATTRS = re.compile(r"\b(src|href|srcset|data|poster)\s*=\s*[\"']?\s*(https?:)?//", re.I)
NAVIGATION_REL = re.compile(r"rel=[\"']?(next|prev|index|search|canonical)")   # <link>s that load nothing
CSS_REMOTE = re.compile(r"(url\(\s*[\"']?\s*(https?:)?//|@import\s+[\"']?\s*(url\()?\s*[\"']?(https?:)?//)", re.I)


def remote_loads(folder: Path) -> list[str]:
    """Every http(s) (or protocol-relative) address the built site would load: in the src/href of a tag that loads
    (not <a>), in CSS url() and @import, inline <style>, and CDN addresses in JS not listed in JS_CDN_ALLOWED."""
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.suffix == ".html":
            html = path.read_text(encoding="utf-8", errors="replace")
            for tag in LOADING_TAGS.finditer(html):
                if tag.group(1).lower() == "link" and NAVIGATION_REL.search(tag.group(0)):
                    continue   # navigation links, not loads (and they are relative anyway)
                if LOADING_ATTRS.search(tag.group(0)):
                    found.append(f"{rel}: {tag.group(0)[:160]}")
            for style in re.findall(r"<style\b.*?</style>", html, re.S | re.I):
                found += [f"{rel}: <style> {m.group(0)}" for m in CSS_REMOTE.finditer(style)]
        elif path.suffix == ".css":
            found += [f"{rel}: {m.group(0)}" for m in CSS_REMOTE.finditer(path.read_text(errors="replace"))]
        elif path.suffix in (".js", ".mjs"):
            allowed = JS_CDN_ALLOWED.get(rel, ())
            found += [f"{rel}: {m.group(0)}" for m in CDN_HOSTS.finditer(path.read_text(errors="replace"))
                      if not m.group(0).startswith(allowed)]
    return found


def test_nothing_is_loaded_from_the_network(site):
    found = remote_loads(site)
    assert not found, "the site would load these from the network:\n  " + "\n  ".join(found[:30])


def test_the_network_scan_catches_a_planted_load(tmp_path):
    (tmp_path / "a.html").write_text('<a href="https://example.org/">a link out is fine</a>\n'
                                     '<script src="https://cdn.jsdelivr.net/npm/x.js"></script>\n'
                                     '<link rel="stylesheet" href="//fonts.googleapis.com/css?family=Roboto">\n')
    (tmp_path / "b.css").write_text("@font-face { src: url('https://fonts.gstatic.com/x.woff2'); }\n")
    (tmp_path / "c.js").write_text("load('https://unpkg.com/y@1/dist/y.js');\n")
    found = remote_loads(tmp_path)
    assert len(found) == 4, found
    assert not any("example.org" in f for f in found), found


# ------------------------------------------------------------------ the check itself can fail
PLANTED = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>planted</title></head><body>
<p>a planted page</p>
<img src="missing.png" alt="a picture that is not there">
<div class="cell_output"><div class="output traceback highlight-ipythontb"><pre>Traceback (most recent call last):
  File "x.py", line 1, in &lt;module&gt;
ValueError: planted</pre></div></div>
<script>console.error("planted console error");</script>
<script>throw new Error("planted exception");</script>
<script src="https://cdn.jsdelivr.net/npm/planted@1/x.js"></script>
</body></html>
"""


def test_the_page_check_catches_planted_problems(context, tmp_path):
    (tmp_path / "planted.html").write_text(PLANTED)
    (tmp_path / "clean.html").write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>c</title></head>"
                                         "<body><p>nothing wrong here</p></body></html>")
    base = tmp_path.as_uri() + "/"
    page, problems = open_page(context, base + "planted.html", base)
    problems += page_problems(page)
    page.close()
    report = "\n".join(problems)
    for expected in ("console error: planted console error", "uncaught exception: planted exception",
                     "missing.png", "off-site request: https://cdn.jsdelivr.net/npm/planted@1/x.js",
                     "image not shown", "an error output", "a traceback in the page"):
        assert expected in report, f"the check missed {expected!r}; it reported:\n{report}"
    page, problems = open_page(context, base + "clean.html", base)
    problems += page_problems(page)
    page.close()
    assert problems == [], problems
