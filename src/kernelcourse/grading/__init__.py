"""Graders for the course's exercises (introduced in chapter 01; see the "How grading works" page).

A grader cell is one call: ``kc.grading.check("01.1", globals())``. It looks up the names the
exercise defines, runs the learner's code on fresh random inputs of several sizes and seeds, prints
one deterministic line per check, and raises ``GradeFailure`` if any check failed, so that nbval (and
``make grade``) count the cell as failed. Learner code that raises, hangs or returns nonsense gets a
one-line explanation instead of a traceback from inside the grader.
"""
from __future__ import annotations

import faulthandler
import importlib
import math
import os
import select
import signal
import sys
import time
import threading
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

PASS, FAIL, NOT_GRADED = "✔", "✘", "–"  # NOT_GRADED: a check this machine cannot make (speed on the CPU)
DEFAULT_TIME_LIMIT_S = 120


class GradeFailure(AssertionError):
    """Raised at the end of a grader cell when at least one check failed."""


class TimeLimit(Exception):
    pass


class Stop(Exception):
    """Ends the grading of an exercise after its failing line was recorded (raised by ``call``)."""


@dataclass
class Exercise:
    id: str
    title: str
    names: tuple[str, ...]
    grade: callable
    time_limit_s: float = DEFAULT_TIME_LIMIT_S


_EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, title: str, names: tuple[str, ...], time_limit_s: float = DEFAULT_TIME_LIMIT_S):
    """Register a grader: ``grade(report, **objects)`` with the learner's objects named in ``names``."""
    def register(fn):
        _EXERCISES[id] = Exercise(id, title, tuple(names), fn, time_limit_s)
        return fn
    return register


def exercises(chapter: str) -> list[Exercise]:
    _load(chapter)
    return [e for k, e in sorted(_EXERCISES.items()) if k.startswith(chapter + ".")]


def _load(chapter: str) -> None:
    importlib.import_module(f".ch{chapter}", __name__)


@dataclass
class Report:
    """Collects one line per check; a grader calls ``ok``/``fail`` or ``expect``.

    Each line goes to ``sink`` as soon as it is made (``print`` by default; a pipe to the parent
    process when grading runs in a child, see ``check``).
    """
    exercise: Exercise
    lines: list[str] = field(default_factory=list)
    failures: int = 0
    skipped: int = 0
    sink: Callable[[str], None] = lambda line: print(line, flush=True)
    seed: int | None = None  # set by ``fresh_rng``: failing lines name it, so the cases can be drawn again

    def ok(self, what: str) -> None:
        self._add(f"{PASS} {what}")

    def fail(self, what: str) -> None:
        self.failures += 1
        if self.seed is not None:
            what += f" [seed {self.seed}: {SEED_VARIABLE}={self.seed} draws these cases again]"
        self._add(f"{FAIL} {what}")

    def not_graded(self, what: str) -> None:
        """A check that cannot be made here (a speed check without a GPU): neither passed nor failed."""
        self.skipped += 1
        self._add(f"{NOT_GRADED} {what}")

    def _add(self, line: str) -> None:
        self.lines.append(line)
        self.sink(line)

    def expect(self, condition: bool, passed: str, failed: str) -> bool:
        (self.ok if condition else self.fail)(passed if condition else failed)
        return condition


SEED_VARIABLE = "KC_GRADE_SEED"


def fresh_rng(report: Report) -> np.random.Generator:
    """A generator for this run's cases: drawn fresh on every run, so that a table of answers cannot pass.

    The seed comes from the environment variable ``KC_GRADE_SEED`` when it is set (to draw a failing
    run's cases again: ``os.environ["KC_GRADE_SEED"] = "123456"`` in the notebook), else at random;
    every failing line of the report names it.
    """
    text = os.environ.get(SEED_VARIABLE, "").strip()
    report.seed = int(text) if text.isdigit() else int(np.random.SeedSequence().entropy % 1_000_000)
    return np.random.default_rng(report.seed)


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
    from .addresses import SANITIZER, interpreter_error

    if (bad := interpreter_error(exc)) is not None:
        return str(bad)
    if "illegal memory access" in str(exc).lower() or "illegal address" in str(exc).lower():
        return ("the GPU reported an illegal memory access (a load or store outside any allocation); "
                "this process's GPU context is now unusable: fix the masks, then restart the kernel; "
                f"{SANITIZER} and see which load it was")
    if isinstance(exc, IndexError) or "out of bounds" in str(exc).lower():
        # the simulator names the first thread that failed, which varies from run to run: leave it out
        return f"out-of-bounds access{where(exc)}: a thread past the end of the data read or wrote memory"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}{where(exc)}"


