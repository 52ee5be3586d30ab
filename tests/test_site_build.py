"""site/build.py, the generator of the course's site, without Sphinx or a browser (those are e2e/test_site.py's):
what it reads from each notebook, what it refuses to publish, the results page's sections (each lesson's own
renderers, so a renderer that moves breaks this test, not the site), and that it writes only where it is told."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from conftest import ROOT

WIDGET = "application/vnd.jupyter.widget-view+json"


def _load_build():
    spec = importlib.util.spec_from_file_location("course_site_build", ROOT / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


def test_every_lesson_has_a_title_and_a_one_line_description():
    lessons = build.lessons(ROOT)
    assert {f"{i:02d}" for i in range(1, 13)} <= {lesson["number"] for lesson in lessons}
    for lesson in lessons:
        assert lesson["title"] and not lesson["title"][:2].isdigit(), lesson["title"]
        assert lesson["blurb"].endswith((".", "?", "!")) and "\n" not in lesson["blurb"], lesson["blurb"]
        assert 20 < len(lesson["blurb"]) < 400, lesson["blurb"]
        assert lesson["learner"] == ROOT / "notebooks" / lesson["solution"].name


def test_the_description_is_the_first_sentence_less_its_lead_in():
    cell = "# 07 · A title: with a colon\n\n**Why this lesson.** First `x.y` one. Second one.\n\nMore."
    assert build.title_and_blurb(cell) == ("A title: with a colon", "First `x.y` one.")
    with pytest.raises(ValueError, match="title"):
        build.title_and_blurb("no title here")


@pytest.mark.parametrize("output, says", [
    ({"output_type": "error", "ename": "ValueError", "evalue": "planted", "traceback": []}, "an error output"),
    ({"output_type": "stream", "name": "stderr", "text": "a warning\n"}, "stderr"),
    ({"output_type": "display_data", "metadata": {}, "data": {WIDGET: {"model_id": "m"}, "text/plain": "w"}},
     "no still PNG"),
])
def test_a_notebook_the_site_cannot_show_as_saved_is_refused(output, says):
    nb = {"cells": [{"cell_type": "code", "source": "x", "metadata": {}, "outputs": [output]}]}
    with pytest.raises(SystemExit, match=says):
        build.check_notebook(Path("planted.ipynb"), nb)


def test_the_worked_notebooks_can_be_published_as_saved():
    for lesson in build.lessons(ROOT):
        build.check_notebook(lesson["solution"], json.loads(lesson["solution"].read_text(encoding="utf-8")))


def test_every_results_section_renders_from_the_committed_records():
    sections = build.results_sections(ROOT)
    assert len(sections) >= 8
    for title, render in sections:
        text = render()
        assert text.strip() and "not measured yet" not in text, (title, text[:200])


def test_the_sources_go_where_they_are_told(tmp_path):
    src = tmp_path / "src"
    written = build.write_sources(ROOT, src)
    assert all((src / rel).is_file() for rel in written)
    stems = [p.stem for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))]
    index = (src / "index.md").read_text(encoding="utf-8")
    for stem in stems:
        assert f"(lessons/{stem}.ipynb)" in index, stem
        page = json.loads((src / "lessons" / f"{stem}.ipynb").read_text(encoding="utf-8"))
        first = "".join(page["cells"][0]["source"])
        assert f'href="../notebooks/{stem}.ipynb"' in first and "make setup && make lab" in first, stem
        assert "widgets" not in page["metadata"]
        for cell in page["cells"]:   # the set-up cell makes a notebook runnable elsewhere; the page leaves it out
            if build.SETUP_TAG in cell["metadata"].get("tags", []):
                assert "remove-cell" in cell["metadata"]["tags"], stem
        learner = src / "_extra" / "notebooks" / f"{stem}.ipynb"
        assert learner.read_bytes() == (ROOT / "notebooks" / f"{stem}.ipynb").read_bytes()
    assert "(results.md)" in index
    for page in sorted((ROOT / "site").glob("*.md")):          # the hand-written pages: copied and linked
        assert (src / page.name).read_bytes() == page.read_bytes() and f"({page.name})" in index
    results = (src / "results.md").read_text(encoding="utf-8")
    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        assert f"results/{png.name}" in results and (src / "results" / png.name).exists()
    (src / "stale.md").write_text("left by an earlier build")
    build.write_sources(ROOT, src)
    assert not (src / "stale.md").exists()


def test_the_site_extra_is_what_a_site_only_job_installs():
    names = [re.split(r"[<>=;\[ ]", r, maxsplit=1)[0] for r in build.site_requirements(ROOT)]
    assert names == ["sphinx", "myst-nb", "furo", "sphinx-mathjax-offline"], names
