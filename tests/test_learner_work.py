"""A learner's answers survive every course command, and each chapter has one name everywhere.

In a copy of the repository, an exercise is filled in twice: in mywork/ (where learners work) and in
exercises/ itself (where a learner may still edit). Then the make targets that a learner or a
maintainer runs go over the copy: help, grade, mywork, exercises (also after a solution changed, and
with --force), the generated-notebook checks of `make test`, book and clean. Every answer must still
be there afterwards. (`make test` itself is not run here: it would run this test suite again; its
steps that read notebooks are run one by one. `make lab` starts a server and `make stamp` needs a GPU;
neither writes to exercises/ or mywork/.)
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.helpers import env_importing

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)  # the environment running the tests: its tools stand in for the copy's .venv
STUB = 'raise NotImplementedError("replace this line with your answer (about 1 line)")'
ANSWER = "return (n + block - 1) // block  # my answer"


def _copy_repo(dest: Path) -> Path:
    """The files of a fresh clone (tracked, or new and not ignored), as this checkout has them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    # Older than the environment's install stamp, so make never tries to reinstall it.
    for name in ("requirements.txt", "pyproject.toml"):
        os.utime(dest / name, (0, 0))
    return dest


def _make(repo: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = env_importing(repo / "src")
    done = subprocess.run(["make", "--no-print-directory", "-o", f"{VENV}/.installed", f"VENV={VENV}", *args],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    if ok:
        assert done.returncode == 0, f"make {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _fill(path: Path) -> None:
    """Answer exercise 01.2 (grid_size) the way a learner does: replace the stub in its cell."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def grid_size" in c.source)
    assert STUB in cell.source, cell.source
    cell.source = cell.source.replace(STUB, ANSWER)
    nbformat.write(nb, path)


def _answers(repo: Path) -> dict[str, bool]:
    return {p.relative_to(repo).as_posix(): ANSWER in p.read_text(encoding="utf-8")
            for p in sorted([*repo.glob("mywork/*.ipynb"), *repo.glob("exercises/*.ipynb")])}


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None or not (VENV / "bin" / "jupyter-book").exists(),
                    reason="needs make and the course's environment (jupyter-book)")
def test_no_course_command_loses_a_learners_answer(tmp_path):
    repo = _copy_repo(tmp_path / "course")
    assert "make mywork" in _make(repo, "help").stdout

    nothing = _make(repo, "grade", ok=False)  # no notebook given and mywork/ empty: say what to do
    assert nothing.returncode == 2 and "make mywork" in nothing.stdout

    _make(repo, "mywork")
    mine, edited = repo / "mywork" / "01_vector_add.ipynb", repo / "exercises" / "01_vector_add.ipynb"
    _fill(mine)
    _fill(edited)
    mine_before, edited_before = mine.read_bytes(), edited.read_bytes()

    again = _make(repo, "mywork")  # keeps the learner's copy
    assert "kept   mywork/01_vector_add.ipynb" in again.stdout and mine.read_bytes() == mine_before

    # a maintainer changes a solution, then regenerates: the edited exercise is not overwritten
    solution = repo / "solutions" / "01_vector_add.ipynb"
    nb = nbformat.read(solution, as_version=4)
    nb.cells[-1].source += "\n"
    nbformat.write(nb, solution)
    refused = _make(repo, "exercises", ok=False)
    assert refused.returncode != 0 and "not overwriting exercises/01_vector_add.ipynb" in refused.stdout, refused.stdout
    assert "mywork/" in refused.stdout
    assert edited.read_bytes() == edited_before and mine.read_bytes() == mine_before

    # make test's checks of the generated notebooks say to move the work, not to regenerate over it
    check = subprocess.run([sys.executable, "tools/exercises.py", "--check"], cwd=repo, capture_output=True,
                           text=True, env=env_importing(repo / "src"))
    assert check.returncode == 1 and "mv exercises/01_vector_add.ipynb mywork/" in check.stdout, check.stdout
    assert edited.read_bytes() == edited_before

    # grading reads the learner's notebook and never writes it
    graded = _make(repo, "grade", "NB=mywork/01_vector_add.ipynb", ok=False)
    assert re.search(r"01\.2\s+pass", graded.stdout), graded.stdout + graded.stderr
    assert mine.read_bytes() == mine_before

    # --force regenerates, after moving the edited notebook into mywork/ beside the learner's copy
    forced = subprocess.run([sys.executable, "tools/exercises.py", "--force"], cwd=repo, capture_output=True,
                            text=True, env=env_importing(repo / "src"))
    assert forced.returncode == 0, forced.stdout + forced.stderr
    moved = [p for p in (repo / "mywork").glob("01_vector_add.*.ipynb")]
    assert len(moved) == 1 and moved[0].read_bytes() == edited_before, forced.stdout
    assert mine.read_bytes() == mine_before and ANSWER not in edited.read_text(encoding="utf-8")

    _make(repo, "book")
    _make(repo, "clean")
    answers = _answers(repo)
    assert answers["mywork/01_vector_add.ipynb"] and answers[moved[0].relative_to(repo).as_posix()], answers


def _chapter_names() -> dict[str, dict[str, str]]:
    names: dict[str, dict[str, str]] = {}
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        if m := re.match(r"\|\s*(\d\d)\s*\|\s*([^|]+?)\s*\|", line):
            names.setdefault(m[1], {})["README"] = m[2]
    for m in re.finditer(r"\|\s*(\d\d)\s*\|\s*\[([^\]]+)\]\(", (ROOT / "book" / "intro.md").read_text(encoding="utf-8")):
        names.setdefault(m[1], {})["book/intro.md"] = m[2]
    suffix = {"notebooks": "", "solutions": ": solutions", "exercises": ": exercises"}
    for folder, end in suffix.items():
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            title = next(line for c in nb.cells if c.cell_type == "markdown"
                         for line in c.source.splitlines() if line.startswith("# "))
            m = re.match(rf"# (\d\d) · (.+){re.escape(end)}$", title)
            assert m, f"{folder}/{path.name}: title {title!r} is not '# NN · name{end}'"
            names.setdefault(m[1], {})[f"{folder}/{path.name}"] = m[2]
    return names


def test_one_name_per_chapter():
    """The README, the landing page, the lesson (the sidebar's entry) and the exercise and solution
    pages all call a chapter the same thing."""
    for chapter, seen in sorted(_chapter_names().items()):
        assert len(set(seen.values())) == 1, f"chapter {chapter} has several names: {seen}"