def check(exercise_id: str, namespace: dict) -> None:
    """Grade exercise ``exercise_id`` using the learner's definitions found in ``namespace``."""
    chapter = exercise_id.split(".")[0]
    _load(chapter)
    ex = _EXERCISES[exercise_id]
    report = Report(ex)
    missing = [n for n in ex.names if n not in namespace]
    if missing:
        report.fail(f"{', '.join(missing)} not defined: run the exercise cell above, and fix any error it shows")
    else:
        objects = {n: namespace[n] for n in ex.names}
        if _can_isolate():
            _grade_in_child(ex, objects, report)
        else:
            _grade_here(ex, objects, report)
    _RESULTS[ex.id] = (report.failures == 0, report.skipped > 0, "\n".join(report.lines))  # for report()
    if report.failures:
        raise GradeFailure(f"exercise {ex.id} ({ex.title}): {report.failures} check(s) failed")
    if report.skipped:
        print(f"Exercise {ex.id} ({ex.title}): every check made here passed; {report.skipped} not graded here.")
    else:
        print(f"Exercise {ex.id} ({ex.title}) passed.")


def _grade_here(ex: Exercise, objects: dict, report: Report) -> None:
    from .addresses import checked

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


def _can_isolate() -> bool:
    # A CUDA context does not survive fork(), so on a GPU grading runs in the notebook's process.
    from ..world import world

    return hasattr(os, "fork") and not world().gpu and os.environ.get("KC_GRADE_IN_PROCESS") != "1"


def _grade_in_child(ex: Exercise, objects: dict, report: Report) -> None:
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
                _grade_here(ex, objects, child)
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


# ---- comparing outputs ------------------------------------------------------------------------

POISON = -3.0e38  # written into output buffers first: an element still holding it was never written


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, POISON, dtype=dtype)


def _index(flat_i: int, shape) -> str:
    idx = np.unravel_index(flat_i, shape)
    return str(int(idx[0])) if len(shape) == 1 else str(tuple(int(i) for i in idx))


def tolerance_of(truth, reference, rtol_floor: float) -> float:
    """The graders' one tolerance rule: twice the worst error of ``reference`` (the same computation by
    PyTorch or NumPy at the output's precision) against the float64 ``truth``, and at least
    ``rtol_floor`` times the largest value of the truth."""
    truth = np.asarray(truth, dtype=np.float64)
    if not truth.size:
        return 0.0
    tol = rtol_floor * float(np.max(np.abs(truth)))
    if reference is not None:
        tol = max(tol, 2 * float(np.max(np.abs(np.asarray(reference, np.float64) - truth))))
    return tol


def compare(got, truth, reference=None, *, what: str, rtol_floor: float | None = None,
            dtype=None) -> tuple[bool, str]:
    """Compare ``got`` with a float64 ``truth``.

    The tolerance is twice the worst error of ``reference`` (the same computation done by PyTorch or
    NumPy at the output's precision), with a floor of one rounding step of the output dtype. ``dtype``,
    when given, is the dtype the output must have. Returns (passed, one line saying why).
    """
    got = np.asarray(got)
    truth = np.asarray(truth, dtype=np.float64)
    if got.shape != truth.shape:
        return False, f"{what}: shape {got.shape}, expected {truth.shape}"
    if dtype is not None and got.dtype != np.dtype(dtype):
        return False, f"{what}: dtype {got.dtype}, expected {np.dtype(dtype)}"
    g = got.astype(np.float64)
    unwritten = got == np.asarray(POISON, dtype=got.dtype)
    if unwritten.all() and unwritten.size > 1:
        return False, f"{what}: no element of the output was written (is the kernel body still a stub?)"
    if unwritten.any():
        idx = np.flatnonzero(unwritten)
        return False, (f"{what}: {idx.size} of {got.size} elements never written "
                       f"(first at index {_index(idx[0], got.shape)})")
    bad = ~np.isfinite(g) & np.isfinite(truth)
    if bad.any():
        idx = np.flatnonzero(bad)
        return False, f"{what}: {idx.size} elements are NaN or Inf (first at index {_index(idx[0], got.shape)})"
    eps = float(np.finfo(got.dtype).eps) if np.issubdtype(got.dtype, np.floating) else 0.0
    tol = tolerance_of(truth, reference, rtol_floor if rtol_floor is not None else eps)
    err = np.abs(g - truth)
    worst = int(np.argmax(err)) if err.size else 0
    if err.size and err.flat[worst] > tol:
        return False, (f"{what}: max error {err.flat[worst]:.3g} at index {_index(worst, got.shape)} "
                       f"(expected {truth.flat[worst]:.6g}, got {g.flat[worst]:.6g}; tolerance {tol:.2g})")
    return True, f"{what}: all {got.size} elements match (max error {float(err.max()) if err.size else 0:.2g})"


