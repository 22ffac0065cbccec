"""Generate exercises/NN_slug.ipynb from solutions/NN_slug.ipynb, the single source of the exercises.

In a solution notebook, an answer sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
(nbgrader's markers). The generated exercise keeps everything else, replaces each answer with a stub
that says roughly how long the answer is, clears all outputs, and starts with a note that it is
generated in its metadata. Inside a ``@cuda.jit`` or ``@triton.jit`` kernel the stub is ``pass`` (a kernel cannot
raise); elsewhere it raises ``NotImplementedError``.

    python tools/exercises.py          # write exercises/
    python tools/exercises.py --check  # exit 1 if exercises/ is not what this would write
    python tools/exercises.py --mywork # copy each exercise into mywork/ unless it is there already

Nothing a learner wrote is overwritten. Learners work in ``mywork/`` (git ignores it, and nothing here
writes over a notebook in it). An exercise notebook in ``exercises/`` whose cells differ from the stub
it was generated as (its metadata keeps a hash of the generated cells) holds someone's answers: it is
not overwritten, and ``--force`` first moves it into ``mywork/``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time

import nbformat

from pathlib import Path

from notebooks import ROOT, all_notebooks, dumps, read

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MARKDOWN_STUB = "*Your answer here.*"
KERNEL_DECORATOR = re.compile(r"^\s*@(cuda\.jit|triton\.jit|jit)\b")


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _inside_kernel(lines: list[str], at: int) -> bool:
    """Is line ``at`` inside a function whose decorators include a kernel decorator?"""
    depth = len(_indent(lines[at]))
    for i in range(at - 1, -1, -1):
        line = lines[i]
        if line.strip() and len(_indent(line)) < depth and line.lstrip().startswith("def "):
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("@"):
                if KERNEL_DECORATOR.match(lines[j]):
                    return True
                j -= 1
            return False
    return False


def _stub(lines: list[str], begin: int, answer: list[str]) -> list[str]:
    n = sum(1 for a in answer if a.strip() and not a.strip().startswith("#"))
    size = f"about {n} line{'s' if n != 1 else ''}"
    pad = _indent(lines[begin])
    if _inside_kernel(lines, begin):
        return [f"{pad}# YOUR CODE HERE ({size})", f"{pad}pass"]
    return [f"{pad}# YOUR CODE HERE ({size})",
            f'{pad}raise NotImplementedError("replace this line with your answer ({size})")']


def strip_solutions(source: str, markdown: bool = False) -> str:
    lines = source.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() != BEGIN:
            out.append(lines[i])
            i += 1
            continue
        try:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == END)
        except StopIteration:
            raise ValueError(f"{BEGIN} without {END}:\n{source}") from None
        out += [MARKDOWN_STUB] if markdown else _stub(lines, i, lines[i + 1:end])
        i = end + 1
    return "\n".join(out)


MYWORK = ROOT / "mywork"  # the learner's own copies; in .gitignore, and never written over


def note_cell(stem: str):
    cell = nbformat.v4.new_markdown_cell(
        "> **Your exercise notebook.** Fill in the cells marked `YOUR CODE HERE` and run the grader cell "
        "under each one. The last cell, `kc.grading.report()`, shows your score for the whole notebook. "
        "On your own machine, work in your copy in `mywork/` (`make mywork` makes it; no course command "
        f"ever writes over it) and grade it with `make grade NB=mywork/{stem}.ipynb`. "
        f"`solutions/{stem}.ipynb` holds one way to write each answer: open it when you are stuck, or to "
        "compare once your answer passes."
    )
    cell.id = "learner-note"
    return cell


def report_cells():
    title = nbformat.v4.new_markdown_cell("## Your score\n\nEvery exercise of this notebook, from the grader "
                                          "cells you have run (run them all first).")
    title.id = "score-title"
    code = nbformat.v4.new_code_cell("kc.grading.report()")
    code.id = "score"
    return [title, code]


def cells_hash(nb) -> str:
    """What a learner edits: the cells' types and sources (outputs and metadata aside)."""
    cells = [(c.cell_type, c.source) for c in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:16]


TITLE = re.compile(r"^(# .*):\s*solutions\s*$", re.MULTILINE | re.IGNORECASE)


def exercise_notebook(solution) -> nbformat.NotebookNode:
    nb = copy.deepcopy(solution)
    # Only what a reader's notebook needs, so executing a solution (which records the kernel's
    # versions and a stamp in its metadata) does not change the generated exercise.
    keep = ("kernelspec", "accelerator", "colab")
    nb.metadata = nbformat.NotebookNode({k: nb.metadata[k] for k in keep if k in nb.metadata})
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
        elif cell.cell_type == "markdown":
            # "# 01 · CUDA vector add: solutions" becomes "...: exercises"
            cell.source = TITLE.sub(r"\1: exercises", strip_solutions(cell.source, markdown=True), count=1)
        cell.metadata.pop("execution", None)
    return nb


