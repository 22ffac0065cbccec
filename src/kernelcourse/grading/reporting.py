"""What a grader prints (introduced in chapter 01): the exercises, each one's ``Report`` (one line per
check, marked pass, fail or not graded), and the table of a notebook's exercises (``Row``, ``render``)
that ``kc.grading.report()`` prints inside a notebook and ``python -m kernelcourse.grade`` prints from
the command line.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable

PASS, FAIL, NOT_GRADED = "✔", "✘", "–"  # NOT_GRADED: a check this machine cannot make (speed on the CPU)
DEFAULT_TIME_LIMIT_S = 120
SEED_VARIABLE = "KC_GRADE_SEED"  # set it to draw a failing run's cases again (``harness.fresh_rng``)


class GradeFailure(AssertionError):
    """Raised at the end of a grader cell when at least one check failed."""


@dataclass
class Exercise:
    id: str
    title: str
    names: tuple[str, ...]
    grade: callable
    time_limit_s: float = DEFAULT_TIME_LIMIT_S


EXERCISES: dict[str, Exercise] = {}  # by id ("06.4"); a chapter's module fills it when first imported


def exercise(id: str, title: str, names: tuple[str, ...], time_limit_s: float = DEFAULT_TIME_LIMIT_S):
    """Register a grader: ``grade(report, **objects)`` with the learner's objects named in ``names``."""
    def register(fn):
        EXERCISES[id] = Exercise(id, title, tuple(names), fn, time_limit_s)
        return fn
    return register


@dataclass
class Report:
    """Collects one line per check; a grader calls ``ok``/``fail`` or ``expect``.

    Each line goes to ``sink`` as soon as it is made (``print`` by default; a pipe to the parent
    process when grading runs in a child, see ``running.grade_in_child``).
    """
    exercise: Exercise
    lines: list[str] = field(default_factory=list)
    failures: int = 0
    skipped: int = 0
    sink: Callable[[str], None] = lambda line: print(line, flush=True)
    seed: int | None = None  # set by ``fresh_rng``: failing lines name it, so the cases can be drawn again

    def ok(self, what: str) -> None:
        self._add(f"{PASS} {what}")

    def fail(self, what: str, hint: str | None = None) -> None:
        """A failed check; ``hint``, when given, follows the line after a colon (what to fix)."""
        if hint:
            what = f"{what}: {hint}"
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


# ---- a notebook's table: one row per exercise ------------------------------------------------------

MESSAGE_WIDTH = 90  # the report's message column wraps here, so a terminal shows it whole
GRADER = re.compile(  # a grader cell: kc.grading.check("06.4", globals())
    r"""kc\.grading\.check\(\s*["'](\d\d\.\d+)["']\s*,\s*globals\(\)\s*\)""")


@dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    message: str
    not_graded: bool = False  # every check made here passed, and some could not be made here (speed on the CPU)


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def not_graded_in(passed: bool, text: str) -> bool:
    """Did a grader cell that passed, printing ``text``, leave a check not graded here?"""
    return passed and any(line.startswith(NOT_GRADED) for line in _lines(text))


def summary(passed: bool, text: str) -> str:
    """The table's message for a grader cell that printed ``text``: how many checks passed, or the
    first failing line."""
    lines = _lines(text)
    if passed:
        checks = sum(1 for line in lines if line.startswith(PASS))
        skipped = [line[1:].strip() for line in lines if line.startswith(NOT_GRADED)]
        if skipped:
            return f"{checks} checks passed; not graded here: {'; '.join(skipped)}"
        return f"{checks} checks passed"
    failed = [line for line in lines if line.startswith(FAIL)]
    return (failed[0][1:].strip() if failed else (lines[-1] if lines else "failed"))


def render(rows: list[Row]) -> str:
    """The table: chapter, exercise, result and message, one row per exercise, then the score."""
    head = ("chapter", "exercise", "result", "message")
    body = [(r.notebook, r.exercise, "pass" if r.passed else "not graded" if r.not_graded else "FAIL", r.message)
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head[:3])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:3], widths)) + "  " + head[3]]
    indent = " " * (sum(widths) + 2 * len(widths))
    for b in body:
        message = textwrap.wrap(b[3], width=MESSAGE_WIDTH) or [""]
        lines.append("  ".join(c.ljust(w) for c, w in zip(b[:3], widths)) + "  " + message[0])
        lines += [indent + more for more in message[1:]]
    passed, skipped = sum(r.passed for r in rows), sum(r.not_graded for r in rows)
    score = f"Score: {passed}/{len(rows)} exercises passed"
    if skipped:
        score += f"; {skipped} not graded here (speed needs a GPU; the checks that could run passed)"
    lines.append(score)
    return "\n".join(lines)