# ---- speed ----------------------------------------------------------------------------------------


def _median_ms(report: Report, what: str, fn) -> float | None:
    """Median time of learner (or peer) code in ms on this GPU, or None after recording why it failed."""
    from ..bench import do_bench

    before = report.failures
    ms = guarded(report, what, do_bench, fn)
    return None if report.failures > before else ms


def speed_vs_peer(report: Report, what: str, fn, peer, peer_name: str, at_least: float) -> bool | None:
    """Speed check on a GPU: ``fn()`` must run at least ``at_least`` times as fast as ``peer()``, both
    timed now, in this process (median of many runs). On the CPU the check is not graded.

    Returns True or False when graded, None when not.
    """
    from ..world import world

    if not world().gpu:
        report.not_graded(f"{what}: speed needs a GPU (not graded here)")
        return None
    ms, peer_ms = _median_ms(report, what, fn), _median_ms(report, peer_name, peer)
    if ms is None or peer_ms is None:
        return False
    ratio = peer_ms / ms
    return report.expect(
        ratio >= at_least,
        f"{what}: {ratio:.2f}x the speed of {peer_name} ({ms:.3f} ms vs {peer_ms:.3f} ms; needs {at_least:g}x)",
        f"{what}: {ratio:.2f}x the speed of {peer_name} ({ms:.3f} ms vs {peer_ms:.3f} ms); needs at least "
        f"{at_least:g}x",
    )


def speed_vs_roof(report: Report, what: str, fn, nbytes: float, at_least: float) -> bool | None:
    """Speed check on a GPU against the memory roof: ``fn()``, which must move ``nbytes`` bytes (reads
    plus writes), against a device-to-device copy moving as many bytes, timed now. Passes when the
    copy's time over ``fn``'s is at least ``at_least``. On the CPU the check is not graded.
    """
    import torch

    from ..world import world

    if not world().gpu:
        report.not_graded(f"{what}: speed needs a GPU (not graded here)")
        return None
    half = max(int(nbytes) // 2, 1)  # a copy reads and writes each byte once
    src = torch.randint(0, 256, (half,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms, copy_ms = _median_ms(report, what, fn), _median_ms(report, "copy", lambda: dst.copy_(src))
    if ms is None or copy_ms is None:
        return False
    gbs = nbytes / (ms * 1e-3) / 1e9
    fraction = copy_ms / ms
    return report.expect(
        fraction >= at_least,
        f"{what}: {gbs:.0f} GB/s, {fraction:.0%} of a copy's bandwidth measured now (needs {at_least:.0%})",
        f"{what}: {gbs:.0f} GB/s, {fraction:.0%} of a copy's bandwidth measured now; needs at least "
        f"{at_least:.0%}: is each element read once, and are loads and stores contiguous?",
    )


# ---- the whole notebook's report, inside the notebook ---------------------------------------------

_RESULTS: dict[str, tuple[bool, bool, str]] = {}  # exercise id -> (passed, not graded here, its lines)


def report(chapter: str | None = None) -> bool:
    """Print this notebook's grade report: the table and score of ``make grade``, made from the grader
    cells already run in this kernel (nothing runs again, and nothing beyond the package is needed, so
    it works on Colab). Exercises whose grader cell has not run yet are listed as failed, saying so.

    ``chapter`` ("01") defaults to the chapters of the grader cells run so far. Returns True when no
    exercise failed or is missing.
    """
    from ..grade import GRADER, Row, _message, render

    chapters = {chapter} if chapter else {k.split(".")[0] for k in _RESULTS}
    try:  # grader cells typed into this notebook, run or not
        from IPython import get_ipython

        shell = get_ipython()
        chapters |= {m.split(".")[0] for m in GRADER.findall("\n".join(shell.user_ns.get("In", [])))} if shell else set()
    except ImportError:
        pass
    if not chapters:
        print("No grader cell has run in this notebook yet: run its cells (on Colab: Runtime → Run all), "
              "then call kc.grading.report() again.")
        return False
    rows = []
    for ch in sorted(chapters):
        for ex in exercises(ch):
            if ex.id not in _RESULTS:
                rows.append(Row(ch, ex.id, False, "not run yet: run the exercise's cells and the grader cell under it"))
                continue
            passed, skipped, lines = _RESULTS[ex.id]
            rows.append(Row(ch, ex.id, passed and not skipped, _message(passed, lines), passed and skipped))
    print(render(rows))
    return all(r.passed or r.not_graded for r in rows)
