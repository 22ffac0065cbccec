"""Running learner code (introduced in chapter 01): under a time limit, in a forked child that a crash
cannot take down with the notebook, and one call at a time (``call``), so that code that raises, hangs
or returns nothing ends its exercise with one line saying why (``explain``) instead of a traceback
from inside the grader.
"""
from __future__ import annotations

import faulthandler
import math
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager

import numpy as np

from ..world import world
from .addresses import SANITIZER, checked, interpreter_error
from .reporting import FAIL, NOT_GRADED, PASS, Exercise, Report


class TimeLimit(Exception):
    pass


class Stop(Exception):
    """Ends the grading of an exercise after its failing line was recorded (raised by ``call``)."""


@contextmanager
def time_limit(seconds: float):
    """Interrupt learner code that runs longer than ``seconds`` (an endless loop, say).

    Uses SIGALRM, so it only works in the main thread of a Unix process; elsewhere it does nothing.
    """
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def interrupt(signum, frame):
        raise TimeLimit(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def where(exc: BaseException) -> str:
    """" (line 12: `out[i] = x[i]`)": the innermost frame of learner code in a traceback, or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "kernelcourse" not in f.filename and "site-packages" not in f.filename]
    return f" (line {frames[-1].lineno}: `{frames[-1].line}`)" if frames and frames[-1].line else ""


def explain(exc: BaseException) -> str:
    """One line saying what learner code raised and where."""
    if isinstance(exc, TimeLimit):
        return f"{exc}: is there a loop that never ends?"
    if isinstance(exc, NotImplementedError):
        return "not written yet (the stub raises NotImplementedError)"
    if (bad := interpreter_error(exc)) is not None:
        return str(bad)
    if "illegal memory access" in str(exc).lower() or "illegal address" in str(exc).lower():
        return ("the GPU reported an illegal memory access (a load or store outside any allocation); "
                "this process's GPU context is now unusable: fix the masks, then restart the kernel; "
                f"{SANITIZER} and see which load it was")
    if type(exc).__name__ == "OutOfResources" and "shared memory" in str(exc):  # Triton's launch check
        return f"the launch needs more shared memory than this GPU has ({exc}): smaller tiles or fewer stages"
    if isinstance(exc, IndexError) or "out of bounds" in str(exc).lower():
        # the simulator names the first thread that failed, which varies from run to run: leave it out
        return f"out-of-bounds access{where(exc)}: a thread past the end of the data read or wrote memory"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}{where(exc)}"



def grade_here(ex: Exercise, objects: dict, report: Report) -> None:
    """Run exercise ``ex``'s grader on the learner's ``objects`` in this process, recording its lines in
    ``report``; whatever learner code raises ends the exercise with one failing line."""
    try:
        # Wrong answers overflow and divide by zero on purpose-made inputs: the grader's line says so,
        # and NumPy's or PyTorch's warnings about it would only add noise under it.
        # In Triton's interpreter, every load and store is checked against the tensors a launch was given.
        with time_limit(ex.time_limit_s), np.errstate(all="ignore"), warnings.catch_warnings(), checked():
            warnings.simplefilter("ignore")
            ex.grade(report, **objects)
    except Stop:  # the line saying why was recorded where the grader stopped
        pass
    except Exception as exc:  # learner code is allowed to fail in any way; grading goes on
        report.fail(explain(exc))


def can_isolate() -> bool:
    """Can grading run in a forked child here? A CUDA context does not survive fork(), so on a GPU
    grading runs in the notebook's process."""
    return hasattr(os, "fork") and not world().gpu and os.environ.get("KC_GRADE_IN_PROCESS") != "1"


def grade_in_child(ex: Exercise, objects: dict, report: Report) -> None:
    """Run the grader in a forked child so that a crash (an out-of-bounds access can segfault the
    Triton interpreter) or an endless loop costs this exercise, not the notebook's kernel."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grade, send each line up the pipe, never return into the notebook
        os.close(read_fd)
        code = 0
        faulthandler.disable()  # a crash is reported by the parent in one line, not as a stack dump
        if "torch" in sys.modules:
            # The parent's intra-op worker threads do not exist in a forked child: a parallel torch op
            # on the CPU would wait for them forever. One thread runs every op inline.
            sys.modules["torch"].set_num_threads(1)
        try:
            with os.fdopen(write_fd, "w", buffering=1) as pipe:
                child = Report(ex, sink=lambda line: pipe.write(line.replace("\n", " ") + "\n"))
                grade_here(ex, objects, child)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + ex.time_limit_s
    buffer, timed_out = b"", False
    with os.fdopen(read_fd, "rb") as pipe:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([pipe], [], [], min(remaining, 1.0))
            if not ready:
                continue
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                _relay(line.decode(), report)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        report.fail(f"still running after {ex.time_limit_s:g} s: is there a loop that never ends?")
    elif os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        report.fail(f"your code crashed the process running it ({name}): usually an out-of-bounds memory "
                    "access; check the masks on every load and store")


def _relay(line: str, report: Report) -> None:
    if line.startswith(PASS):
        report.ok(line[len(PASS):].strip())
    elif line.startswith(FAIL):
        report.fail(line[len(FAIL):].strip())
    elif line.startswith(NOT_GRADED):
        report.not_graded(line[len(NOT_GRADED):].strip())



def guarded(report: Report, what: str, fn, *args, **kwargs):
    """Call learner code; on an exception, record a failure for ``what`` and return None."""
    try:
        return fn(*args, **kwargs)
    except TimeLimit:
        raise
    except Exception as exc:
        report.fail(f"{what}: {explain(exc)}")
        return None


def call(report: Report, what: str, fn, *args, **kwargs):
    """Call learner code and return what it returned; if it raises or returns None, record one line
    for ``what`` and stop grading this exercise (``Stop``, caught by the framework). The one way a
    grader calls learner code that must return something."""
    try:
        got = fn(*args, **kwargs)
    except (TimeLimit, Stop):
        raise
    except Exception as exc:
        report.fail(f"{what}: {explain(exc)}")
        raise Stop from exc
    if got is None:
        report.fail(f"{what} returned None: did you forget `return`?")
        raise Stop
    return got


def as_tuple(report: Report, what: str, got, n: int):
    """The learner's return value as a tuple of ``n`` values, or None after recording why it is not one."""
    if got is None:
        report.fail(f"{what} returned None: did you forget `return`?")
        return None
    if not isinstance(got, (tuple, list)) or len(got) != n:
        report.fail(f"{what} returned {type(got).__name__}: return a tuple of {n} values")
        return None
    return got


def as_number(report: Report, what: str, got) -> float | None:
    """The learner's return value as a float, or None after recording why it is not a number."""
    if got is None:
        report.fail(f"{what} returned None: did you forget `return`?")
        return None
    if isinstance(got, (str, bytes, bool)) or not hasattr(got, "__float__"):
        report.fail(f"{what} returned {got!r} of type {type(got).__name__}, not a number")
        return None
    try:
        value = float(got)
    except (TypeError, ValueError):
        report.fail(f"{what} returned {got!r}, not a number")
        return None
    if not math.isfinite(value):
        report.fail(f"{what} returned {value}: check for a division by zero or a missing factor")
        return None
    return value


def number(report: Report, what: str, fn, *args) -> float:
    """Call learner code that should return a number (``call``); if it does not, record why and stop
    grading this exercise."""
    value = as_number(report, what, call(report, what, fn, *args))
    if value is None:
        raise Stop
    return value
