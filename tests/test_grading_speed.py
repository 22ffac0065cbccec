"""Speed checks: graded on a GPU, reported as not graded (never as passed) on the CPU."""
import pytest

import kernelcourse as kc
from kernelcourse import grading
from kernelcourse.grade import Row, render


def _report(lines):
    ex = grading.Exercise("99.1", "speed", (), lambda report: None)
    return grading.Report(ex, sink=lines.append)


@pytest.mark.skipif(kc.world().gpu, reason="on a GPU, speed checks are graded")
def test_on_the_cpu_a_speed_check_is_not_graded_and_says_why():
    lines = []
    report = _report(lines)
    assert grading.speed_vs_peer(report, "your kernel", lambda: None, lambda: None, "torch", 0.5) is None
    assert grading.speed_vs_roof(report, "your copy", lambda: None, 1 << 20, 0.5) is None
    assert report.failures == 0 and report.skipped == 2
    assert lines == [f"{grading.NOT_GRADED} your kernel: speed needs a GPU (not graded here)",
                     f"{grading.NOT_GRADED} your copy: speed needs a GPU (not graded here)"]


def test_a_not_graded_exercise_is_never_shown_as_passed():
    rows = [Row("04_triton_kernels", "04.1", True, "3 checks passed"),
            Row("04_triton_kernels", "04.2", False, "3 checks passed; not graded here: speed", not_graded=True),
            Row("04_triton_kernels", "04.3", False, "max error 0.5")]
    text = render(rows)
    row = next(line for line in text.splitlines() if "04.2" in line)
    assert row.split()[2:4] == ["not", "graded"], text
    assert "pass" not in row.split()[:4], text
    assert "Score: 1/3 exercises passed; 1 not graded here" in text


@pytest.mark.skipif(not kc.world().gpu, reason="timing needs a GPU")
def test_on_a_gpu_a_slow_kernel_fails_its_speed_check():
    import torch

    x = torch.randn(1 << 24, device="cuda")
    slow = lambda: [x.clone() for _ in range(8)]  # noqa: E731  eight copies against one
    lines = []
    report = _report(lines)
    assert grading.speed_vs_peer(report, "eight copies", slow, x.clone, "one copy", 0.5) is False
    assert "needs at least 0.5x" in lines[-1]
    assert grading.speed_vs_roof(report, "one copy", x.clone, 2 * x.numel() * 4, 0.5) is True
