"""Chapter 02's formula graders (02.2, 02.5-02.8): typical wrong formulas are rejected with a message that
teaches, and different but correct formulas are accepted. The measurement readings (02.1, 02.3, 02.4) are
tested in test_grading_ch02_measure.py."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from tests.helpers import grade, memorised

# ---- 02.2 FLOPs and minimal bytes of a matmul ------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda M, N, K, itemsize: (2 * M * N * K, (M * K + K * N + M * N) * itemsize),
    lambda M, N, K, itemsize: [float(M * N * (2 * K)), itemsize * (M * (K + N) + K * N)],
    lambda M, N, K, itemsize: np.array([2.0 * M * N * K, (M * K + N * K + M * N) * itemsize]),
])
def test_02_2_accepts_correct(fn):
    passed, text = grade("02.2", matmul_flops_bytes=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda M, N, K, s: (M * N * K, (M * K + K * N + M * N) * s), "multiply-add is two FLOPs"),
    (lambda M, N, K, s: (2 * M * N * K, (M * K + K * N + 2 * M * N) * s), "counted the output twice"),
    (lambda M, N, K, s: (2 * M * N * K, M * K + K * N + M * N), "bytes should be in the given dtype"),
    (lambda M, N, K, s: (2 * M * N * K, (M * K + K * N + M * N) * 4), "not always 4"),
    (lambda M, N, K, s: (2 * M * N * K, (M * K + K * N) * s), "is written to memory too"),
    (lambda M, N, K, s: (2 * M * N * K, (2 * M * N * K + M * N) * s), "naive triple loop"),
    (lambda M, N, K, s: ((M * K + K * N + M * N) * s, 2 * M * N * K), "flops and nbytes are swapped"),
    (lambda M, N, K, s: (2 * M * N * K, (M * N + N * K + M * N) * s), "A is M×K"),
    (lambda M, N, K, s: 2 * M * N * K, "return a pair"),
])
def test_02_2_rejects_wrong(fn, hint):
    passed, text = grade("02.2", matmul_flops_bytes=fn)
    assert not passed
    assert hint in text, text

# ---- 02.5 ridge point ------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda peak_tflops, bandwidth_gbps: peak_tflops * 1e12 / (bandwidth_gbps * 1e9),
    lambda peak_tflops, bandwidth_gbps: 1000 * peak_tflops / bandwidth_gbps,
])
def test_02_5_accepts_correct(fn):
    passed, text = grade("02.5", ridge_point=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda p, b: p / b, "gains a factor 1000"),
    (lambda p, b: b * 1e9 / (p * 1e12), "inverted: the ridge is FLOP/s divided by bytes/s"),
    (lambda p, b: p * 1e12 / (b * 2**30), "that is GiB, not GB"),
    (lambda p, b: p * 2**40 / (b * 2**30), "not 2^40 and 2^30"),
    (lambda p, b: p * 1e12 / b, "intensity × bandwidth = peak"),
])
def test_02_5_rejects_wrong(fn, hint):
    passed, text = grade("02.5", ridge_point=fn)
    assert not passed
    assert hint in text, text

# ---- 02.6 memory- or compute-bound -----------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda flops, nbytes, peak_tflops, bandwidth_gbps:
        "memory" if flops / nbytes < peak_tflops * 1e12 / (bandwidth_gbps * 1e9) else "compute",
    # which limit takes longer? the same question asked in time instead of intensity
    lambda flops, nbytes, peak_tflops, bandwidth_gbps:
        "compute" if flops / (peak_tflops * 1e12) >= nbytes / (bandwidth_gbps * 1e9) else "memory",
])
def test_02_6_accepts_correct(fn):
    passed, text = grade("02.6", classify=fn)
    assert passed, text


def _classify_by(ridge_of, flip=False):
    def classify(flops, nbytes, peak_tflops, bandwidth_gbps):
        left = flops / nbytes < ridge_of(peak_tflops, bandwidth_gbps)
        return ("compute" if left else "memory") if flip else ("memory" if left else "compute")
    return classify


@pytest.mark.parametrize("fn, hint", [
    (_classify_by(lambda p, b: p * 1e12 / (b * 1e9), flip=True), "every answer is swapped"),
    (_classify_by(lambda p, b: p / b), "not TFLOP/s ÷ GB/s"),
    (_classify_by(lambda p, b: p * 1e12 / (b * 1e9) * 10), "right of the ridge"),
    # ridges a few percent off: only intensities within a few percent of the ridge tell them apart
    (_classify_by(lambda p, b: p * 1e12 / (b * 2**30)), "within a few percent of the ridge: the units must be exact"),
    (_classify_by(lambda p, b: p * 2**40 / (b * 2**30)), "within a few percent of the ridge: the units must be exact"),
    (_classify_by(lambda p, b: p * 1e12 / (b * 1e9) * 1.05), "within a few percent of the ridge"),
    (lambda flops, nbytes, p, b: "Memory-bound", "return the string 'memory' or 'compute'"),
    (lambda flops, nbytes, p, b: flops / nbytes < 100, "return the string"),
    (lambda flops, nbytes, p, b: "memory", "right of the ridge"),
])
def test_02_6_rejects_wrong(fn, hint):
    passed, text = grade("02.6", classify=fn)
    assert not passed
    assert hint in text, text

# ---- 02.7 lower-bound time -------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda flops, nbytes, peak_tflops, bandwidth_gbps:
        max(flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)) * 1e3,
    lambda flops, nbytes, peak_tflops, bandwidth_gbps:
        max(flops / peak_tflops / 1e9, nbytes / bandwidth_gbps / 1e6),
])
def test_02_7_accepts_correct(fn):
    passed, text = grade("02.7", min_time_ms=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda f, n, p, b: (f / (p * 1e12) + n / (b * 1e9)) * 1e3, "not their sum"),
    (lambda f, n, p, b: min(f / (p * 1e12), n / (b * 1e9)) * 1e3, "needs both its FLOPs and its bytes"),
    (lambda f, n, p, b: max(f / (p * 1e12), n / (b * 1e9)), "that is seconds"),
    (lambda f, n, p, b: max(f / (p * 1e12), n / (b * 1e9)) * 1e6, "that is microseconds"),
    (lambda f, n, p, b: max(f / (p * 1e12), n / (b * 2**30)) * 1e3, "that is GiB, not GB"),
    (lambda f, n, p, b: n / (b * 1e9) * 1e3, "needs both its FLOPs and its bytes"),
    (lambda f, n, p, b: max(f / p, n / b), "T >= max"),
])
def test_02_7_rejects_wrong(fn, hint):
    passed, text = grade("02.7", min_time_ms=fn)
    assert not passed
    assert hint in text, text

# ---- 02.8 fraction of the roofline -----------------------------------------------------------------


def _fraction(flops, nbytes, ms, peak_tflops, bandwidth_gbps):
    achieved = flops / (ms * 1e-3) / 1e12
    return achieved / min(peak_tflops, flops / nbytes * bandwidth_gbps / 1e3)


@pytest.mark.parametrize("fn", [
    _fraction,
    # the same ratio in time: lower bound / measured time
    lambda flops, nbytes, ms, peak_tflops, bandwidth_gbps:
        max(flops / (peak_tflops * 1e9), nbytes / (bandwidth_gbps * 1e6)) / ms,
])
def test_02_8_accepts_correct(fn):
    passed, text = grade("02.8", fraction_of_roofline=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda f, n, ms, p, b: f / (ms * 1e-3) / 1e12 / p, "compared with the compute peak"),
    (lambda f, n, ms, p, b: f / (ms * 1e-3) / 1e12 / (f / n * b / 1e3), "its roof is the peak"),
    (lambda f, n, ms, p, b: 1 / _fraction(f, n, ms, p, b), "inverted: the fraction is achieved ÷ attainable"),
    (lambda f, n, ms, p, b: 100 * _fraction(f, n, ms, p, b), "not a percentage"),
    (lambda f, n, ms, p, b: 1e3 * _fraction(f, n, ms, p, b), "ms is milliseconds"),
    (lambda f, n, ms, p, b: f / (ms * 1e-3) / 1e12 / min(p, f / n * b), "intensity × GB/s / 1000"),
    # an impossible timing clamped to a perfect score hides the measurement error
    (lambda f, n, ms, p, b: min(1.0, _fraction(f, n, ms, p, b)), "a measurement error: return the fraction as it is"),
])
def test_02_8_rejects_wrong(fn, hint):
    passed, text = grade("02.8", fraction_of_roofline=fn)
    assert not passed
    assert hint in text, text


# ---- fresh cases: a table of answers cannot pass ---------------------------------------------------


@pytest.mark.parametrize("exercise, name, correct", [
    ("02.2", "matmul_flops_bytes", lambda M, N, K, s: (2 * M * N * K, (M * K + K * N + M * N) * s)),
    ("02.5", "ridge_point", lambda p, b: p * 1e12 / (b * 1e9)),
    ("02.6", "classify", lambda f, n, p, b: "memory" if f / n < p * 1e12 / (b * 1e9) else "compute"),
    ("02.7", "min_time_ms", lambda f, n, p, b: max(f / (p * 1e12), n / (b * 1e9)) * 1e3),
    ("02.8", "fraction_of_roofline", _fraction),
])
def test_cases_are_fresh_every_run(exercise, name, correct, monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    recording, table = memorised(correct, default=1.0)
    assert grade(exercise, **{name: recording})[0]
    passed, text = grade(exercise, **{name: table})
    assert not passed, text
    assert "KC_GRADE_SEED=" in text and text.count("✘") == 1, text


@pytest.mark.parametrize("mistake, hint", [
    ((lambda p, b: p * 1e12 / (b * 2**30)), "that is GiB, not GB"),
    ((lambda p, b: p * 2**40 / (b * 2**30)), "not 2^40 and 2^30"),
    ((lambda p, b: p / b), "gains a factor 1000"),
])
def test_02_5_first_case_tells_mistakes_apart(mistake, hint, monkeypatch):
    # the hint is decided on the first case: on every seed it names this mistake, not another one
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    for seed in range(20):
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        passed, text = grade("02.5", ridge_point=mistake)
        assert not passed and hint in text, text


# ---- the graders' formulas against independent oracles -----------------------------------------------


def _flops_bytes_by_counting(M, N, K, itemsize):
    """FLOPs counted by PyTorch's FlopCounterMode on a matmul of shape-only tensors; bytes as the sizes of
    the tensors A, B and C themselves."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b = torch.empty(M, K, device="meta"), torch.empty(K, N, device="meta")
    with FlopCounterMode(display=False) as counter:
        c = a @ b
    return counter.get_total_flops(), (a.numel() + b.numel() + c.numel()) * itemsize


