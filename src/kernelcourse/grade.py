"""Grade exercise notebooks: ``python -m kernelcourse.grade NOTEBOOK... [--json]`` (or ``make grade NB=...``).

Each notebook runs top to bottom through nbval (``pytest --nbval-lax``) in a fresh kernel; the output
of every grader cell is collected into a report: chapter, exercise, pass or fail, and the grader's
message. The notebooks themselves are only read, never written. An exercise with a speed check that
this machine cannot make (no GPU) shows as "not graded", never as passed. The exit status is 0 when
no exercise failed, 1 otherwise, so CI can use it.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import nbformat
import pytest

MESSAGE_WIDTH = 90  # the report's message column wraps here, so a terminal shows it whole
GRADER = re.compile(r"""kc\.grading\.check\(\s*["'](\d\d\.\d+)["']\s*,\s*globals\(\)\s*\)""")


@dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    message: str
    not_graded: bool = False  # every check made here passed, and some could not be made here (speed on the CPU)


class _Collector:
    """A pytest plugin that keeps what each grader cell printed and whether it passed."""

    def __init__(self):
        self.cells: dict[tuple[str, str], tuple[bool, str]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when != "call" or not hasattr(item, "cell"):
            return
        text = "".join(o.get("text", "") for o in (item.test_outputs or []) if o.get("output_type") == "stream")
        if report.failed and not text.strip():
            text = _failure_summary(str(report.longrepr))
        self.cells[(Path(str(item.fspath)).resolve().as_posix(), _key(item.cell))] = (report.passed, text)


def _key(cell) -> str:
    return cell.get("id") or cell.source


def _failure_summary(longrepr: str) -> str:
    if "Timeout" in longrepr:
        return "the cell ran past the time limit: is there a loop that never ends?"
    if "Kernel dead" in longrepr or "died" in longrepr.lower():
        return "the notebook's kernel crashed (an out-of-bounds access can do this); later cells could not run"
    last = [line for line in longrepr.splitlines() if line.strip()]
    return last[-1].strip() if last else "the cell failed"


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _not_graded(passed: bool, text: str) -> bool:
    return passed and any(line.startswith("–") for line in _lines(text))


def _message(passed: bool, text: str) -> str:
    lines = _lines(text)
    if passed:
        checks = sum(1 for line in lines if line.startswith("✔"))
        skipped = [line[1:].strip() for line in lines if line.startswith("–")]
        if skipped:
            return f"{checks} checks passed; not graded here: {'; '.join(skipped)}"
        return f"{checks} checks passed"
    failed = [line for line in lines if line.startswith("✘")]
    return (failed[0][1:].strip() if failed else (lines[-1] if lines else "failed"))


def grade(paths: list[Path], cell_timeout: int = 600) -> list[Row]:
    collector = _Collector()
    args = ["-p", "no:cacheprovider", "-q", "--no-header", "--tb=no", "-p", "no:warnings",
            "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={cell_timeout}",
            *[str(p) for p in paths]]
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(args, plugins=[collector])
    rows = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        seen = set()
        for cell in nb.cells:
            match = GRADER.search(cell.source) if cell.cell_type == "code" else None
            if not match:
                continue
            ex = match.group(1)
            seen.add(ex)
            result = collector.cells.get((path.resolve().as_posix(), _key(cell)))
            if result is None:
                rows.append(Row(path.stem, ex, False, "the grader cell did not run"))
            else:
                skipped = _not_graded(*result)
                rows.append(Row(path.stem, ex, result[0] and not skipped, _message(*result), skipped))
        expected = _expected(path.stem)
        for ex in sorted(expected - seen):
            rows.append(Row(path.stem, ex, False, "no grader cell for this exercise: was it deleted?"))
        if not code_cells:
            rows.append(Row(path.stem, "-", False, "the notebook has no code cells"))
    return rows


def _expected(stem: str) -> set[str]:
    from . import grading

    chapter = stem[:2]
    try:
        return {e.id for e in grading.exercises(chapter)}
    except ModuleNotFoundError:
        return set()


def render(rows: list[Row]) -> str:
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
    rows = grade(args.notebooks, args.cell_timeout)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "passed": sum(r.passed for r in rows),
                          "not_graded": sum(r.not_graded for r in rows), "total": len(rows)}, indent=1))
    else:
        print(render(rows))
    return 0 if rows and all(r.passed or r.not_graded for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
