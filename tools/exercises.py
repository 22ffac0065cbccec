"""Generate exercises/NN_slug.ipynb from solutions/NN_slug.ipynb, the single source of the exercises.

In a solution notebook, an answer sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION``
(nbgrader's markers). The generated exercise keeps everything else, replaces each answer with a stub
that says roughly how long the answer is, clears all outputs, and starts with a note that it is
generated. Inside a ``@cuda.jit`` or ``@triton.jit`` kernel the stub is ``pass`` (a kernel cannot
raise); elsewhere it raises ``NotImplementedError``.

    python tools/exercises.py          # write exercises/
    python tools/exercises.py --check  # exit 1 if exercises/ is not what this would write
"""
from __future__ import annotations

import argparse
import copy
import re
import sys

import nbformat

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


def note_cell(stem: str):
    cell = nbformat.v4.new_markdown_cell(
        f"> **Your exercise notebook.** Fill in the cells marked `YOUR CODE HERE` and run the grader cell "
        f"under each; `make grade NB=exercises/{stem}.ipynb` grades the whole notebook. It is generated from "
        f"`solutions/{stem}.ipynb`, which holds one way to write each answer: open it when you are stuck, or to "
        "compare once your answer passes."
    )
    cell.id = "generated-note"
    return cell


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
        nb.cells.insert(0, note_cell(path.stem))
        result[ROOT / "exercises" / path.name] = dumps(nb)
    return result


def _worked_in(path) -> bool:
    """A generated exercise has no outputs; one that has them holds a learner's work."""
    return any(c.cell_type == "code" and (c.outputs or c.execution_count) for c in read(path).cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if exercises/ is out of date")
    ap.add_argument("--force", action="store_true", help="overwrite exercise notebooks that hold outputs")
    args = ap.parse_args()
    wanted = generate()
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    extra = [p for p in all_notebooks(("exercises",)) if p not in wanted]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} is not what solutions/{p.name} generates: run `make exercises`")
        for p in extra:
            print(f"{p.relative_to(ROOT)} has no solutions/{p.name}")
        return 1 if stale or extra else 0
    (ROOT / "exercises").mkdir(exist_ok=True)
    for p in stale:
        if p.exists() and not args.force and _worked_in(p):
            print(f"not overwriting {p.relative_to(ROOT)}: it has outputs, so someone has worked in it. "
                  "Copy your work elsewhere, then run `python tools/exercises.py --force`.")
            continue
        p.write_text(wanted[p], encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    for p in extra:
        print(f"warning: {p.relative_to(ROOT)} has no solutions/{p.name}; remove it by hand")
    return 0


if __name__ == "__main__":
    sys.exit(main())
