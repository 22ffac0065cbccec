"""Grading wherever the notebooks run: in the notebook itself (Colab has no nbval), and from the
command line without pytest or nbval."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat

import kernelcourse as kc
from kernelcourse.grade import grade, render
from tests.helpers import env_importing

ROOT = Path(__file__).resolve().parent.parent


def _grid_size(n, block):
    return (n + block - 1) // block


def _grid_size_floor(n, block):
    return n // block


def test_report_in_the_notebook_matches_make_grade(capsys, monkeypatch):
    monkeypatch.setattr(kc.grading, "_RESULTS", {})
    kc.grading.check("01.2", {"grid_size": _grid_size})
    try:
        kc.grading.check("01.3", {})  # its names are not defined: the grader cell fails
    except kc.grading.GradeFailure:
        pass
    capsys.readouterr()
    assert kc.grading.report() is False
    table = capsys.readouterr().out
    assert re.search(r"^01\s+01\.2\s+pass\s+\d+ checks passed", table, re.M), table
    assert re.search(r"^01\s+01\.3\s+FAIL\s+.*not defined", table, re.M), table
    others = [e.id for e in kc.grading.exercises("01") if e.id not in ("01.2", "01.3")]
    for ex in others:
        assert re.search(rf"^01\s+{re.escape(ex)}\s+FAIL\s+not run yet", table, re.M), table
    assert table.strip().endswith(f"Score: 1/{len(others) + 2} exercises passed"), table


def test_report_before_any_grader_cell_says_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr(kc.grading, "_RESULTS", {})
    assert kc.grading.report() is False
    assert "Run all" in capsys.readouterr().out


def test_report_counts_a_failed_answer(capsys, monkeypatch):
    monkeypatch.setattr(kc.grading, "_RESULTS", {})
    try:
        kc.grading.check("01.2", {"grid_size": _grid_size_floor})
    except kc.grading.GradeFailure:
        pass
    capsys.readouterr()
    kc.grading.report("01")
    table = capsys.readouterr().out
    assert re.search(r"^01\s+01\.2\s+FAIL\s+grid_size", table, re.M), table
    assert f"Score: 0/{len(kc.grading.exercises('01'))}" in table


def _small_notebook(path: Path, answer: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import kernelcourse as kc\nkc.setup(quiet=True)"),
                nbformat.v4.new_code_cell(f"def grid_size(n, block):\n    {answer}"),
                nbformat.v4.new_code_cell('kc.grading.check("01.2", globals())'),
                nbformat.v4.new_code_cell("kc.grading.report()")]
    nbformat.write(nb, path)
    return path


def _grade_without(path: Path, modules, timeout: int) -> subprocess.CompletedProcess:
    """The grading command (``kernelcourse.grade.main``) on ``path``, in a child Python that cannot
    import ``modules``."""
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = f"import sys; {hide}\nfrom kernelcourse.grade import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          env=env_importing(ROOT / "src"), timeout=timeout)


def test_command_line_grades_without_pytest_or_nbval(tmp_path):
    """The CLI runs notebooks through nbclient: with pytest and nbval made unimportable, it still grades."""
    path = _small_notebook(tmp_path / "01_vector_add.ipynb", "return (n + block - 1) // block")
    done = _grade_without(path, ("pytest", "nbval"), timeout=300)
    assert re.search(r"01_vector_add\s+01\.2\s+pass", done.stdout), done.stdout + done.stderr
    # the other exercises have no grader cell here, so the run fails, and says why
    assert done.returncode == 1 and "no grader cell" in done.stdout
    assert f"Score: 1/{len(kc.grading.exercises('01'))} exercises passed" in done.stdout


def test_command_line_without_nbclient_says_what_to_install(tmp_path):
    path = _small_notebook(tmp_path / "01_vector_add.ipynb", "return 1")
    done = _grade_without(path, ("nbclient",), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().count("\n") == 0 and "pip install nbclient ipykernel" in done.stderr, done.stderr


def test_a_crashing_cell_does_not_stop_grading(tmp_path):
    path = _small_notebook(tmp_path / "01_vector_add.ipynb", "return (n + block - 1) // block")
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(1, nbformat.v4.new_code_cell("raise RuntimeError('a mistake above the exercise')"))
    nbformat.write(nb, path)
    rows = {r.exercise: r for r in grade([path])}
    assert rows["01.2"].passed, render(list(rows.values()))


def test_a_crash_of_the_kernel_is_named_and_earlier_grades_kept(tmp_path):
    path = _small_notebook(tmp_path / "01_vector_add.ipynb", "return (n + block - 1) // block")
    nb = nbformat.read(path, as_version=4)
    nb.cells[3:3] = [nbformat.v4.new_code_cell("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"),
                     nbformat.v4.new_code_cell('kc.grading.check("01.3", globals())')]
    nbformat.write(nb, path)
    rows = {r.exercise: r for r in grade([path])}
    assert rows["01.2"].passed, render(list(rows.values()))
    assert not rows["01.3"].passed and "kernel crashed" in rows["01.3"].message, render(list(rows.values()))
