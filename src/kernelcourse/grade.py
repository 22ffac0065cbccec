"""Grade exercise notebooks: ``python -m kernelcourse.grade NOTEBOOK... [--json]`` (or ``make grade``).

Each notebook runs top to bottom in a fresh kernel through nbclient (Jupyter's own executor: the
package declares it, so nothing else is needed); a cell that raises does not stop the run, as in
Jupyter's "Run all" with errors allowed. What every grader cell printed is collected into a report:
chapter, exercise, pass or fail, and the grader's message. The notebooks themselves are only read,
never written. An exercise with a speed check that this machine cannot make (no GPU) shows as "not
graded", never as passed. The exit status is 0 when no exercise failed, 1 otherwise, so CI can use it.

Inside a notebook (on Colab, say), ``kc.grading.report()`` prints the same table for the grader
cells already run in that notebook, without running anything again.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import nbformat

from . import grading
from .grading.reporting import GRADER, Row, not_graded_in, render, summary

INSTALL_HINT = ("grading a notebook from the command line needs nbclient and ipykernel: "
                "run `pip install nbclient ipykernel` and try again")


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _error(cell) -> dict | None:
    return next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)


def _failure_summary(error: dict | None) -> str:
    if error is None:
        return "the cell failed"
    if error.get("ename") == "KeyboardInterrupt":
        return "the cell ran past the time limit: is there a loop that never ends?"
    evalue = (error.get("evalue") or "").strip().splitlines()
    return f"{error.get('ename', 'Error')}: {evalue[0]}" if evalue else error.get("ename", "the cell failed")


def run_notebook(path: Path, cell_timeout: int = 600) -> tuple[dict[int, tuple[bool, str]], str | None]:
    """Execute a copy of the notebook at ``path`` in a fresh kernel, in the notebook's folder.

    Returns {code cell index: (passed, what it printed or why it failed)} for the cells that ran, and a
    line saying why the run stopped early (the kernel died), or None.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, interrupt_on_timeout=True, allow_errors=True,
                            kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    results: dict[int, tuple[bool, str]] = {}
    stopped = None
    # The kernel process's own log (a warning about local TCP ports) is noise here: what learner code
    # prints reaches the cells' outputs, not this stream.
    with client.setup_kernel(stderr=subprocess.DEVNULL):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, index)
            except DeadKernelError:
                stopped = ("the notebook's kernel crashed (an out-of-bounds access can do this); "
                           "later cells could not run")
                break
            error = _error(cell)
            text = _stream_text(cell)
            if error is not None and not text.strip():
                text = _failure_summary(error)
            results[index] = (error is None, text)
    return results, stopped


def grade(paths: list[Path], cell_timeout: int = 600) -> list[Row]:
    rows = []
    for path in paths:
        path = Path(path)
        results, stopped = run_notebook(path, cell_timeout)
        nb = nbformat.read(path, as_version=4)
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        seen = set()
        for index, cell in enumerate(nb.cells):
            match = GRADER.search(cell.source) if cell.cell_type == "code" else None
            if not match:
                continue
            ex = match.group(1)
            seen.add(ex)
            result = results.get(index)
            if result is None:
                rows.append(Row(path.stem, ex, False, stopped or "the grader cell did not run"))
            else:
                skipped = not_graded_in(*result)
                rows.append(Row(path.stem, ex, result[0] and not skipped, summary(*result), skipped))
        expected = _expected(path.stem)
        for ex in sorted(expected - seen):
            rows.append(Row(path.stem, ex, False, "no grader cell for this exercise: was it deleted?"))
        if not code_cells:
            rows.append(Row(path.stem, "-", False, "the notebook has no code cells"))
    return rows


def _expected(stem: str) -> set[str]:
    chapter = stem[:2]
    try:
        return {e.id for e in grading.exercises(chapter)}
    except ModuleNotFoundError:
        return set()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernelcourse.grade", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--cell-timeout", type=int, default=600, help="seconds allowed per cell")
    args = ap.parse_args(argv)
    missing = [p for p in args.notebooks if not p.exists()]
    if missing:
        print(f"no such notebook: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    try:
        import ipykernel  # noqa: F401  (the kernel the notebooks run in)
        import nbclient  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    rows = grade(args.notebooks, args.cell_timeout)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "passed": sum(r.passed for r in rows),
                          "not_graded": sum(r.not_graded for r in rows), "total": len(rows)}, indent=1))
    else:
        print(render(rows))
    return 0 if rows and all(r.passed or r.not_graded for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
