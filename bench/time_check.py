"""How long the README's commands take on a fresh clone: `make setup`, `make check-setup`, and `make check` part by
part, with Triton's cache empty (as on a new machine); the record is ``bench/results/check_times.json``.

    python3 bench/time_check.py [--out FILE] [--keep]

It clones the repository's committed state (HEAD) into a temporary folder, moves Triton's cache aside for the run
(``TRITON_CACHE_DIR`` pointed at an empty folder), and runs each target there with the environment a learner has:
no ``TRITON_INTERPRET``, no ``PYTHONPATH`` (``COURSE_E2E_REQUIRED`` is kept as given: CI sets it). Each target's
wall time, exit code and last output lines go into the record, with the machine (cores, memory, Python, torch,
Triton, Chromium) and the date. Not a benchmark of the course's kernels: a CPU machine's clock on its own tests.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py
from common import log, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "check_times.json"
# `make check`'s parts, in its order (the Makefile's `check` target: the unit tests, then one pytest session of
# the notebooks and the browser tests, which decides itself whether the learner copies need nbval besides e2e).
PARTS = ("test", "check-runs")


def _run(cmd, cwd, env):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-6:]
    return {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t0, 1), "returncode": r.returncode,
            "tail": tail}


def _machine(clone: Path, env) -> dict:
    py = clone / ".venv" / "bin" / "python"
    versions = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)\ntry:\n import triton; "
                               "print(triton.__version__)\nexcept ImportError:\n print('-')"],
                              capture_output=True, text=True, env=env).stdout.split()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chrome = subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout.strip() if chromium else "-"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return {"cores": os.cpu_count(), "memory_gib": round(mem), "python": platform.python_version(),
            "platform": platform.platform(), "torch": versions[0] if versions else "-",
            "triton": versions[1] if len(versions) > 1 else "-", "chromium": chrome,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RECORD)
    ap.add_argument("--keep", action="store_true", help="keep the clone (its path is printed)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="course-time-check-"))
    clone = tmp / "course"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache-empty")                # Triton's cache moved aside
    steps = {}
    for target in ("setup", "check-setup"):
        steps[target] = _run(["make", target], clone, env)
        log(f"make {target}: {steps[target]['seconds']:.0f} s (exit {steps[target]['returncode']})")
    parts = PARTS
    for target in parts:
        steps[target] = _run(["make", target], clone, env)
        log(f"make {target}: {steps[target]['seconds']:.0f} s (exit {steps[target]['returncode']})")
    check = round(sum(steps[p]["seconds"] for p in parts), 1)
    record = {"meta": {**_machine(clone, env), "commit": subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip(),
                       "e2e_required": env.get("COURSE_E2E_REQUIRED") == "1",
                       "how": "a fresh clone, the README's commands, Triton's cache empty, no TRITON_INTERPRET or "
                              "PYTHONPATH"},
              "steps": steps, "make_check_seconds": check,
              "passed": all(s["returncode"] == 0 for s in steps.values())}
    write_json(str(args.out), record)
    print(f"make check: {check / 60:.1f} min in all ({'passed' if record['passed'] else 'FAILED'}); "
          f"record: {args.out}")
    if args.keep:
        print(f"the clone: {clone}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
