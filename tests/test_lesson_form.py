"""The form of every lesson, held by a test (CONTRIBUTING.md, "The notebook's arc").

Each worked notebook opens with its title and a time estimate, then the hidden set-up cell; it ends with, in this
order, its pitfalls, "Check yourself" (questions with their answers folded), "Say it in the interview" (a
60-second answer, then the follow-up questions an interviewer asks, each with a short answer) and, last and
collapsed, "Going deeper" (the measured results, read from their records). No measured figure is typed into the
prose: a figure lives once, in its record under bench/results/, and a cell shows it by reading the record.
"""
from __future__ import annotations

import re

import pytest

from conftest import ROOT, notebook

LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00_"))
TIME = re.compile(r"About (\d+) minutes")
ENDING = ("Pitfalls", "Check yourself", "Say it in the interview", "Going deeper")
ANSWER_WORDS = 180          # a 60-second answer: about 150 words spoken

# A measured figure in prose: a ratio with decimals (0.95×), a rate or a time with its unit, a date. Figures from a
# cited source (a paper, a datasheet, a library's source) are not the course's measurements: a paragraph that cites
# one may give them.
MEASURED = re.compile(r"\d\.\d+ ?[×x]\b|\d\.\d+–\d\.\d+ ?[×x]|\b\d[\d,.]* ?(TFLOP/s|TB/s|GB/s|tokens/s|µs|ms)\b"
                      r"|\b20\d\d-\d\d-\d\d\b")
CITED = re.compile(r"paper|datasheet|§|Shah et al|arXiv|NVIDIA's|vendor|spec sheet|library's source", re.I)


def _headings(nb):
    """[(cell index, level, title)] of the markdown headings, in order."""
    out = []
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            for line in c.source.splitlines():
                m = re.match(r"^(#{1,3}) (.+)$", line)
                if m:
                    out.append((i, len(m.group(1)), m.group(2).strip()))
    return out


def _section(nb, title):
    """The markdown text of the section whose level-2 heading contains ``title``, up to the next level-2 heading."""
    hs = [(i, t) for i, lvl, t in _headings(nb) if lvl == 2]
    start = next(k for k, (_, t) in enumerate(hs) if title in t)
    first = hs[start][0]
    last = hs[start + 1][0] if start + 1 < len(hs) else len(nb.cells)
    return "\n".join(c.source for c in nb.cells[first:last] if c.cell_type == "markdown")


@pytest.mark.parametrize("name", LESSONS)
def test_title_and_time_estimate(name):
    first = notebook(name).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith(f"# {name[:2]} · "), name
    assert TIME.search(first.source), f"{name}: the title cell says how long the lesson takes ('About N minutes')"


@pytest.mark.parametrize("name", LESSONS)
def test_the_lesson_ends_with_pitfalls_check_yourself_interview_and_going_deeper(name):
    titles = [t for _, lvl, t in _headings(notebook(name)) if lvl == 2]
    found = [next((k for k, t in enumerate(titles) if part in t), None) for part in ENDING]
    assert None not in found, f"{name}: sections {dict(zip(ENDING, found))} (each of {ENDING} is a ## heading)"
    assert found == sorted(found), f"{name}: {ENDING} come in this order"
    assert found[-1] == len(titles) - 1, f"{name}: 'Going deeper' is the last section"


@pytest.mark.parametrize("name", LESSONS)
def test_going_deeper_is_collapsed(name):
    nb = notebook(name)
    i = next(i for i, lvl, t in _headings(nb) if lvl == 2 and "Going deeper" in t)
    assert nb.cells[i].metadata.get("jp-MarkdownHeadingCollapsed") is True, \
        f"{name}: the 'Going deeper' heading cell carries jp-MarkdownHeadingCollapsed (JupyterLab folds it)"


@pytest.mark.parametrize("name", LESSONS)
def test_check_yourself_has_questions_with_folded_answers(name):
    text = _section(notebook(name), "Check yourself")
    assert text.count("<details>") >= 3, f"{name}: at least three questions, each answer in <details>"


@pytest.mark.parametrize("name", LESSONS)
def test_the_interview_answer_takes_a_minute_and_the_follow_ups_come_after(name):
    text = _section(notebook(name), "Say it in the interview")
    assert "Follow-ups" in text, f"{name}: the follow-up questions come under a 'Follow-ups' line"
    answer, follow = text.split("Follow-ups", 1)
    answer = re.sub(r"^#.*$", "", answer, flags=re.M)
    words = len(re.findall(r"[\w′'’.-]+", answer))
    assert 60 <= words <= ANSWER_WORDS, f"{name}: the 60-second answer has {words} words (about 150)"
    questions = re.findall(r"\?\*\*|\?\s*$", follow, flags=re.M)
    assert len(questions) >= 4, f"{name}: at least four follow-up questions, each with its short answer"


@pytest.mark.parametrize("name", LESSONS)
def test_no_measured_figure_is_typed_into_the_prose(name):
    typed = []
    for i, c in enumerate(notebook(name).cells):
        if c.cell_type != "markdown":
            continue
        for para in re.split(r"\n\s*\n", c.source):
            if CITED.search(para):
                continue
            typed += [f"cell {i}: …{para[max(0, m.start() - 40):m.end() + 10]!r}…" for m in MEASURED.finditer(para)]
    assert not typed, f"{name}: a measured figure is read from its record by a cell, not typed:\n" + "\n".join(typed)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")))
def test_the_saved_outputs_hold_no_error_and_nothing_on_stderr(name):
    """A worked notebook is committed with its outputs (the site shows them, nbval re-runs it strict): none of them is
    an error, and nothing a learner would see went to stderr (a warning, a traceback)."""
    bad = [(i, o.get("ename") or o.get("text", "")[:120]) for i, c in enumerate(notebook(name).cells)
           if c.cell_type == "code" for o in c.get("outputs", [])
           if o.get("output_type") == "error" or (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    assert not bad, f"{name}: saved outputs with an error or stderr: {bad}"