def _ridge_by_bisection(peak_tflops, bandwidth_gbps):
    """The intensity where the memory roof, intensity × bandwidth, meets the peak, found by bisection."""
    lo, hi = 0.0, 1e9
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * bandwidth_gbps * 1e9 < peak_tflops * 1e12 else (lo, mid)
    return (lo + hi) / 2


def _classify_by_timing(flops, nbytes, peak_tflops, bandwidth_gbps):
    """Which roof is lower at this intensity: the attainable FLOP/s is min(peak, intensity × bandwidth)."""
    intensity = Fraction(flops, nbytes)
    memory_roof = intensity * Fraction(str(bandwidth_gbps)) * 10**9
    return "memory" if memory_roof < Fraction(str(peak_tflops)) * 10**12 else "compute"


@pytest.mark.parametrize("exercise, name, oracle", [
    ("02.2", "matmul_flops_bytes", _flops_bytes_by_counting),
    ("02.5", "ridge_point", _ridge_by_bisection),
    ("02.6", "classify", _classify_by_timing),
])
def test_graders_agree_with_an_independent_oracle(exercise, name, oracle):
    passed, text = grade(exercise, **{name: oracle})
    assert passed, text


@pytest.mark.parametrize("mistake, hint", [
    (lambda f, n, p, b: (f / (p * 1e12) + n / (b * 1e9)) * 1e3, "not their sum"),
    (lambda f, n, p, b: max(f / (p * 1e12), n / (b * 2**30)) * 1e3, "that is GiB, not GB"),
    (lambda f, n, p, b: max(f / (p * 1e12), n / (b * 1e9)), "that is seconds"),
])
def test_02_7_first_case_tells_mistakes_apart(mistake, hint, monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    for seed in range(20):
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        passed, text = grade("02.7", min_time_ms=mistake)
        assert not passed and hint in text and "✔" not in text, text
