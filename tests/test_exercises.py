"""Every exercise notebook, as generated, fails every one of its graders; every solution passes.

Both run through the same report that learners get from `make grade`, in a fresh kernel per run.
"""
from pathlib import Path

import pytest

import kernelcourse as kc
from kernelcourse.grade import grade, render

ROOT = Path(__file__).resolve().parent.parent
STEMS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("stem", STEMS)
def test_generated_stubs_fail_every_grader(stem):
    rows = grade([ROOT / "exercises" / f"{stem}.ipynb"])
    expected = {e.id for e in kc.grading.exercises(stem[:2])}
    assert {r.exercise for r in rows} == expected, render(rows)
    passed = [r.exercise for r in rows if r.passed]
    assert not passed, f"graders passed on generated stubs: {passed}\n{render(rows)}"
    assert all(r.message and "did not run" not in r.message for r in rows), render(rows)


@pytest.mark.parametrize("stem", STEMS)
def test_solutions_pass_every_grader(stem):
    rows = grade([ROOT / "solutions" / f"{stem}.ipynb"])
    assert rows and all(r.passed for r in rows), render(rows)
