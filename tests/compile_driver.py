"""The compiling side of tests/compile_kernels.py: one job compiled for one target (``compile_job``), and the driver
(``drive``) whose worker processes (``serve``) share every target's jobs. tests/compile_kernels.py lists the jobs and
says why each exists; tests/test_compile_targets.py starts the driver and reads what it writes."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback


def _cpu():  # this process's CPU time and its finished children's (ptxas)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def compile_job(cc, job):
    """Compile one job for sm_cc: a result dict (kernel, config, cc, ok, shared or error, seconds, cpu_seconds, and
    the job's meta); never raises for a kernel's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    t0, c0 = time.perf_counter(), _cpu()
    res = dict(kernel=job.kernel, config=job.config, cc=cc, **job.meta)
    try:
        fn, sig, const, attrs, cfg = job.build()
        opts = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cc, 32), options=opts)
        res.update(shared=k.metadata.shared, ok=True)
    except Exception as e:  # noqa: BLE001 - reported to the test, which names kernel, config and target
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        res.update(ok=False, error=f"{type(e).__name__}: {msg[-3000:]}")
    res.update(seconds=round(time.perf_counter() - t0, 2), cpu_seconds=round(_cpu() - c0, 2))
    return res


# The driver and its workers. Each worker imports torch, Triton and the notebooks once and lists every target's
# jobs; the driver hands out the jobs one at a time, slowest target first (sm_75: no tensor cores, each forward
# ~15 CPU-s), so both workers stay busy to the end and no target waits on a tail. Their lines start with RESULT
# (ptxas's errors print to stdout too).
RESULT = "@@compile_kernels@@ "
ORDER = (75, 90, 80, 86, 89)  # the order the targets' jobs are handed out (and their results complete)


def serve(plan):
    """A worker: lists the jobs of ``plan`` ({cc: [kernel, ...]}) and prints them ({cc: [[kernel, config], ...]}),
    then compiles the job each stdin line names ("cc index"), printing its result."""
    from tests.compile_kernels import jobs_for
    jobs = {cc: jobs_for(cc, kernels) for cc, kernels in plan.items()}
    print(RESULT + json.dumps({str(cc): [[j.kernel, j.config] for j in js] for cc, js in jobs.items()}), flush=True)
    for line in sys.stdin:
        cc, i = map(int, line.split())
        print(RESULT + json.dumps(dict(compile_job(cc, jobs[cc][i]), index=i)), flush=True)


def drive(out_dir, plan, parallel):
    """Compile ``plan`` ({cc: [kernel, ...]}) in ``parallel`` workers that share every target's jobs. Each target's
    results land in out_dir/compile_sm<cc>.jsonl (in its jobs' order) when its last job is done, or a worker's error
    output in compile_sm<cc>.failed (a worker that dies in a job is replaced; that job is reported failed)."""
    import subprocess
    import threading

    lock = threading.Lock()
    state = dict(todo=None, counts=None)
    results = {cc: {} for cc in plan}

    def finish(cc):
        out = os.path.join(out_dir, f"compile_sm{cc}")
        with open(out + ".tmp", "w") as f:
            f.writelines(json.dumps(results[cc][i]) + "\n" for i in range(state["counts"][cc]))
        os.replace(out + ".tmp", out + ".jsonl")

    def fail_all(why):
        for cc in plan:
            if state["counts"] is None or len(results[cc]) < state["counts"][cc]:
                out = os.path.join(out_dir, f"compile_sm{cc}")
                with open(out + ".tmp", "w") as f:
                    f.write(why)
                os.replace(out + ".tmp", out + ".failed")

    def record(cc, i, res):
        with lock:
            results[cc][i] = res
            if len(results[cc]) == state["counts"][cc]:
                finish(cc)

    def read_result(proc):
        for line in proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        return None

    def worker(n):
        log = os.path.join(out_dir, f"compile_worker{n}.log")
        for _ in range(3):  # a worker that dies in a job is replaced (twice)
            with open(log, "w") as err:
                proc = subprocess.Popen([sys.executable, "-m", "tests.compile_kernels", "--serve", json.dumps(plan)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            listed = read_result(proc)
            if listed is None:  # it could not list the jobs (an import error): nothing will compile
                proc.wait()
                with lock:
                    fail_all(f"exit {proc.returncode}\n{open(log).read()[-4000:]}")
                return
            listed = {int(cc): js for cc, js in listed.items()}
            counts = {cc: len(js) for cc, js in listed.items()}
            with lock:
                if state["counts"] is None:
                    state["counts"] = counts
                    state["todo"] = [(cc, i) for cc in sorted(plan, key=lambda c: ORDER.index(c))
                                     for i in range(counts[cc])]
                    for cc in plan:
                        if counts[cc] == 0:
                            finish(cc)
            while True:
                with lock:
                    if not state["todo"]:
                        proc.stdin.close()
                        proc.wait()
                        return
                    cc, i = state["todo"].pop(0)
                proc.stdin.write(f"{cc} {i}\n")
                proc.stdin.flush()
                res = read_result(proc)
                if res is None:  # the worker died in this job
                    proc.wait()
                    kernel, config = listed[cc][i]
                    record(cc, i, dict(kernel=kernel, config=config, cc=cc, ok=False, seconds=0, cpu_seconds=0,
                                       error=f"the compiling process died (exit {proc.returncode}):\n"
                                             f"{open(log).read()[-3000:]}"))
                    break
                record(cc, i, {k: v for k, v in res.items() if k != "index"})
        with lock:
            fail_all(f"the compiling processes kept dying: {open(log).read()[-4000:]}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
