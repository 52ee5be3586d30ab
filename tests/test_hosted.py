"""A notebook opened on its own, as on a hosted notebook service: its first cell fetches the course and installs it.

On Colab or Kaggle a learner opens one notebook; the service's Python has torch, Jupyter and the usual packages,
not the course. The test builds that situation: a fresh virtual environment whose packages are this one's (the
hosted service's torch, numpy, matplotlib, ipykernel) but not the course, the learner copy of lesson 01 alone in an
empty folder, and the course's repository at a local clone's URL (``COURSE_URL``). It runs the notebook in that
environment's own kernel and checks that the set-up cell fetched and installed the course and that the lesson then
ran with its exercises ⏳.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

from conftest import ROOT

RUN = """
import json, sys, nbformat
from nbclient import NotebookClient
path = sys.argv[1]
nb = nbformat.read(path, as_version=4)
nb.cells.append(nbformat.v4.new_code_cell("import helpers, sys; print('HELPERS', helpers.__file__); print('PY', sys.executable)"))
NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
               resources={"metadata": {"path": sys.argv[2]}}).execute()
out = []
for c in nb.cells:
    for o in c.get("outputs", []):
        out.append({"type": o.get("output_type"), "text": o.get("text", ""), "ename": o.get("ename", ""),
                    "evalue": o.get("evalue", "")})
print(json.dumps(out))
"""


def test_a_notebook_alone_fetches_the_course_and_installs_it(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of the course (its committed files are what a learner fetches)")
    remote = tmp_path / "published"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(remote)], check=True)
    fresh = tmp_path / "hosted-python"
    venv.EnvBuilder(with_pip=False).create(fresh)     # its pip too is the service's, through the path below
    py = fresh / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The hosted service's own packages (pip among them): this environment's, seen through a path (not the course:
    # its editable install is a finder that a plain path entry does not run).
    with open(os.path.join(purelib, "hosted_service_packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    alone = tmp_path / "a-notebook-on-its-own"
    alone.mkdir()
    nb = alone / "01_online_softmax.ipynb"
    shutil.copy(ROOT / "notebooks" / nb.name, nb)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTHONPATH", "JPY_"))}
    env.update(COURSE_URL=f"file://{remote}", PIP_DISABLE_PIP_VERSION_CHECK="1", MPLBACKEND="Agg")
    probe = subprocess.run([str(py), "-c", "import helpers"], capture_output=True, text=True, env=env, cwd=alone)
    assert probe.returncode != 0, "the course must not be importable in the hosted Python before its first cell"
    r = subprocess.run([str(py), "-c", RUN, str(nb), str(alone)], capture_output=True, text=True, env=env, cwd=alone,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    outputs = json.loads(r.stdout.strip().splitlines()[-1])
    errors = [o for o in outputs if o["type"] == "error"]
    assert not errors, errors
    text = "".join(o["text"] for o in outputs)
    assert f"fetching the course from file://{remote}" in text and "installing the course" in text
    fetched = alone / "flash-attention-course"
    assert f"HELPERS {fetched / 'helpers' / '__init__.py'}" in text, text[-2000:]
    assert f"PY {py}" in text                                 # the notebook ran in the hosted Python's kernel
    assert text.count("not attempted yet") == 4               # lesson 01 ran on: its four exercises are ⏳
    after = subprocess.run([str(py), "-c", "import helpers; print(helpers.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path)
    assert after.stdout.strip() == str(fetched / "helpers" / "__init__.py"), after.stderr   # installed into it
    assert sys.prefix != str(fresh)
