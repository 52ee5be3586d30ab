"""`make check-gpu`: the whole course run natively on a CUDA GPU, and a record of what each part said.

1. The kernel and checker tests (``KERNEL_TESTS``) under pytest, natively: tuned kernels, teaching kernels,
   the Triton checkers with their planted bugs rejected and correct answers accepted.
2. Every notebook in a real Jupyter kernel (nbclient, as ``make grade`` and nbval use it), each from a
   clean copy: the worked ones (``solutions/``) must show ✅ for every exercise and no cell error; the
   learner ones (``notebooks/``) ⏳ for every exercise and no cell error. A verdict is read from the
   course's own grade log (``COURSE_GRADE_LOG``), one line per check; the record keeps each one's first line.
3. The record: date, GPU, driver, torch, triton, Python, the tests' counts per file and each notebook's
   counts, to ``bench/results/check_gpu.json`` (and ``$OUT`` when set); a short table last. Exit 1 on
   any failure.

No Jupyter server is needed, only ``ipykernel`` and ``nbclient`` (README: how to bring them as wheels to a
GPU machine that lacks them). Usage: ``python bench/check_gpu.py [--only-tests | --only-notebooks]
[--tests FILE ...] [--workers N] [NOTEBOOK ...]`` (``--tests``: a part of the kernel tests, merged into the record).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/: common.py (its docstring says why)
from common import log, write_json  # noqa: E402  (common puts the repository root on sys.path)

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "check_gpu.json"
KERNEL_TESTS = ["tests/test_triton_kernels.py", "tests/test_triton_bwd.py", "tests/test_triton_varlen.py",
                "tests/test_packed_documents.py",
                "tests/test_triton_kvcache.py", "tests/test_lesson07.py", "tests/test_lesson08_gpu.py",
                "tests/test_triton_mode.py", "tests/test_triton_block_sparse.py", "tests/test_triton_mods.py",
                "tests/test_triton_kvcache_mods.py", "tests/test_forward_backends.py",
                "tests/test_lesson11.py", "tests/test_lesson11_gluon.py", "tests/test_interface.py"]


def machine() -> dict:
    import torch
    import triton
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception as e:  # noqa: BLE001 - the record says why
        driver = f"unknown ({type(e).__name__})"
    return {"date": record_date(),
            "gpu": torch.cuda.get_device_name(0), "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "driver": driver, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}


def run_tests(workers: int, files: list[str]) -> dict:
    """pytest over ``files`` (KERNEL_TESTS unless asked); counts per file from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                               f"--junitxml={xml}", *files], cwd=ROOT, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)))
        per_file: dict = {}
        failures = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = case.get("classname", "").split(".")[-1] + ".py"
                row = per_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
                if case.find("failure") is not None or case.find("error") is not None:
                    row["failed"] += 1
                    failures.append(f"{case.get('classname')}::{case.get('name')}")
                elif case.find("skipped") is not None:
                    row["skipped"] += 1
                else:
                    row["passed"] += 1
    return {"returncode": proc.returncode, "seconds": round(time.time() - t0, 1), "files": per_file,
            "failures": failures}


def merge_tests(old: dict, new: dict, files: list[str]) -> dict:
    """A run of some test files replaces those files' rows and failures in the record and keeps the others' (one
    device call may be too short for every file: ``--tests`` runs a part). Each part's date is in ``parts``; the
    record passes only when every file of KERNEL_TESTS has a row and no test of theirs failed."""
    names = {Path(f).name for f in files}
    if not old.get("parts"):          # a whole run's rows are not merged into: the parts start the record anew
        old = {}
    per_file = {f: c for f, c in old.get("files", {}).items() if f not in names} | new["files"]
    failures = [n for n in old.get("failures", []) if n.split("::")[0].split(".")[-1] + ".py" not in names]
    failures += new["failures"]
    parts = [p for p in old.get("parts", []) if not set(p["files"]) <= names]
    parts.append({"files": sorted(names), "date": record_date(), "seconds": new["seconds"],
                  "returncode": new["returncode"]})
    missing = [Path(f).name for f in KERNEL_TESTS if Path(f).name not in per_file]
    return {"returncode": int(bool(failures) or bool(missing)),
            "seconds": round(sum(p["seconds"] for p in parts), 1), "files": per_file, "failures": failures,
            "parts": parts, "not_run": missing}


