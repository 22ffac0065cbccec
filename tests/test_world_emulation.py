"""What the pre-Hopper emulation (tools/gpu_check.py --pre-hopper, --as-t4: DISABLE_MMA_V3 on a Hopper GPU)
changes in grading: a speed check of a Triton kernel against a library peer (cuBLAS, SDPA), which the flag
does not reach, is not graded when it falls short, and graded as ever everywhere else. Checked on the CPU,
with the GPU's capability and the timings stubbed."""
import importlib

import pytest
import torch

from kernelcourse import grading
from kernelcourse.grading import speed

W = importlib.import_module("kernelcourse.world")  # the module (the package's kernelcourse.world is its function)


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of the given compute capability (torch's, before any KC_MAX_CAPABILITY) with DISABLE_MMA_V3 set
    or not, and speed checks whose timings are (learner ms, peer ms)."""
    def make(capability, disable_mma_v3, times=(1.0, 1.0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        if disable_mma_v3 is None:
            monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
        else:
            monkeypatch.setenv("DISABLE_MMA_V3", disable_mma_v3)
        monkeypatch.setattr(speed, "world", lambda: W.World(True, "cuda", "a GPU", capability))
        timed = iter(times)
        monkeypatch.setattr(speed, "_median_ms", lambda report, what, fn, gpu_only=False: next(timed))
    return make


def _report(lines):
    return grading.Report(grading.Exercise("99.1", "speed", (), lambda report: None), sink=lines.append)


@pytest.mark.parametrize("capability, flag, emulated", [
    ((9, 0), "1", True), ((9, 0), "true", True), ((9, 0), "ON", True),   # as Triton's compiler reads it
    ((9, 0), None, False), ((9, 0), "0", False),                          # a Hopper GPU as itself
    ((8, 0), "1", False), ((8, 9), "1", False), ((7, 5), "1", False),     # older GPUs: Triton has no wgmma there
    ((10, 0), "1", False),                                                # Blackwell: the flag is not its tl.dot's
])
def test_the_emulation_is_disable_mma_v3_on_a_hopper_gpu(gpu, monkeypatch, capability, flag, emulated):
    gpu(capability, flag)
    monkeypatch.setenv("KC_MAX_CAPABILITY", "8.0")   # the course's choices; not what Triton compiles for
    reason = W.pre_hopper_emulation()
    assert bool(reason) == emulated, reason
    if emulated:
        assert "DISABLE_MMA_V3" in reason and "mma.sync" in reason and "9.0" in reason
    assert W.pre_hopper_emulation(capability) == reason


def test_without_a_gpu_there_is_no_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    assert W.pre_hopper_emulation() is None


def test_under_the_emulation_a_shortfall_against_a_library_peer_is_not_graded(gpu):
    gpu((9, 0), "1", times=(3.906, 1.673))                # 07.5's 'rows' kernel against SDPA, under --pre-hopper
    lines = []
    report = _report(lines)
    assert speed.speed_vs_peer(report, "your dK/dV kernel", None, None, "SDPA's whole backward", 0.6,
                               library_peer=True) is None
    assert report.failures == 0 and report.skipped == 1
    line, = lines
    assert line.startswith(grading.NOT_GRADED), line
    assert "0.43x the speed of SDPA's whole backward (3.906 ms vs 1.673 ms; needs 0.6x)" in line
    assert "not graded here: DISABLE_MMA_V3" in line and "mma.sync" in line


def test_under_the_emulation_a_kernel_fast_enough_still_passes(gpu):
    gpu((9, 0), "1", times=(1.0, 0.9))
    lines = []
    report = _report(lines)
    assert speed.speed_vs_peer(report, "your kernel", None, None, "cuBLAS", 0.8, library_peer=True) is True
    assert report.failures == report.skipped == 0 and lines[0].startswith(grading.PASS)


@pytest.mark.parametrize("capability, flag, library_peer", [
    ((9, 0), "1", False),   # the emulation, but the peer is Triton's: held to mma.sync as the learner's is
    ((8, 0), None, True),   # an A100: both sides run its own code
    ((8, 9), "1", True),    # an L4 with the flag set: Triton's tl.dot is mma.sync there anyway
    ((9, 0), None, True),   # a Hopper GPU as itself
])
def test_everywhere_else_a_shortfall_fails(gpu, capability, flag, library_peer):
    gpu(capability, flag, times=(2.0, 1.0))
    lines = []
    report = _report(lines)
    assert speed.speed_vs_peer(report, "your kernel", None, None, "the peer", 0.6, hint="a hint",
                               library_peer=library_peer) is False
    assert report.failures == 1 and report.skipped == 0
    assert lines[0].startswith(grading.FAIL) and "0.50x the speed of the peer" in lines[0] and "a hint" in lines[0]