def generate() -> dict:
    """{exercise path: text} for every solution notebook."""
    result = {}
    for path in all_notebooks(("solutions",)):
        nb = exercise_notebook(read(path))
        # the note goes under the title, so a page opens with the chapter's name
        title = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and
                      c.source.lstrip().startswith("# ")), -1)
        nb.cells.insert(title + 1, note_cell(path.stem))
        nb.cells += report_cells()
        nb.metadata["kernelcourse"] = {"generated_from": f"solutions/{path.name}", "cells": cells_hash(nb)}
        result[ROOT / "exercises" / path.name] = dumps(nb)
    return result


def edited(path) -> str | None:
    """Why the exercise notebook at ``path`` holds someone's work, or None if it is as generated."""
    nb = read(path)
    if any(c.cell_type == "code" and (c.outputs or c.execution_count) for c in nb.cells):
        return "it has outputs, so someone has run it"
    stamp = nb.metadata.get("kernelcourse", {}).get("cells")
    if stamp is None:  # written by an older generator: as committed in git, or possibly someone's answers
        if _committed(path) == path.read_bytes():
            return None
        return "it differs from the repository's copy and does not say what it was generated as"
    if stamp != cells_hash(nb):
        return "its cells differ from the stub it was generated as, so it holds someone's answers"
    return None


def _committed(path) -> bytes | None:
    """The file as the repository's last commit has it (None without git or outside a clone)."""
    try:
        rel = path.relative_to(ROOT).as_posix()
        done = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{rel}"], capture_output=True, timeout=30)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _safe_name(stem: str) -> Path:
    target = MYWORK / f"{stem}.ipynb"
    if target.exists():
        target = MYWORK / f"{stem}.{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
    return target


def mywork() -> int:
    """Copy every exercise into mywork/ unless a copy is there already."""
    MYWORK.mkdir(exist_ok=True)
    for path in all_notebooks(("exercises",)):
        target = MYWORK / path.name
        if target.exists():
            print(f"kept   {target.relative_to(ROOT)} (yours; never overwritten)")
        else:
            shutil.copyfile(path, target)
            print(f"copied {target.relative_to(ROOT)}")
    print("Work in mywork/, and grade with `make grade` (all of mywork/) or `make grade NB=mywork/NN_slug.ipynb`.")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if exercises/ is out of date")
    ap.add_argument("--force", action="store_true",
                    help="regenerate exercise notebooks that hold someone's work, after moving them into mywork/")
    ap.add_argument("--mywork", action="store_true", help="copy each exercise into mywork/ unless it is there")
    args = ap.parse_args()
    if args.mywork:
        return mywork()
    wanted = generate()
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    extra = [p for p in all_notebooks(("exercises",)) if p not in wanted]
    if args.check:
        for p in stale:
            why = edited(p) if p.exists() else None
            if why:
                print(f"{p.relative_to(ROOT)}: {why}. Keep your answers in mywork/ instead: "
                      f"`mkdir -p mywork && mv {p.relative_to(ROOT)} mywork/`, then `make exercises`.")
            else:
                print(f"{p.relative_to(ROOT)} is not what solutions/{p.name} generates: run `make exercises`")
        for p in extra:
            print(f"{p.relative_to(ROOT)} has no solutions/{p.name}")
        return 1 if stale or extra else 0
    (ROOT / "exercises").mkdir(exist_ok=True)
    kept = 0
    for p in stale:
        why = edited(p) if p.exists() else None
        if why and not args.force:
            kept += 1
            print(f"not overwriting {p.relative_to(ROOT)}: {why}. Move it into mywork/ "
                  f"(`mkdir -p mywork && mv {p.relative_to(ROOT)} mywork/`), then run `make exercises` again; "
                  "or run `python tools/exercises.py --force`, which moves it there for you.")
            continue
        if why:
            MYWORK.mkdir(exist_ok=True)
            backup = _safe_name(p.stem)
            shutil.move(p, backup)
            print(f"moved {p.relative_to(ROOT)} to {backup.relative_to(ROOT)} (it held someone's work)")
        p.write_text(wanted[p], encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    for p in extra:
        print(f"warning: {p.relative_to(ROOT)} has no solutions/{p.name}; remove it by hand")
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
