"""Graders for the course's exercises (introduced in chapter 01; see the "How grading works" page).

A grader cell is one call: ``kc.grading.check("01.1", globals())``. It looks up the names the
exercise defines, runs the learner's code on fresh random inputs of several sizes and seeds, prints
one deterministic line per check, and raises ``GradeFailure`` if any check failed, so that nbval (and
``make grade``) count the cell as failed. Learner code that raises, hangs or returns nonsense gets a
one-line explanation instead of a traceback from inside the grader. ``kc.grading.report()`` prints the
notebook's table of exercises from the grader cells already run.

Where to look: ``chNN.py`` holds chapter NN's graders, one function per exercise (its cases, its
comparisons, its messages). What they share lives once in ``harness.py`` (cases, poisoned buffers,
the tolerance, ``compare``, Triton launches, naming a typical mistake), which gathers the modules
below it: ``reporting.py`` (a ``Report`` of lines, the table), ``running.py`` (learner code under a
time limit, in a child process), ``speed.py`` (speed checks on a GPU) and ``addresses.py`` (the
interpreter's check of every load and store). ``attention64.py`` holds chapters 06-07's float64
attention, exact and with the typical bugs. Imports run one way: a chapter takes the harness's names
from ``harness`` or from this package, which re-exports them; this package imports the harness, and
loads a chapter's graders only when one of its exercises is checked, so nothing imports a chapter.
"""
from __future__ import annotations

import importlib

# The harness's names that notebooks and tests reach as ``kc.grading.<name>``:
from .harness import (DEFAULT_TIME_LIMIT_S, FAIL, NOT_GRADED, PASS, POISON, SEED_VARIABLE, Exercise,  # noqa: F401
                      GradeFailure, Report, Stop, TimeLimit, as_number, as_tuple, call, compare, exercise, explain,
                      fresh_rng, guarded, number, poisoned, speed_vs_peer, speed_vs_roof, time_limit, tolerance_of,
                      where)
from .reporting import EXERCISES as _EXERCISES
from .reporting import GRADER, Row, render, summary
from .running import can_isolate, grade_here, grade_in_child


def exercises(chapter: str) -> list[Exercise]:
    _load(chapter)
    return [e for k, e in sorted(_EXERCISES.items()) if k.startswith(chapter + ".")]


def _load(chapter: str) -> None:
    importlib.import_module(f".ch{chapter}", __name__)


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
        if can_isolate():
            grade_in_child(ex, objects, report)
        else:
            grade_here(ex, objects, report)
    _RESULTS[ex.id] = (report.failures == 0, report.skipped > 0, "\n".join(report.lines))  # for report()
    if report.failures:
        raise GradeFailure(f"exercise {ex.id} ({ex.title}): {report.failures} check(s) failed")
    if report.skipped:
        print(f"Exercise {ex.id} ({ex.title}): every check made here passed; {report.skipped} not graded here.")
    else:
        print(f"Exercise {ex.id} ({ex.title}) passed.")


# ---- the whole notebook's report, inside the notebook ---------------------------------------------

_RESULTS: dict[str, tuple[bool, bool, str]] = {}  # exercise id -> (passed, not graded here, its lines)


def report(chapter: str | None = None) -> bool:
    """Print this notebook's grade report: the table and score of ``make grade``, made from the grader
    cells already run in this kernel (nothing runs again, and nothing beyond the package is needed, so
    it works on Colab). Exercises whose grader cell has not run yet are listed as failed, saying so.

    ``chapter`` ("01") defaults to the chapters of the grader cells run so far. Returns True when no
    exercise failed or is missing.
    """
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
            rows.append(Row(ch, ex.id, passed and not skipped, summary(passed, lines), passed and skipped))
    print(render(rows))
    return all(r.passed or r.not_graded for r in rows)
