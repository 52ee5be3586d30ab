"""The grading framework behind ``helpers.check``.

A checker is a function ``grade(g)`` decorated with ``@exercise("name")``. It draws
cases, calls the learner's function through ``g.call`` (which hands over copies and
catches the usual mistakes), and compares with a float64 reference through
``g.compare`` (which reports the worst mismatch and names the likely bug). What the
learner sees is one line:

    ✅ merge_ml passed: 48 cases match torch.logsumexp, max rel err 3e-07
    ⏳ merge_ml not attempted yet
    ❌ merge_ml wrong: `l` at index (0,): got nan, ... (a CheckFailure, an AssertionError)

A ❌ names the case and the likely bug; where a checker knows the exact fix (``Bug(..., fix=...)``,
``g.compare(..., fix=...)``), the verdict offers it (``check.hint("merge_ml")``) and shows it only when the same
mistake comes back.

``COURSE_STRICT=1`` turns "not attempted" into a failure (``make check`` runs the
worked solutions that way). With ``COURSE_GRADE_LOG`` set, each verdict is also
appended to that file as a JSON line (``make grade`` reads it).

What a ❌ does depends on where the check runs:

- in a notebook (an IPython kernel) without ``COURSE_STRICT=1``: the verdict is printed
  and the notebook goes on, so "Run All" reaches the end of a learner's notebook;
- everywhere else (scripts, pytest) and in strict mode: a ``CheckFailure`` (an
  ``AssertionError``) is raised; in IPython it is shown as its message alone, without a
  traceback through this package.

Cells after an exercise call ``yours_or_reference(fn, reference)``: the learner's function
once its check passed in this session (the same function object), else the course's
reference; it prints which.

Each call of the learner's function made by a checker has a time limit
(``COURSE_CASE_TIMEOUT`` seconds, default 60; ``0`` turns it off): a function still running
then gets ❌ for that case instead of a notebook that hangs. On the main thread of Linux and
macOS a ``SIGALRM`` timer raises ``CaseTimeout``, which also interrupts a blocking C call
(``time.sleep``, a read); elsewhere (Windows, other threads) a timer thread raises it with
CPython's ``PyThreadState_SetAsyncExc`` at the next Python bytecode. Either way it waits while
a module is being imported: interrupted, ``torch._dynamo`` or ``sympy`` stayed half loaded.

Every ``g.measure(case)`` is also held to a working-memory budget (``Budget``; the exercise's
``@exercise(budget=...)``, else ``default_budget``) once the lesson's own checks passed:
``Grader.check_memory``.
"""
from __future__ import annotations

import functools
import json
import math
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .timelimit import TIMEOUT_ENV, CaseTimeout, call_with_limit, case_timeout, time_limited

__all__ = ["CheckFailure", "CaseTimeout", "Case", "Grader", "exercise", "REGISTRY", "strict", "Bug", "hint",
           "yours_or_reference", "passed", "case_timeout", "call_with_limit", "Budget",
           "default_budget"]

_HERE = Path(__file__).resolve().parent
REGISTRY: dict = {}
# A verdict says what it is in words beside its emoji (a terminal or browser without an emoji font shows boxes).
PASSED, WRONG, TODO = "passed", "wrong", "not attempted"
_LAST_FIX: dict = {}      # exercise -> (hint, fix) of its last ❌ in this session
_HINTS_SEEN: dict = {}    # (exercise, hint) -> how many times that ❌ was shown


def hint(name) -> None:
    """Print the exact fix for the last ❌ of exercise ``name`` (its name, or its checker) in this session.

    A ❌ names the case and the likely bug; the fix itself waits until asked for (or until the same mistake comes
    back), so that the learner first tries with the hint alone."""
    name = getattr(name, "exercise_name", name)
    if name not in REGISTRY:
        print(f"no exercise called {name!r}: check.hint takes an exercise's name, e.g. check.hint(\"merge_ml\")")
        return
    last = _LAST_FIX.get(name)
    if last is None:
        print(f"{name}: no failed check in this session, so no hint to give")
    elif last[1]:
        print(f"{name}: the hint was: {last[0]}\nthe fix: {last[1]}")
    else:
        print(f"{name}: the hint was: {last[0] or '(none)'}\nno exact fix is written for this mistake: the hint and "
              "the case are all there is; compare your function with the exercise's spec line by line")


