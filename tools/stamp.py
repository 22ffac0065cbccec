"""Execute lesson notebooks on a real GPU and stamp them; check that committed stamps are current.

Lesson notebooks are committed executed on a GPU so that the website shows real measurements.

    python tools/stamp.py notebooks/01_vector_add.ipynb            # execute in place on this GPU, stamp
    python tools/stamp.py --record notebooks/01_vector_add.ipynb   # ...and refresh its recorded results
    python tools/stamp.py --check notebooks/*.ipynb                # CI: stamped on a GPU, code unchanged since

The stamp (notebook metadata ``kernelcourse.stamp``) holds the GPU, its compute capability, every
version that can change a result (``kernelcourse.world.VERSION_KEYS``: python, numpy, torch, triton,
numba, numba-cuda, CuPy, CUDA, nvcc, the driver), the date and a hash of the code cells. ``--check``
fails when a notebook has no GPU stamp, when its code cells no longer hash to the stamped value (its
outputs are stale), when its outputs hold an error or text on stderr (a library's warning, on a page
learners read), or when a function of the package that it prints (``inspect.getsource``) has changed
since; a stamp made before one of those versions was recorded passes with a note.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from notebooks import ROOT, code_hash, read, write

sys.path.insert(0, str(ROOT / "src"))
from kernelcourse.world import VERSION_KEYS  # noqa: E402  (imports neither torch nor triton)


def stamp_problem(nb) -> str | None:
    stamp = nb.metadata.get("kernelcourse", {}).get("stamp")
    if not stamp:
        return "no GPU stamp: it was never executed with tools/stamp.py on a GPU"
    if not stamp.get("gpu") or stamp["gpu"] == "CPU":
        return "its stamp is not from a GPU"
    if stamp.get("code_sha256") != code_hash(nb):
        return f"its code changed after it was executed on {stamp['gpu']} ({stamp['date']}): outputs are stale"
    unexecuted = sum(1 for c in nb.cells if c.cell_type == "code" and c.source.strip() and c.execution_count is None)
    if unexecuted:
        return f"{unexecuted} code cell(s) have no outputs from the stamped run"
    noise = stderr_outputs(nb)
    if noise:
        return (f"cell {noise[0][0]}'s output holds {noise[0][1]}: a page shows what the learner should read, "
                f"not a library's warning (silence it at its source, or fix what it warns about)")
    stale = stale_printed_source(nb)
    if stale:
        return (f"it prints the course's code as it was when executed on {stamp['gpu']} ({stamp['date']}), and "
                f"{stale[0]} has changed since: the page would show old code beside the outputs of the old code")
    return None


def stderr_outputs(nb) -> list[tuple[int, str]]:
    """(cell index, first line) of each stderr stream or error among a notebook's committed outputs."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append((i, f"an error: {out.get('ename')}: {out.get('evalue', '')[:80]}"))
            elif out.get("output_type") == "stream" and out.get("name") == "stderr" and out.get("text", "").strip():
                line = next(ln for ln in out["text"].splitlines() if ln.strip())
                found.append((i, f"text on stderr: {line.strip()[:120]!r}"))
    return found


# A printed piece starts at a def, a class or a decorator, after a blank line (inspect.getsource's pieces are
# joined with blank lines); the line that names it finds the package file it comes from.
_PIECE = re.compile(r"\n[ \t]*\n(?=[ \t]*(?:@|def |class |async def ))")
_NAMING = re.compile(r"^[ \t]*(?:async def|def|class) (\w+).*$", re.M)


