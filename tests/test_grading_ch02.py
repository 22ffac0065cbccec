"""Chapter 02's formula graders (02.2, 02.5-02.8): typical wrong formulas are rejected with a message that
teaches, and different but correct formulas are accepted. The measurement readings (02.1, 02.3, 02.4) are
tested in test_grading_ch02_measure.py."""
import numpy as np
import pytest

from tests.helpers import grade

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
    (lambda M, N, K, s: ((M * K + K * N + M * N) * s, 2 * M * N * K), "swapped"),
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
    (lambda p, b: b * 1e9 / (p * 1e12), "inverted"),
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
    (lambda f, n, ms, p, b: 1 / _fraction(f, n, ms, p, b), "inverted"),
    (lambda f, n, ms, p, b: 100 * _fraction(f, n, ms, p, b), "not a percentage"),
    (lambda f, n, ms, p, b: 1e3 * _fraction(f, n, ms, p, b), "ms is milliseconds"),
    (lambda f, n, ms, p, b: f / (ms * 1e-3) / 1e12 / min(p, f / n * b), "intensity × GB/s / 1000"),
])
def test_02_8_rejects_wrong(fn, hint):
    passed, text = grade("02.8", fraction_of_roofline=fn)
    assert not passed
    assert hint in text, text