class CheckFailure(AssertionError):
    """A learner's function gave a wrong answer (the message says which, where, and why)."""


class _NotAttempted(Exception):
    pass




def strict() -> bool:
    return os.environ.get("COURSE_STRICT", "") == "1"


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (ipykernel), where a ❌ is printed instead of raised."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def raises_on_fail() -> bool:
    """Whether a ❌ raises ``CheckFailure`` (strict mode, or outside a notebook) or is printed."""
    return strict() or not _in_notebook()


# ------------------------------------------------------------------ verdicts of this session
_VERDICTS: dict = {}     # id(fn) -> (fn, exercise name, "pass" | "fail" | "todo"): the last check of fn


def _remember(fn, name: str, status: str) -> None:
    _VERDICTS[id(fn)] = (fn, name, status)   # fn is kept alive, so its id is not reused


def passed(fn) -> bool:
    """True when the last check run on this very function object (in this session) passed."""
    entry = _VERDICTS.get(id(fn))
    return entry is not None and entry[0] is fn and entry[2] == "pass"


def yours_or_reference(yours, reference):
    """``yours`` once its check passed in this session, else ``reference``; prints which.

    The one way the course's cells after an exercise pick the function they use: a learner's
    function that is not written, is wrong, or was redefined after its check is never used
    (the demo would fail or mislead), and the cell says so.
    """
    name = getattr(yours, "__name__", "your function")
    entry = _VERDICTS.get(id(yours))
    status = entry[2] if entry is not None and entry[0] is yours else None
    if status == "pass":
        print(f"(this cell uses your {name}: its check passed)")
        return yours
    why = {"fail": "did not pass its check",
           "todo": "is not written yet"}.get(status, "has not passed its check since it was last defined "
                                                  "(run its check cell)")
    print(f"(this cell uses the course's reference: your {name} {why})")
    return reference


def _fmt(v) -> str:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.6g}"
    return repr(v)


def _describe(v, name=None) -> str:
    """A short description of an argument: small tensors in full, large ones by shape."""
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).replace("torch.", "")
        if v.numel() <= 8:
            vals = ", ".join(_fmt(x) for x in v.flatten().tolist())
            return f"{dt}{list(v.shape)} = [{vals}]"
        return f"{dt}{list(v.shape)}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return f"{type(v).__name__} of {len(v)} tensors (" + ", ".join(_describe(x) for x in v[:3]) + \
            (", ..." if len(v) > 3 else "") + ")"
    return _fmt(v)


