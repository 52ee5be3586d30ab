"""The README is one screen a learner reads first: at most 150 lines, every lesson listed, only commands that
exist, links that resolve, and no measured figure (a figure lives in its record; the site's results page and the
lessons show it)."""
from __future__ import annotations

import re

from conftest import ROOT
from test_lesson_form import CITED, MEASURED

README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_one_screen():
    assert len(README.splitlines()) <= 150


def test_no_measured_figure():
    typed = [m.group(0) for para in re.split(r"\n\s*\n", README) if not CITED.search(para)
             for m in MEASURED.finditer(para)]
    assert not typed, f"the README types measured figures: {typed}"


def test_every_lesson_is_listed():
    for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        assert re.search(rf"^\| {p.name[:2]} \|", README, re.M), f"the README's table has no row for {p.name}"


def test_every_make_target_it_names_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z_-]+):", makefile, re.M))
    named = set(re.findall(r"\bmake ([a-z][a-z-]+)", README))
    assert named and named <= targets, f"not Makefile targets: {named - targets}"


def test_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"the README links {target}, which is not in the course"


def test_the_clone_url_is_the_courses():
    from helpers import generate
    assert f"git clone {generate.COURSE_URL}" in README
