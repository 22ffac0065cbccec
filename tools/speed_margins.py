"""How far each speed check's threshold sits from a correct answer and from a wasteful one, on this GPU.

    python3 tools/speed_margins.py              # every speed-graded exercise, 5 runs of each version
    python3 tools/speed_margins.py 08.5 --runs 10

A speed check passes a correct kernel and fails a wasteful one only if the two land on either side of
its threshold run after run. This grades, in turn and several times over, the correct version and the
typical wasteful ones that the grader tests keep (tests/test_speed_exercises.py, test_grading_ch06.py to
test_grading_ch08.py, test_grading_ch09.py), reads the measured ratio off each speed line, and prints,
per check, the lowest, median and highest ratio of each version beside the threshold. A check whose
correct version ever fell below its threshold, or whose wasteful version ever cleared it, is marked:
its threshold, or what it times, needs changing. Timings belong here and in the lessons, not in unit
tests: the grader tests only say which verdict a GPU must give.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURED = re.compile(r"(\d+(?:\.\d+)?)(x|%)")
NEEDS = re.compile(r"needs (?:(at least|at most) )?(\d+(?:\.\d+)?)(x|%)")


def speed_lines(text: str) -> dict[str, tuple[float, float, bool]]:
    """{check: (measured, threshold, lower_is_better)} for each graded speed line of a grade report."""
    out = {}
    for line in text.splitlines():
        need = NEEDS.search(line)
        if not need or "not graded" in line:
            continue
        what, _, rest = line.lstrip("✔✘ ").partition(": ")
        got = MEASURED.search(rest)
        if got:
            out[what] = (float(got.group(1)), float(need.group(2)), need.group(1) == "at most")
    return out


def versions() -> dict[str, dict[str, dict]]:
    """{exercise: {"correct" or a wasteful version's name: the objects to grade}}, from the grader tests."""
    import tempfile

    from tests import test_grading_ch06 as t6
    from tests import test_grading_ch07 as t7
    from tests import test_grading_ch08 as t8
    from tests import test_grading_ch09 as t9
    from tests import test_speed_exercises as ts

    return {
        "01.6": {"correct": dict(matrix_add=ts.matrix_add_fast), "uncoalesced": dict(matrix_add=ts.matrix_add_slow)},
        "04.5": {"correct": dict(rms_norm_rows=ts._rows_launcher(4096)),
                 "one row per program": dict(rms_norm_rows=ts.rms_norm_one_row)},
        "05.4": {"correct": dict(matmul_kernel=ts.mm_ok, matmul_config=ts.GOOD),
                 "32 x 32 tiles": dict(matmul_kernel=ts.mm_ok, matmul_config=ts.NAIVE)},
        "06.8": {"correct": dict(causal_attention_kernel=t6.CausalVariant()),
                 "every tile under a mask": dict(causal_attention_kernel=t6.CausalVariant(NAIVE=True))},
        "07.5": {"correct": dict(attention_dkdv_kernel=t7.dkdv_kernel("ok", Path(tempfile.mkdtemp()))),
                 "products as tl.sum": dict(attention_dkdv_kernel=t7.dkdv_kernel("tl_sum", Path(tempfile.mkdtemp())))},
        "08.5": {"correct": dict(layer_norm_backward_kernel=t8.make_fused()),
                 "partial sums through memory": dict(layer_norm_backward_kernel=t8.make_fused("partials_through_memory"))},
        "09.4": {"correct": dict(make_train_step=t9.fast_train_step), "eager step": dict(make_train_step=t9.make_train_step)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exercises", nargs="*", help="exercise ids (default: every speed-graded one)")
    ap.add_argument("--runs", type=int, default=5, help="times each version is graded (default 5)")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # the course's package and its tests, whatever is installed
    import kernelcourse as kc
    from tests.helpers import grade

    table = versions()  # built before the GPU is looked for, so that a machine without one checks the imports
    if not kc.setup(quiet=True).gpu:
        print("tools/speed_margins.py times the speed checks on a CUDA GPU, and there is none here.")
        return 2
    bad = 0
    for ex in args.exercises or list(table):
        ratios: dict[tuple[str, str], list[float]] = {}
        limits: dict[str, tuple[float, bool]] = {}
        for _ in range(args.runs):  # the versions in turn, so that a slow spell of the GPU hits each alike
            for name, objects in table[ex].items():
                for check, (got, need, at_most) in speed_lines(grade(ex, **objects)[1]).items():
                    ratios.setdefault((check, name), []).append(got)
                    limits[check] = (need, at_most)
        print(f"\n{ex}")
        for check, (need, at_most) in limits.items():
            print(f"  {check} (needs {'at most' if at_most else 'at least'} {need:g})")
            for name in table[ex]:
                got = ratios.get((check, name), [])
                if not got:
                    print(f"    {name:28s} no speed line (a check before it failed)")
                    continue
                passes = [(g <= need) if at_most else (g >= need) for g in got]
                wrong = not all(passes) if name == "correct" else any(passes)
                bad += wrong
                print(f"    {name:28s} min {min(got):.2f}  median {statistics.median(got):.2f}  max {max(got):.2f}"
                      f"  over {len(got)} runs{'   <- on the wrong side of the threshold' if wrong else ''}")
    print(f"\n{bad} version(s) on the wrong side of a threshold at least once" if bad else
          "\nevery correct version passed and every wasteful one failed, in every run")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