@dataclass
class Case:
    """One set of inputs, with a name a learner can read: ``Case("N=1", q, k, v, Br=4)``."""
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    note: str = ""      # optional: what this case is for (shown on failure)

    def __init__(self, name, *args, note="", **kwargs):
        self.name, self.args, self.kwargs, self.note = name, args, kwargs, note

    def describe(self, arg_names=None) -> str:
        parts = []
        for i, a in enumerate(self.args):
            label = arg_names[i] if arg_names and i < len(arg_names) else f"arg{i}"
            parts.append(f"{label}: {_describe(a)}")
        parts += [f"{k}={_fmt(v)}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


@dataclass
class Bug:
    """A known mistake: ``model(case) -> the output that mistake gives``, the hint that names it, and (optionally)
    the exact fix, given only when asked (``check.hint(name)``) or when the same mistake comes back."""
    hint: str
    model: object  # callable(case) -> tensor/number, or tuple of them
    fix: str = ""


@dataclass
class Budget:
    """The working memory an exercise may use, in elements, beyond one copy of its inputs.

    ``elements``: the allowance (a float64 tensor or numpy array element is one; a Python float in
    a list costs four: 32 bytes); ``what``: how it reads in the verdict ("O(N·d + Br·Bc)");
    ``full``: the size of what the lesson must not build (the N x Nk scores), for the verdict;
    ``hint``: the hint when it is exceeded. See ``Grader.check_memory``.
    """
    elements: int
    what: str
    full: int = 0
    hint: str = ""
    torch: bool = True      # False: count numpy and Python memory only (one call less: a long loop of
    #                         element reads costs no dispatch-mode call per op)


def default_budget(case) -> Budget | None:
    """Every metered case's budget unless its exercise declares one: nothing as large as the N x Nk scores.

    N and Nk are read off the case's first two tensors (q [..., N, d] and k [..., Nk, d]); the leading
    dimensions of q (batch, heads) multiply. Cases without two such tensors get no default budget.
    """
    ts = [a for a in case.args if isinstance(a, torch.Tensor)]
    if len(ts) < 2 or ts[0].dim() < 2 or ts[1].dim() < 2 or not ts[0].numel():
        return None
    q, k = ts[0], ts[1]
    N, Nk = q.shape[-2], k.shape[-2]
    full = q.numel() // (N * q.shape[-1]) * N * Nk
    inputs = sum(t.numel() for t in ts)
    return Budget(full + inputs, f"less than the N x Nk scores ({full:,} elements) plus the inputs again", full,
                  hint="the N x Nk score matrix (or as much in lists, arrays or pieces kept alive) is what "
                       "FlashAttention never holds: work one tile at a time and keep only the running (m, l, acc)")


SLACK = 4 * 1024    # elements (32 KiB) of Python and numpy memory any call may hold: the interpreter's own noise


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's elements, in order: equal bits, equal bytes (-inf and -3.4e38 differ, -0.0 and 0.0 too)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """True when ``b`` holds bit for bit what ``a`` held (an input before and after the call)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
            and bool(torch.equal(_bits(a), _bits(b)))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return True


def _where_in_learner_code(tb) -> str:
    """The last frame of the traceback that is not in helpers/ or in torch: the learner's line."""
    frames = [f for f in traceback.extract_tb(tb)
              if not f.filename.startswith(str(_HERE)) and "site-packages" not in f.filename
              and "/torch/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    where = "your cell" if f.filename.startswith("<") or "ipykernel" in f.filename else Path(f.filename).name
    line = f"  `{f.line.strip()}`" if f.line else ""
    return f" at line {f.lineno} of {where} (in {f.name}){line}"


class Grader:
    """Calls the learner's function on cases and compares the answers; counts what matched."""

    def __init__(self, name, fn, arg_names=None, budget=None):
        self.name, self.arg_names = name, arg_names
        self.budget = budget or default_budget   # callable(case) -> Budget | None: the exercise's budget
        self._memory_due = []                    # (case, fn, budget) of each g.measure, for finish()
        self.learner_fn = fn                 # the function as the learner passed it
        self.fn = time_limited(fn)          # the same, with the per-case time limit on each call
        self.case = None
        self.cases = 0
        self.returned = 0                    # calls of the learner's function that returned
        self.max_rel_err = 0.0
        self.notes = []

    # ----------------------------------------------------------------- failing
    def fail(self, what: str, hint: str = "", case: Case | None = None, fix: str = ""):
        """A ❌ verdict: what is wrong, the case, the hint that names the likely bug; the exact ``fix`` only on
        request (``check.hint(name)``) or when the same hint comes back a second time in this session."""
        case = case or self.case
        lines = [f"❌ {self.name} {WRONG}: {what}"]
        if case is not None:
            lines.append(f"   case '{case.name}': {case.describe(self.arg_names)}")
            if case.note:
                lines.append(f"   ({case.note})")
        if hint:
            lines.append(f"   hint: {hint}")
        if fix:
            seen = _HINTS_SEEN.get((self.name, hint), 0)
            _HINTS_SEEN[(self.name, hint)] = seen + 1
            if seen:
                lines.append(f"   the fix (this mistake came back): {fix}")
            else:
                lines.append(f'   still stuck? check.hint("{self.name}") gives the exact fix')
        _LAST_FIX[self.name] = (hint, fix)
        raise CheckFailure("\n".join(lines))

    # ----------------------------------------------------------------- calling
    def call(self, case: Case, fn=None, error_hint: str = ""):
        """Call the learner's function on copies of the case's inputs; return its output.

        ``error_hint``: the hint if the function raises on this case (else one is guessed from the error).
        """
        self.case = case
        fn = fn or self.fn
        args, kwargs = _clone(case.args), _clone(case.kwargs)
        try:
            out = call_with_limit(fn, *args, **kwargs)
        except NotImplementedError as e:
            if self.returned == 0:           # the untouched stub raises on the first case: not attempted
                raise _NotAttempted from None
            where = _where_in_learner_code(e.__traceback__)
            self.fail(f"your function raised NotImplementedError on this case{where}, after returning on "
                      f"{self.returned} earlier case{'s' if self.returned != 1 else ''}",
                      hint="a branch of your function is not written yet (or still raises NotImplementedError): "
                           "this case takes it; the exercise must handle every case")
        except CaseTimeout:
            self.fail_timeout()
        except CheckFailure:
            raise
        except Exception as e:  # noqa: BLE001 - any error in learner code becomes a verdict
            where = _where_in_learner_code(e.__traceback__)
            self.fail(f"your function raised {type(e).__name__}: {e}{where}",
                      hint=error_hint or _hint_for_exception(e))
        self.returned += 1
        changed = [(i, before, after) for i, (before, after) in enumerate(zip(case.args, args))]
        changed += [(k, case.kwargs[k], kwargs[k]) for k in case.kwargs]
        for key, before, after in changed:
            if not _same(before, after):
                if isinstance(key, str):
                    label = key
                else:
                    label = self.arg_names[key] if self.arg_names and key < len(self.arg_names) else f"argument {key}"
                self.fail(f"your function changed its input `{label}` in place",
                          hint="never write into the inputs (e.g. `q *= scale`, `x[i] = ...`, `.sub_()`, "
                               "`.nan_to_num_()`): a kernel reads Q, K, V and writes only O; work on a new tensor "
                               "(out-of-place ops: `x = x.nan_to_num()`, `q = q * scale`)")
        if out is None:
            self.fail("your function returned None", hint="did you forget the `return` line?")
        return out

    def fail_timeout(self, case: Case | None = None):
        limit = case_timeout()
        self.fail(f"your function was still running after {limit:g} s on this case, so the check stopped it "
                  f"(the limit per case is {TIMEOUT_ENV}, in seconds)",
                  hint="a loop that never ends? check that every `while` advances (j += Bc) and that a `for` "
                       "loop's range has a step; if your function is right but slow, raise the limit, e.g. "
                       f"os.environ['{TIMEOUT_ENV}'] = '300'", case=case)

    def count(self, n: int = 1):
        self.cases += n

    # ----------------------------------------------------------------- outputs
    def expect_tuple(self, out, n: int, what: str):
        if not isinstance(out, (tuple, list)) or len(out) != n:
            got = f"a {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            self.fail(f"expected {what}, got {got}",
                      hint=f"return the {n} values as a tuple: `return {what.strip('()')}`")
        return tuple(out)

    def expect_float(self, v, what: str) -> float:
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            return float(v.item())
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"`{what}` should be a Python float, got {type(v).__name__}",
                      hint="convert with float(...) when you return it")
        return float(v)

    def expect_tensor(self, t, what: str, shape=None, dtype=None, device=None):
        if not isinstance(t, torch.Tensor):
            self.fail(f"`{what}` should be a torch.Tensor, got {type(t).__name__}",
                      hint="build the result with torch ops (torch.stack, torch.empty, ...)")
        self._expect_dense(t, what)
        if shape is not None and tuple(t.shape) != tuple(shape):
            self.fail(f"`{what}` has shape {list(t.shape)}, expected {list(shape)}",
                      hint="check which dimension you reduced over and whether you dropped the last, "
                           "ragged tile (range(0, N, Br) and slicing q[i:i+Br] handle it)")
        if dtype is not None and t.dtype != dtype:
            dt = str(dtype).replace("torch.", "")
            self.fail(f"`{what}` has dtype {t.dtype}, expected {dtype} (the inputs' dtype)",
                      hint=f"return the inputs' dtype, {dt} here: allocate with dtype=q.dtype "
                           "(torch.zeros(..., dtype=x.dtype)) or cast back at the end with .to(x.dtype)")
        if device is not None and t.device != torch.device(device):
            self.fail(f"`{what}` is on {t.device}, expected {device}",
                      hint="allocate outputs on the inputs' device: torch.empty(..., device=q.device)")
        return t

    def _expect_dense(self, t, what: str):
        """A sparse, meta or otherwise not-strided tensor has no values to compare: a verdict, not a crash."""
        if t.layout != torch.strided:
            self.fail(f"`{what}` is a {str(t.layout).replace('torch.', '')} tensor, expected an ordinary (dense) one",
                      hint="return a dense tensor: `.to_dense()`, or build it with torch.empty / torch.stack")
        if t.device.type == "meta":
            self.fail(f"`{what}` is on the meta device: it has a shape but no values",
                      hint="allocate outputs on the inputs' device: torch.empty(..., device=q.device)")

    def compare(self, got, want, what: str, *, rtol=1e-5, atol=1e-6, bugs=(), hint="", nan_hint="", fix="",
                nan_fix=""):
        """Compare ``got`` with the float64 reference ``want``; record the error; fail with the worst index.

        ``-inf``/``inf`` in ``want`` must be matched exactly; NaN never passes (and gets
        ``nan_hint``). On another mismatch, each ``Bug`` model is computed and, if the
        learner's output matches it, that bug's hint is given (its ``fix`` on request); else ``hint`` (``fix``).
        """
        if isinstance(got, torch.Tensor):
            self._expect_dense(got, what)
        elif not isinstance(got, (int, float)) or isinstance(got, bool):
            self.fail(f"`{what}` should be a number or a tensor, got {type(got).__name__}")
        got_t = got if isinstance(got, torch.Tensor) else torch.tensor(float(got))
        want_t = want if isinstance(want, torch.Tensor) else torch.tensor(float(want))
        g = got_t.detach().to(torch.float64).cpu().reshape(want_t.shape) if got_t.numel() == want_t.numel() \
            else got_t.detach().to(torch.float64).cpu()
        w = want_t.detach().to(torch.float64).cpu()
        if g.shape != w.shape:
            self.fail(f"`{what}` has shape {list(got_t.shape)}, expected {list(want_t.shape)}")
        bad_nan = g.isnan() & ~w.isnan()
        inf_w = w.isinf()
        bad_inf = (inf_w & (g != w)) | (~inf_w & g.isinf())
        finite = ~w.isinf() & ~w.isnan() & ~g.isnan() & ~g.isinf()
        err = torch.zeros_like(w)
        err[finite] = (g[finite] - w[finite]).abs()
        tol = atol + rtol * w.abs().nan_to_num(0, 0, 0)
        bad = bad_nan | bad_inf | (finite & (err > tol))
        scale = w[finite].abs().max().item() if finite.any() else 1.0
        # relative to the largest reference value, floored at atol / rtol: a reference of exactly 0 (Nk = 1)
        # gives the absolute error over that floor, not 3e+22
        floor = atol / rtol if rtol > 0 else 1.0
        rel = (err.max().item() / max(scale, floor, 1e-30)) if finite.any() else 0.0
        if not bad.any():
            self.max_rel_err = max(self.max_rel_err, rel)
            return rel
        # the worst mismatch: NaN/inf first, then the largest error over tolerance
        score = torch.where(bad_nan | bad_inf, torch.full_like(err, math.inf), err / tol)
        score = torch.where(bad, score, torch.full_like(err, -1.0))
        idx = tuple(int(i) for i in torch.unravel_index(score.flatten().argmax(), w.shape)) if w.dim() else ()
        gv, wv = g[idx].item(), w[idx].item()
        n_bad, n = int(bad.sum()), w.numel()
        where = f" at index {idx}" if idx else ""
        what_line = (f"`{what}`{where}: got {_fmt(gv)}, expected {_fmt(wv)}"
                     + (f" (abs err {abs(gv - wv):.3g})" if math.isfinite(gv) and math.isfinite(wv) else "")
                     + f"; {n_bad} of {n} values wrong")
        if bad_nan.any():
            found = (nan_hint or ("NaN appeared where the answer is a number: look for exp(-inf - (-inf)), "
                                  "0 * inf or 0 / 0 (a row or block with nothing in it)"), nan_fix)
        else:
            found = self._match_bug(got_t, bugs, rtol=rtol, atol=atol)
        if not found:
            if bad_inf.any() and math.isinf(wv):
                found = ("the answer here is -inf (nothing to attend to): keep it -inf, don't replace it with a number",
                         "")
            else:
                found = (hint, fix)
        self.fail(what_line, hint=found[0], fix=found[1])

    def _match_bug(self, got, bugs, rtol=0.0, atol=0.0):
        """``(hint, fix)`` of the first bug model that ``got`` matches (None when none does): as close to the model as a right answer must
        be to the reference (the comparison's own tolerance, never looser than 1e-4 relative, 1e-5 absolute),
        plus 8 units of ``got``'s rounding at the model's largest value, so that an fp16 kernel on a GPU, whose
        bug can make values far larger than the right ones, still matches its float64 model."""
        for bug in bugs:
            try:
                model = bug.model(self.case)
            except Exception:  # noqa: BLE001 - a bug model that cannot run on this case says nothing
                continue
            if isinstance(model, (tuple, list)):
                continue
            m = model if isinstance(model, torch.Tensor) else torch.tensor(float(model))
            if m.numel() != got.numel():
                continue
            a, b = got.detach().double().cpu().reshape(m.shape), m.detach().double().cpu()
            # plus the learner's own rounding: a buggy fp16 kernel's output is the model rounded at every step
            eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
            finite = b[b.isfinite()]
            rounding = 8 * eps * (finite.abs().max().item() if finite.numel() else 0.0)
            if torch.allclose(a, b, rtol=max(rtol, 1e-4), atol=max(atol, 1e-5) + rounding, equal_nan=True):
                return bug.hint, bug.fix
        return None

    # ----------------------------------------------------------------- metering
    def measure(self, case: Case, fn=None, names=None, budget=None):
        """Meter one call of the learner's function on copies of ``case``'s inputs (``helpers.meter``).

        Every idea check goes through here: ``case`` becomes the current case (a failing idea
        check names it), the tensor arguments are named after ``arg_names`` (or ``names``), and an
        error the learner's function raises while metered is a ❌ verdict with this case, never a
        traceback from the checker. Once ``grade(g)`` returns, ``check_memory(case)`` holds the case to the
        working-memory budget (``budget``, else the exercise's, else ``default_budget``): the lesson's own
        checks, with their precise hints, come first. Returns the ``meter.Measurement``.
        """
        from . import meter
        self.case = case
        fn = fn or self.fn
        args, kwargs = _clone(case.args), _clone(case.kwargs)
        if names is None:
            names = [self.arg_names[i] if self.arg_names and i < len(self.arg_names) else f"x{i}"
                     for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        r = self._metered(lambda: meter.measure(fn, *args, names=names, **kwargs))
        self._memory_due.append((case, fn, budget))     # checked once the lesson's own checks passed
        return r

    def finish(self):
        """The working-memory checks of the metered cases, after the lesson's own idea checks (whose
        hints are more precise) passed. The exercise wrapper calls it after ``grade(g)``."""
        due, self._memory_due = self._memory_due, []
        for case, fn, budget in due:
            self.check_memory(case, fn=fn, budget=budget)

    def _metered(self, run):
        try:
            return run()
        except NotImplementedError:
            raise _NotAttempted from None
        except (CheckFailure, CaseTimeout):
            raise
        except Exception as e:  # noqa: BLE001 - any error in learner code becomes a verdict
            where = _where_in_learner_code(e.__traceback__)
            self.fail(f"your function raised {type(e).__name__} while metered (called once more, on this "
                      f"case): {e}{where}",
                      hint=_hint_for_exception(e) or "the same function passed the cases above: look for "
                      "what differs here (the sizes, the tiles) or for state kept between calls")

    def check_memory(self, case: Case, fn=None, budget=None):
        """Hold one call on ``case`` to a working-memory budget, whatever holds the memory.

        ``meter.working_memory`` measures the peak of the call's torch tensors and, through
        ``tracemalloc``, of its numpy arrays and Python objects (lists of floats included). Allowed:
        one copy of the inputs on each side (torch: ``x.double()``; Python: ``np.array(x)`` or ``x.tolist()`` of
        a whole input, not a copy of that list too), 32 KiB of interpreter noise, and the budget: ``budget`` (a ``Budget``, or a callable
        ``case -> Budget``), else the exercise's ``@exercise(budget=...)``, else ``default_budget``.
        Returns the ``meter.Memory``, or None when there is no budget.
        """
        from . import meter
        b = budget if budget is not None else self.budget
        b = b(case) if callable(b) else b
        if b is None:
            return None
        self.case = case
        fn = fn or self.fn
        args, kwargs = _clone(case.args), _clone(case.kwargs)
        # fn (g.fn) carries the time limit itself: the meter's own set-up and clean-up (it patches
        # torch.Tensor.tolist and __iter__ for the call) must never be interrupted
        mem = self._metered(lambda: meter.python_peak(fn, *args, **kwargs))
        if b.torch:
            args, kwargs = _clone(case.args), _clone(case.kwargs)
            mem.torch_peak, mem.torch_largest = self._metered(lambda: meter.torch_peak(fn, *args, **kwargs))
        ts = [t for t in _tensors(case.args) + _tensors(case.kwargs)]
        copy = sum(t.numel() if t.element_size() >= 2 else -(-t.numel() * t.element_size() // 8) for t in ts)
        torch_limit = copy + b.elements
        # one copy of the inputs on the Python side: np.array(x), or x.tolist() (its floats cost more), not both
        # (a list made from x.tolist() by copying it is a second copy, which a second pass over x needs)
        py_limit = max(copy, mem.input_lists) + b.elements + SLACK
        full = f"; the N x Nk scores are {b.full:,}" if b.full else ""
        if mem.torch_peak > torch_limit:
            big = mem.torch_largest
            self.fail(f"your function held {mem.torch_peak:,} elements in torch tensors at once (the largest "
                      f"{list(big.shape)}, made by aten.{big.op}); its budget is {b.what}: {b.elements:,} "
                      f"elements beyond a copy of the inputs{full}", hint=b.hint)
        if mem.triton:       # interpreted Triton: its Python memory is the interpreter's, not the kernel's
            self.notes.append("the working-memory budget saw torch tensors only: a Triton kernel ran, interpreted")
        elif mem.python_peak > py_limit:
            self.fail(f"your function held {mem.python_peak * 8 / 1024:,.0f} KiB in Python objects and numpy arrays "
                      f"at once (a Python float in a list costs 32 bytes, a float64 8); its budget is {b.what}: "
                      f"{b.elements:,} elements beyond a copy of the inputs, "
                      f"{py_limit * 8 / 1024:,.0f} KiB in all{full}", hint=b.hint)
        return mem

def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []


def _hint_for_exception(e: Exception) -> str:
    msg = str(e)
    if "numel() == 0" in msg or "non-zero size" in msg or "with no elements" in msg:
        return ("a max (or another reduction) over an empty slice: a tile or a split with no keys in it (more "
                "splits than keys, or a slice past the end). Skip it, or give it its neutral values "
                "(m = -inf, l = 0, O = 0, lse = -inf)")
    if isinstance(e, (RuntimeError, ValueError)) and ("size" in msg or "shape" in msg or "match" in msg):
        return ("a shape mismatch: write the shape next to each line ([Br, d] @ [d, Bc] -> [Br, Bc]) and "
                "mind the last tile, which can be smaller than Br or Bc")
    if isinstance(e, IndexError):
        return "an index ran past the end: the last tile can be smaller than the tile size"
    if isinstance(e, TypeError):
        return "check the argument names and types: the signature is given in the exercise"
    if isinstance(e, (ZeroDivisionError, ValueError)) and ("math domain" in msg or "division" in msg):
        return "a division by zero or log of zero: an empty row has l = 0; guard it"
    if isinstance(e, OverflowError):
        return "math.exp overflowed: subtract the running max before exponentiating"
    return ""


GRADE_LOG = "COURSE_GRADE_LOG"   # set by ``make grade``: a file that collects every verdict


def _record(name: str, status: str, message: str) -> None:
    """Append one verdict (status: pass / fail / todo) to $COURSE_GRADE_LOG, if it is set (``make grade``), and to
    the progress log of the notebook JupyterLab is running (``helpers.progress``)."""
    from . import progress
    path = os.environ.get(GRADE_LOG)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"exercise": name, "status": status, "message": message}) + "\n")
    progress.record(name, status, message)


