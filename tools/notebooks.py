"""What the repository's tools share about notebooks: where they are, the setup cell, the code hash.

Every notebook starts with one code cell tagged ``bootstrap``. It is written by
``python tools/notebooks.py`` from ``_config.yml`` (``repository.url`` is the one place the course's
address lives) and from the package's version in ``pyproject.toml``: on Colab the cell installs the
helper package from the release tag ``v<version>``, never from a moving branch, so a notebook gets the
package it was written against. On the website the cell is folded behind a one-line label (the tag
``hide-input`` and myst-nb's ``code_prompt_show``), its output shown; in the notebook it stays as it is,
the first cell to run. ``--check`` fails when a notebook's setup cell differs.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tokenize
import tomllib
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("notebooks", "solutions", "exercises")
BOOTSTRAP_TAG = "bootstrap"
# The website folds the setup cell (its output, the world it picked, stays shown) behind this label.
BOOTSTRAP_METADATA = {
    "tags": [BOOTSTRAP_TAG, "hide-input"],
    "mystnb": {"code_prompt_show": "Setup: installs the course's package on Colab, then picks the GPU or the CPU "
                                   "(show the code)",
               "code_prompt_hide": "Hide the setup code"},
}

BOOTSTRAP = '''\
# Setup: picks the world (GPU, or CPU with Triton's interpreter and numba's CUDA simulator).
# On Colab it first installs the course's helper package, at the release these notebooks were written
# for; Colab's own torch, triton and numpy stay as they are.
import importlib.util, subprocess, sys
if importlib.util.find_spec("kernelcourse") is None:
    package = "git+{url}@{ref}"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", package],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        raise SystemExit(f"Could not install the course's helper package ({{package}}; pip: "
                         f"{{(pip.stderr.strip().splitlines() or ['no message'])[-1]}}): connect this machine to "
                         "the internet and check that the course's address opens in a browser, or install the "
                         "package from a copy of the course with `pip install -e PATH`, then run this cell again.")
    importlib.invalidate_caches()
import kernelcourse as kc
world = kc.setup()'''


def config() -> dict:
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def release_ref() -> str:
    """The git tag of the release these notebooks belong to: ``v`` and the package's version."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"v{version}"


def bootstrap_source(url: str | None = None, ref: str | None = None) -> str:
    """The setup cell; ``url`` and ``ref`` default to the course's repository and release."""
    return BOOTSTRAP.format(url=url or config()["repository"]["url"], ref=ref or release_ref())


def all_notebooks(folders=FOLDERS) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).glob("[0-9][0-9]_*.ipynb"))


def read(path: Path):
    return nbformat.read(path, as_version=4)


def write(nb, path: Path) -> None:
    path.write_text(dumps(nb), encoding="utf-8")


def dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"


def is_bootstrap(cell) -> bool:
    return cell.cell_type == "code" and BOOTSTRAP_TAG in cell.metadata.get("tags", [])


def without_comments(source: str) -> str:
    """A cell's code with its comments taken out: what runs, whatever its comments say.

    Each comment is cut from its line (the line's trailing space with it), and a line left empty by the cut
    is dropped; every other character stays, blank lines and strings included. Only the tokenizer's COMMENT
    tokens are cut, so a ``#`` inside a string stays. A cell that does not tokenize (an IPython magic the
    tokenizer rejects, code cut off mid-string) is kept whole.
    """
    try:
        starts = [t.start for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.split("\n")
    dropped = set()
    for row, col in starts:
        kept = lines[row - 1][:col].rstrip()
        if kept:
            lines[row - 1] = kept
        else:
            dropped.add(row - 1)
    return "\n".join(line for i, line in enumerate(lines) if i not in dropped)


def code_hash(nb) -> str:
    """Hash of the code a notebook runs, bootstrap cell excluded (it changes with the repository URL).

    Comments are left out (``without_comments``): they cannot change an output, so mending one does not make
    a lesson's GPU outputs stale. Any other change to a code cell does."""
    sources = [without_comments(c.source) for c in nb.cells if c.cell_type == "code" and not is_bootstrap(c)]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def bootstrap_problem(nb) -> str | None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not code or not is_bootstrap(code[0]):
        return f"the first code cell must be the setup cell tagged '{BOOTSTRAP_TAG}'"
    if code[0].source != bootstrap_source():
        return "the setup cell differs from the one _config.yml gives"
    tags, labels = code[0].metadata.get("tags", []), code[0].metadata.get("mystnb", {})
    if any(t not in tags for t in BOOTSTRAP_METADATA["tags"]) or any(
            labels.get(k) != v for k, v in BOOTSTRAP_METADATA["mystnb"].items()):
        return "the setup cell is not folded on the website (its tags or its label differ)"
    return None


def fold(cell) -> None:
    """Give the setup cell the tags and label that fold it on the website, keeping any other tags."""
    tags = cell.metadata.setdefault("tags", [])
    tags += [t for t in BOOTSTRAP_METADATA["tags"] if t not in tags]
    cell.metadata.setdefault("mystnb", {}).update(BOOTSTRAP_METADATA["mystnb"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report notebooks whose setup cell is out of date")
    args = ap.parse_args()
    bad = 0
    for path in all_notebooks(("notebooks", "solutions")):
        nb = read(path)
        problem = bootstrap_problem(nb)
        if problem is None:
            continue
        if args.check:
            print(f"{path.relative_to(ROOT)}: {problem}; run `python tools/notebooks.py`")
            bad += 1
            continue
        code = [c for c in nb.cells if c.cell_type == "code"]
        if code and is_bootstrap(code[0]):
            code[0].source = bootstrap_source()
            fold(code[0])
        else:
            cell = nbformat.v4.new_code_cell(bootstrap_source(), metadata={"tags": [BOOTSTRAP_TAG]})
            cell.id = "setup"
            fold(cell)
            first_code = nb.cells.index(code[0]) if code else len(nb.cells)
            nb.cells.insert(first_code, cell)
        write(nb, path)
        print(f"updated the setup cell of {path.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
