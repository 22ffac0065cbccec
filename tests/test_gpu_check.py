"""tools/gpu_check.py's summary: what it says of parts that ran, failed to run, or were left out (--only).
The checks themselves need a CUDA GPU; the table does not."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import gpu_check  # noqa: E402


def test_a_part_left_out_is_listed_and_neither_passes_nor_fails():
    ran = gpu_check.Part("unit tests", "test", ran=3, passed=3)
    left = gpu_check.Part("lessons under nbval", "cell", left_out=True)
    text = gpu_check.render([ran, left], "a GPU", {"torch": "2"}, 1.0)
    assert "not run here: lessons under nbval" in text and "could not run" not in text
    assert text.splitlines()[-1].startswith("PASS: 3 checks")

    broken = gpu_check.Part("grade report: stubs fail", "exercise", error="the grade report did not run")
    text = gpu_check.render([ran, left, broken], "a GPU", {"torch": "2"}, 1.0)
    assert "grade report: stubs fail could not run: the grade report did not run" in text
    assert text.splitlines()[-1].startswith("FAIL")


def test_a_part_that_ran_nothing_is_not_a_pass():
    assert not gpu_check.Part("unit tests", "test").ok
