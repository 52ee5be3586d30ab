"""The per-case time limit: a learner's function that runs too long raises ``CaseTimeout`` instead of hanging.

Each call of the learner's function made by a checker has a limit (``COURSE_CASE_TIMEOUT`` seconds, default 60;
``0`` turns it off). On the main thread of Linux and macOS a ``SIGALRM`` timer raises ``CaseTimeout``, which also
interrupts a blocking C call (``time.sleep``, a read); elsewhere (Windows, other threads) a timer thread raises it
with CPython's ``PyThreadState_SetAsyncExc`` at the next Python bytecode. Either way it waits while the call is
importing a module (interrupted, ``torch._dynamo`` or ``sympy`` stayed half loaded), at most ``_MAX_IMPORT_WAIT``.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import signal
import sys
import threading
import time

__all__ = ["CaseTimeout", "TIMEOUT_ENV", "DEFAULT_CASE_TIMEOUT", "case_timeout", "call_with_limit", "time_limited"]


class CaseTimeout(BaseException):
    """Raised inside a learner's function that ran past ``COURSE_CASE_TIMEOUT`` seconds.

    A ``BaseException``, so a learner's ``except Exception:`` does not swallow it.
    """


TIMEOUT_ENV = "COURSE_CASE_TIMEOUT"
DEFAULT_CASE_TIMEOUT = 60.0
_limit_state = threading.local()


def case_timeout() -> float | None:
    """Seconds one call of a learner's function may take (``COURSE_CASE_TIMEOUT``, default 60; None: no limit)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CASE_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds, e.g. 60 "
                         "(0 turns the limit off)") from None
    return seconds if seconds > 0 and math.isfinite(seconds) else None


def _async_raise(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _importing(frame, limit_code) -> bool:
    """True while the limited call is importing a module: a frame of ``importlib._bootstrap`` between the frame
    that was interrupted (``frame``) and the limit's own (the first frame running ``limit_code``). The limit then
    waits, so that it never leaves a module half loaded (``torch._dynamo``, ``sympy``: a learner's session would
    stay broken). An import under way above the limit (a check run by a module's own import) does not count: that check is still stopped. Read from
    the stack, not from the import locks, which an unrelated import (another thread's, or a lock an old traceback
    keeps alive) can hold for ever."""
    f = frame
    while f is not None and f.f_code is not limit_code:
        if f.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        f = f.f_back
    return False


_RETRY = 0.05   # seconds: how soon the limit tries again when it found an import under way
_MAX_IMPORT_WAIT = 120.0   # seconds past the limit: an import that takes longer is interrupted after all


def _use_signal() -> bool:
    """SIGALRM where there is one (Linux, macOS) and this is the main thread: it also stops a long C call."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def call_with_limit(fn, *args, limit: float | None = None, **kwargs):
    """``fn(*args, **kwargs)``, raising ``CaseTimeout`` in this thread once it has run ``limit`` seconds.

    ``limit`` defaults to ``case_timeout()``. Nested calls on one thread share the outer limit.
    On the main thread of Linux and macOS a ``SIGALRM`` timer raises it, which also interrupts a
    blocking C call (``time.sleep``, a read); elsewhere (Windows, other threads) a timer thread does,
    at the next Python bytecode. Either way the exception is held back while an import is under way.
    """
    limit = case_timeout() if limit is None else limit
    if not limit or getattr(_limit_state, "active", False):
        return fn(*args, **kwargs)
    if _use_signal():
        return _call_with_alarm(fn, args, kwargs, limit)
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"running": True, "fired": False, "timer": None}
    limit_code = call_with_limit.__code__     # frames compare by code (f_back is not always the same object)
    give_up = time.monotonic() + limit + _MAX_IMPORT_WAIT

    def fire():
        with lock:
            if not state["running"]:
                return
            if time.monotonic() < give_up and _importing(sys._current_frames().get(thread_id), limit_code):
                state["timer"] = threading.Timer(_RETRY, fire)
                state["timer"].daemon = True
                state["timer"].start()
                return
            state["fired"] = True
            _async_raise(thread_id, CaseTimeout)
            # again until the call ends: a raise that lands in a weakref callback or a __del__ is swallowed
            state["timer"] = threading.Timer(_RETRY, fire)
            state["timer"].daemon = True
            state["timer"].start()

    state["timer"] = threading.Timer(limit, fire)
    state["timer"].daemon = True
    _limit_state.active = True
    state["timer"].start()
    try:
        return fn(*args, **kwargs)
    finally:
        with lock:
            state["running"] = False
            fired = state["fired"]
            state["timer"].cancel()
        _limit_state.active = False
        if fired:                    # the exception may still be pending: clear it and raise it here, once
            _async_raise(thread_id, None)
            raise CaseTimeout


def _call_with_alarm(fn, args, kwargs, limit):
    state = {"running": True}
    limit_code = _call_with_alarm.__code__
    give_up = time.monotonic() + limit + _MAX_IMPORT_WAIT

    def on_alarm(signum, frame):
        if not state["running"]:
            return
        if time.monotonic() < give_up and _importing(frame, limit_code):
            signal.setitimer(signal.ITIMER_REAL, _RETRY)
            return
        # re-armed until the call's own `finally` stops it: a raise that lands in a weakref callback or a __del__
        # (the meter's finalizers) is printed and swallowed, and a one-shot alarm then let a spin run for ever
        signal.setitimer(signal.ITIMER_REAL, _RETRY)
        raise CaseTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    outer = signal.setitimer(signal.ITIMER_REAL, limit)     # (seconds left, interval) of a timer set before
    _limit_state.active = True
    try:
        return fn(*args, **kwargs)
    finally:
        state["running"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _limit_state.active = False
        if outer[0] > 0:                                    # someone else's alarm: put it back
            signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - start), 1e-3), outer[1])


def time_limited(fn):
    """``fn`` with the per-case time limit on every call (the checkers call the learner's function through it)."""
    if fn is None or not callable(fn):
        return fn

    @functools.wraps(fn)
    def limited(*args, **kwargs):
        return call_with_limit(fn, *args, **kwargs)
    return limited