def _say(name: str, status: str, line: str) -> None:
    _record(name, status, line)
    print(line)


def _fail(name: str, message: str):
    """A ❌: recorded; raised as a ``CheckFailure`` (strict, or outside a notebook) or printed."""
    _record(name, "fail", message)
    if raises_on_fail():
        raise CheckFailure(message) from None
    print(message + "\n   (the notebook goes on: later cells use the course's reference until this check passes)")


def _course_reference(fn) -> str:
    """``helpers.lessonNN.x_ref`` when ``fn`` is one of the course's reference functions, else ''."""
    mod, fname = getattr(fn, "__module__", "") or "", getattr(fn, "__name__", "") or ""
    return f"{mod}.{fname}" if mod.startswith("helpers.") and fname.endswith("_ref") else ""


def exercise(name: str, arg_names=None, reference: str = "the float64 reference", budget=None):
    """Register ``grade(g) -> str | None`` as the checker ``check.<name>(fn)``.

    ``grade`` returns the tail of the pass line; by default "N cases match <reference>,
    max rel err E". ``budget``: a callable ``case -> Budget | None``, the working memory each
    ``g.measure`` (and ``g.check_memory``) holds the learner's call to; by default
    ``default_budget`` (nothing as large as the N x Nk scores). Notes added to ``g.notes`` are
    appended to the pass line.
    """
    def decorate(grade):
        @functools.wraps(grade)
        def checker(fn):
            if not callable(fn):
                _fail(name, f"❌ {name} not graded: pass your function itself, e.g. check.{name}({name}), "
                            f"not a {type(fn).__name__}")
            g = Grader(name, fn, arg_names, budget=budget)
            try:
                try:
                    summary = grade(g)
                    g.finish()
                except CaseTimeout:          # a call made outside g.call (a metered one) ran too long
                    g.fail_timeout()
            except _NotAttempted:
                _remember(fn, name, "todo")
                if strict():
                    _fail(name, f"❌ {name} {TODO} (COURSE_STRICT=1): the stub still raises NotImplementedError")
                    return None
                _say(name, "todo", f"⏳ {name} {TODO} yet")
                return None
            except CheckFailure as e:
                _remember(fn, name, "fail")
                _fail(name, str(e))
                return None
            if summary is None:
                summary = f"{g.cases} cases match {reference}, max rel err {g.max_rel_err:.0e}"
            ref = _course_reference(fn)
            notes = g.notes + ([f"this is the course's reference, {ref}, not a function of yours"] if ref else [])
            if notes:
                summary += " (" + "; ".join(dict.fromkeys(notes)) + ")"
            _remember(fn, name, "pass")
            _say(name, "pass", f"✅ {name} {PASSED}: {summary}")
            return None
        checker.exercise_name = name
        REGISTRY[name] = checker
        return checker
    return decorate


def _install_ipython_handler():
    """Show a CheckFailure in Jupyter as its message, not as a traceback through helpers."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or getattr(ip, "_course_handler", False):
        return

    def show(shell, etype, value, tb, tb_offset=None):
        stb = [str(value)]
        shell._showtraceback(etype, value, stb)  # IPython leaves the display to the handler
        return stb

    ip.set_custom_exc((CheckFailure,), show)
    ip._course_handler = True


_install_ipython_handler()