def stale_printed_source(nb, package: Path | None = None) -> list[str]:
    """The pieces of the course's own code that a lesson prints (cells calling ``inspect.getsource``) and
    that its package no longer holds as printed: e.g. ["layer_norm_backward in kernelcourse/transformer.py"].

    The stamp hashes the lesson's code cells, not the package functions a cell prints; a piece defined in the
    lesson itself is left out (its cell is hashed). What counts is the text a reader sees: a piece must still
    appear, character for character, in the package file that defines it."""
    package = package or ROOT / "src" / "kernelcourse"
    files = {f: f.read_text() for f in sorted(package.rglob("*.py"))}
    stale = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "getsource" not in cell.source:
            continue
        for out in cell.get("outputs", []):
            text = out.get("text") if out.get("output_type") == "stream" else out.get("data", {}).get("text/plain")
            if not isinstance(text, str):
                continue
            for piece in _PIECE.split(text.strip("\n")):
                naming = _NAMING.search(piece)
                homes = [f for f, src in files.items() if naming and naming.group(0) + "\n" in src]
                if homes and not any(piece in files[f] for f in homes):
                    stale.append(f"{naming.group(1)} in {homes[0].relative_to(package.parent)}")
    return stale


def stamp_note(nb) -> str | None:
    """Versions a (current) stamp lacks because it was made before they were recorded, or None.

    Not a failure: the outputs are still those of the stamped code on a GPU. The next GPU execution of
    the lesson records every version in ``VERSION_KEYS``.
    """
    versions = nb.metadata.get("kernelcourse", {}).get("stamp", {}).get("versions", {})
    missing = [k for k in VERSION_KEYS if k not in versions]
    return f"its stamp predates recording {', '.join(missing)}; the next GPU run records them" if missing else None


def scrub_home(nb, home: str | None = None) -> int:
    """Spell the stamping machine's home directory as ``~`` in text outputs: a reader's page should show
    where a file lives relative to their own home, not the path on the machine that ran the lesson.
    Returns how many outputs changed."""
    home = (home or str(Path.home())).rstrip("/")
    changed = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = out.get("text")
            if isinstance(text, str) and home + "/" in text:
                out["text"] = text.replace(home + "/", "~/")
                changed += 1
    return changed


def check(paths: list[Path]) -> int:
    bad = 0
    for path in paths:
        problem = stamp_problem(read(path))
        name = path.resolve().relative_to(ROOT)
        if problem:
            bad += 1
            print(f"FAIL {name}: {problem}. Run `python tools/stamp.py {name}` on a GPU and commit it.")
        else:
            nb = read(path)
            s = nb.metadata["kernelcourse"]["stamp"]
            note = stamp_note(nb)
            print(f"ok   {name}: executed on {s['gpu']}, {s['date']}" + (f" ({note})" if note else ""))
    return 1 if bad else 0


def execute(path: Path, record: bool, timeout: int) -> None:
    import torch
    from nbclient import NotebookClient

    if not torch.cuda.is_available():
        sys.exit("tools/stamp.py executes notebooks on a GPU, and torch sees none here")
    import kernelcourse as kc
    from kernelcourse.bench import provenance

    w = kc.setup(quiet=True)
    nb = read(path)
    rel = path.resolve().relative_to(ROOT)
    os.environ["KC_WORLD"] = "gpu"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    if record:
        os.environ["KC_RECORD"] = "1"
        os.environ["KC_RECORD_COMMAND"] = f"python tools/stamp.py --record {rel}"
        os.environ["KC_RECORD_CHAPTER"] = path.name.split("_")[0]  # "04": this lesson's results only
    start = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    # what recorded results say of their machine (GPU, capability, versions, host CPU, date), as they say it
    made_on = {key: value for key, value in provenance().items() if key != "command"}
    nb.metadata.setdefault("kernelcourse", {})["stamp"] = {
        **made_on,
        "seconds": round(time.time() - start, 1),
        "code_sha256": code_hash(nb),
    }
    scrub_home(nb)
    write(nb, path)
    print(f"executed and stamped {rel} on {w.name} in {time.time() - start:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="verify stamps instead of executing")
    ap.add_argument("--record", action="store_true", help="also save the notebook's benchmark results")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    args = ap.parse_args()
    if args.check:
        return check(args.paths)
    for path in args.paths:
        execute(path, args.record, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
