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
    assert rows and all(r.passed or r.not_graded for r in rows), render(rows)
    if kc.world().gpu:  # every speed check is graded on a GPU
        assert all(r.passed for r in rows), render(rows)


def test_report_survives_bad_learner_code_and_leaves_the_notebook_alone(tmp_path):
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / "01_vector_add.ipynb", as_version=4)
    for cell in nb.cells:
        if "def grid_size" in cell.source:
            cell.source = "def grid_size(n, block):\n    return (n + block - 1) //"  # a syntax error
        if "def vector_add_gbps" in cell.source:
            cell.source = cell.source.replace("    bytes_moved =", "    while True:\n        pass\n    bytes_moved =")
    path = tmp_path / "01_vector_add.ipynb"
    nbformat.write(nb, path)
    before = path.read_bytes()
    rows = {r.exercise: r for r in grade([path])}
    assert path.read_bytes() == before
    assert not rows["01.2"].passed and "not defined" in rows["01.2"].message, render(list(rows.values()))
    assert not rows["01.5"].passed and "never ends" in rows["01.5"].message, render(list(rows.values()))
    assert all(rows[e].passed for e in ("01.1", "01.3", "01.4")), render(list(rows.values()))