def record_date() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_notebook(path: Path) -> dict:
    """Execute a clean in-memory copy in a real kernel; the grade log gives one verdict per check."""
    import nbformat
    from nbclient import NotebookClient

    from helpers import grade
    worked = path.parent.name == "solutions"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    exercises = [name for _, name in grade.exercises_in(nb)]
    with tempfile.TemporaryDirectory(prefix="check-gpu-") as tmp:
        verdict_log = Path(tmp) / "verdicts.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_")}
        env.update(COURSE_GRADE_LOG=str(verdict_log),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        t0 = time.time()
        client = NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(path.parent)}})
        problem = None
        try:
            # nbclient passes `env` to the kernel manager: the kernel gets the grade log, not this process.
            client.execute(env=env)
        except Exception as e:  # noqa: BLE001 - a dead kernel or a timeout is a row, not a crash
            problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        said, lines = {}, {}
        if verdict_log.exists():
            for line in verdict_log.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                said[rec["exercise"]] = rec["status"]          # the last verdict for a name wins
                lines[rec["exercise"]] = (rec.get("message") or "").strip().splitlines()[:1]
    errors = [f"cell {i}: {o.get('ename')}: {str(o.get('evalue', '')).splitlines()[0] if o.get('evalue') else ''}"
              for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    counts = {s: sum(1 for name in exercises if said.get(name) == s) for s in ("pass", "fail", "todo")}
    counts["unchecked"] = sum(1 for name in exercises if name not in said)
    want = "pass" if worked else "todo"
    ok = problem is None and not errors and counts[want] == len(exercises)
    return {"notebook": f"{path.parent.name}/{path.name}", "ok": ok, "exercises": len(exercises), **counts,
            "errors": errors + ([problem] if problem else []), "seconds": round(time.time() - t0, 1),
            "verdicts": {name: (lines.get(name) or [""])[0] for name in exercises}}   # each check's first line


def save(record: dict) -> None:
    """The record, atomically, to bench/results/check_gpu.json and (when set) $OUT."""
    write_json(str(RECORD), record)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], RECORD.name), record)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebooks to run (default: every one in solutions/ and notebooks/)")
    ap.add_argument("--only-tests", action="store_true")
    ap.add_argument("--only-notebooks", action="store_true")
    ap.add_argument("--tests", nargs="+", metavar="FILE", help="run only these of KERNEL_TESTS and merge them into "
                    "the record (the other files keep their rows; the record says which part ran when)")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers, and notebooks run at once")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("make check-gpu needs a CUDA GPU (make check runs everything else without one)")
    os.environ.pop("TRITON_INTERPRET", None)          # natively: that is the point of this run
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    record["machine"] = machine()
    log("machine:", record["machine"])
    if not args.only_notebooks:
        if args.tests:
            unknown = [f for f in args.tests if f not in KERNEL_TESTS]
            if unknown:
                sys.exit(f"--tests takes files of KERNEL_TESTS; not one: {unknown}")
            record["tests"] = merge_tests(record.get("tests", {}), run_tests(args.workers, args.tests), args.tests)
        else:
            record["tests"] = run_tests(args.workers, KERNEL_TESTS)
        save(record)
    if not args.only_tests:
        paths = [Path(p).resolve() for p in args.notebooks] or \
            sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        rows = {r["notebook"]: r for r in record.get("notebooks", [])}
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            for row in pool.map(run_notebook, paths):
                rows[row["notebook"]] = row
                log(f"{row['notebook']}: {'ok' if row['ok'] else 'FAILED'} {row}")
                record["notebooks"] = sorted(rows.values(), key=lambda r: r["notebook"])
                save(record)
    ok = (record.get("tests", {}).get("returncode", 0) == 0) and all(r["ok"] for r in record.get("notebooks", []))
    record["ok"] = ok
    save(record)
    m = record["machine"]
    log(f"\ncheck-gpu on {m['gpu']} (driver {m['driver']}, torch {m['torch']}, triton {m['triton']}), {m['date']}")
    if "tests" in record:
        t = record["tests"]
        for f, c in sorted(t["files"].items()):
            log(f"  {f:32s} {c['passed']:4d} passed {c['failed']:3d} failed {c['skipped']:3d} skipped")
        for name in t["failures"][:20]:
            log(f"  FAILED {name}")
    for r in record.get("notebooks", []):
        log(f"  {r['notebook']:40s} {'ok ' if r['ok'] else 'BAD'} {r['pass']}✅ {r['fail']}❌ {r['todo']}⏳ "
            f"of {r['exercises']}  {r['seconds']:.0f}s  {'; '.join(r['errors'])[:200]}")
    log("check-gpu:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
