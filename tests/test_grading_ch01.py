"""Chapter 01's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted. Kernels run in numba's simulator on the CPU."""
import math
from fractions import Fraction

import pytest
from numba import cuda

from tests.helpers import grade, memorised

# ---- 01.1 global index and bounds check ----------------------------------------------------------


@cuda.jit
def add_ok(x, y, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.size:
        out[i] = x[i] + y[i]


@cuda.jit
def add_ok_grid(x, y, out):  # another correct formulation: cuda.grid and an early return
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    out[i] = y[i] + x[i]


@cuda.jit
def add_no_bounds_check(x, y, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    out[i] = x[i] + y[i]


@cuda.jit
def add_thread_index_only(x, y, out):
    i = cuda.threadIdx.x
    if i < out.size:
        out[i] = x[i] + y[i]


@cuda.jit
def add_off_by_one(x, y, out):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < out.size - 1:
        out[i] = x[i] + y[i]


@cuda.jit
def add_wrong_operand(x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] + x[i]


def add_not_a_kernel(x, y, out):
    pass


@pytest.mark.parametrize("kernel", [add_ok, add_ok_grid])
def test_01_1_accepts_correct(kernel):
    passed, text = grade("01.1", add_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (add_no_bounds_check, "bounds check"),
    (add_thread_index_only, "global index"),
    (add_off_by_one, "never written"),
    (add_wrong_operand, "out[i] = x[i] + x[i]: add y[i], not x[i] twice"),
    (add_not_a_kernel, "@cuda.jit"),
])
def test_01_1_rejects_wrong(kernel, hint):
    passed, text = grade("01.1", add_kernel=kernel)
    assert not passed
    assert hint in text, text


def test_missing_name_is_explained():
    passed, text = grade("01.1")
    assert not passed and "add_kernel not defined" in text

# ---- 01.2 grid size --------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda n, b: (n + b - 1) // b, lambda n, b: -(-n // b),
                                lambda n, b: n // b + (n % b > 0)])
def test_01_2_accepts_correct(fn):
    passed, text = grade("01.2", grid_size=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda n, b: n // b, "floor division drops the last, partial block"),
    (lambda n, b: n // b + 1, "one block too many when n is a multiple of the block size"),
    (lambda n, b: math.ceil(n / b), "float division rounds large n; use integer ceil-div"),
    (lambda n, b: int(n / b) + 1, "one block too many when n is a multiple of the block size"),
    (lambda n, b: n / b, "a launch needs a whole number of blocks (an int)"),
    (lambda n, b: None, "returned None: did you forget `return`?"),
])
def test_01_2_rejects_wrong(fn, hint):
    passed, text = grade("01.2", grid_size=fn)
    assert not passed
    assert hint in text, text

# ---- 01.3 grid-stride loop -------------------------------------------------------------------------


@cuda.jit
def axpy_ok(a, x, y):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, y.size, stride):
        y[i] += a * x[i]


@cuda.jit
def axpy_ok_while(a, x, y):  # the same loop written by hand
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    while i < y.shape[0]:
        y[i] = y[i] + a * x[i]
        i += cuda.blockDim.x * cuda.gridDim.x


@cuda.jit
def axpy_no_loop(a, x, y):
    i = cuda.grid(1)
    if i < y.size:
        y[i] += a * x[i]


@cuda.jit
def axpy_block_stride(a, x, y):
    for i in range(cuda.grid(1), y.size, cuda.blockDim.x):
        y[i] += a * x[i]


@cuda.jit
def axpy_fixed_trips(a, x, y):
    i = cuda.grid(1)
    for _ in range(4):
        if i < y.size:
            y[i] += a * x[i]
        i += cuda.gridsize(1)


@cuda.jit
def axpy_off_by_one(a, x, y):
    i = cuda.grid(1)
    while i <= y.size:
        y[i] += a * x[i]
        i += cuda.gridsize(1)


@cuda.jit
def axpy_overwrites(a, x, y):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = a * x[i]


@pytest.mark.parametrize("kernel", [axpy_ok, axpy_ok_while])
def test_01_3_accepts_correct(kernel):
    passed, text = grade("01.3", axpy_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (axpy_no_loop, "not updated"),
    (axpy_block_stride, "updated twice"),
    (axpy_fixed_trips, "while i < y.size"),
    (axpy_off_by_one, "y.size"),
    (axpy_overwrites, "y holds a * x alone: add to it, y[i] += a * x[i]"),
])
def test_01_3_rejects_wrong(kernel, hint):
    passed, text = grade("01.3", axpy_kernel=kernel)
    assert not passed
    assert hint in text, text

# ---- 01.4 2D matrix add ----------------------------------------------------------------------------


@cuda.jit
def madd_ok(A, B, C):
    col, row = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def madd_ok_explicit(A, B, C):
    row = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if row >= C.shape[0] or col >= C.shape[1]:
        return
    C[row, col] = B[row, col] + A[row, col]


@cuda.jit
def madd_swapped(A, B, C):
    row, col = cuda.grid(2)
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def madd_one_bound(A, B, C):
    col, row = cuda.grid(2)
    if row < C.shape[0]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def madd_bounds_swapped(A, B, C):
    col, row = cuda.grid(2)
    if row < C.shape[1] and col < C.shape[0]:
        C[row, col] = A[row, col] + B[row, col]


@pytest.mark.parametrize("kernel", [madd_ok, madd_ok_explicit])
def test_01_4_accepts_correct(kernel):
    passed, text = grade("01.4", matrix_add_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (madd_swapped, "col, row = cuda.grid(2)"),
    (madd_one_bound, "col < cols"),
    (madd_bounds_swapped, "row < rows"),
])
def test_01_4_rejects_wrong(kernel, hint):
    passed, text = grade("01.4", matrix_add_kernel=kernel)
    assert not passed
    assert hint in text, text

# ---- 01.5 effective bandwidth ----------------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda n, s, ms: 3 * n * s / (ms / 1e3) / 1e9,
                                lambda n, s, ms: (3 * n * s) / ms * 1e-6])
def test_01_5_accepts_correct(fn):
    passed, text = grade("01.5", vector_add_gbps=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda n, s, ms: 2 * n * s / (ms / 1e3) / 1e9, "you counted two arrays"),
    (lambda n, s, ms: n * s / (ms / 1e3) / 1e9, "you counted one array"),
    (lambda n, s, ms: 3 * n * s / ms / 1e9, "ms is milliseconds: divide by ms * 1e-3 seconds"),
    (lambda n, s, ms: 3 * n * s / (ms / 1e6) / 1e9, "ms is milliseconds, not microseconds"),
    (lambda n, s, ms: 3 * n * s / (ms / 1e3) / 2**30, "GB/s means 10^9 bytes per second, not 2^30 (GiB)"),
    (lambda n, s, ms: 3 * n / (ms / 1e3) / 1e9, "multiply by the bytes per element (itemsize)"),
    (lambda n, s, ms: "fast", "of type str, not a number"),
])
def test_01_5_rejects_wrong(fn, hint):
    passed, text = grade("01.5", vector_add_gbps=fn)
    assert not passed
    assert hint in text, text


def test_endless_loop_hits_the_time_limit(monkeypatch):
    import kernelcourse.grading as g

    g.exercises("01")
    monkeypatch.setattr(g._EXERCISES["01.2"], "time_limit_s", 0.5)

    def forever(n, b):
        while True:
            pass

    passed, text = grade("01.2", grid_size=forever)
    assert not passed and "loop that never ends" in text


# ---- fresh cases: a table of answers cannot pass ---------------------------------------------------


@pytest.mark.parametrize("exercise, name, correct", [
    ("01.2", "grid_size", lambda n, b: (n + b - 1) // b),
    ("01.5", "vector_add_gbps", lambda n, s, ms: 3 * n * s / (ms * 1e-3) / 1e9),
])
def test_cases_are_fresh_every_run(exercise, name, correct, monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    recording, table = memorised(correct)
    assert grade(exercise, **{name: recording})[0]
    passed, text = grade(exercise, **{name: table})
    assert not passed, text
    # only the failing case shows its expected value, and the line says how to draw the cases again
    assert text.count("expected") == 1 and "KC_GRADE_SEED=" in text, text


def test_a_seed_draws_the_same_cases(monkeypatch):
    monkeypatch.setenv("KC_GRADE_SEED", "4242")
    first, second = grade("01.2", grid_size=lambda n, b: n // b), grade("01.2", grid_size=lambda n, b: n // b)
    assert first == second and "[seed 4242: KC_GRADE_SEED=4242 draws these cases again]" in first[1]


def test_01_2_agrees_with_exact_rational_ceil():
    # an independent oracle: the ceiling of the exact fraction n / block, no integer trick, no float
    passed, text = grade("01.2", grid_size=lambda n, b: math.ceil(Fraction(n, b)))
    assert passed, text


# ---- block sizes the statements do not show -------------------------------------------------------------


@cuda.jit
def add_block_128(x, y, out):  # the example's 128 threads a block written in, not read from cuda.blockDim
    i = cuda.blockIdx.x * 128 + cuda.threadIdx.x
    if i < out.size:
        out[i] = x[i] + y[i]


def test_01_1_rejects_a_block_size_of_its_own():
    passed, text = grade("01.1", add_kernel=add_block_128)
    assert not passed and "use cuda.blockDim.x (or cuda.grid(1))" in text, text


@cuda.jit
def matrix_add_block_16x8(a, b, c):  # the example's (16, 8) block written in
    col = cuda.blockIdx.x * 16 + cuda.threadIdx.x
    row = cuda.blockIdx.y * 8 + cuda.threadIdx.y
    if row < c.shape[0] and col < c.shape[1]:
        c[row, col] = a[row, col] + b[row, col]


def test_01_4_rejects_a_block_shape_of_its_own():
    passed, text = grade("01.4", matrix_add_kernel=matrix_add_block_16x8)
    assert not passed and "not the (16, 8) of the example" in text, text


# ---- 01.3: the block size and a that the launch passes ------------------------------------------------


@cuda.jit
def axpy_block_32(a, x, y):  # the 32 threads a block of the grader's first launches written in
    i = cuda.blockIdx.x * 32 + cuda.threadIdx.x
    while i < y.size:
        y[i] += a * x[i]
        i += 32 * cuda.gridDim.x


@cuda.jit
def axpy_own_a(a, x, y):  # an a of its own (the 2.0 it was tried with), the argument ignored
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] += 2.0 * x[i]


def test_01_3_rejects_a_block_size_of_its_own():
    """Right on the launches of 32 threads a block; on the grader's 64 its threads overlap. It was rejected as
    'updated twice', which did not say why."""
    passed, text = grade("01.3", axpy_kernel=axpy_block_32)
    assert not passed and "takes blocks to be 32 threads" in text and "use cuda.blockDim.x" in text, text


@cuda.jit
def axpy_block_32_racing(a, x, y):
    """axpy_block_32 as a GPU runs it when every racing update is lost: a thread past the first 32 of its block
    reaches only elements that another thread reaches too (the next block's, or the first block's one stride on),
    and its updates vanish; the result is right where blocks are 32 threads or more, so only a launch of smaller
    blocks shows the mistake."""
    if cuda.threadIdx.x >= 32:
        return
    i = cuda.blockIdx.x * 32 + cuda.threadIdx.x
    while i < y.size:
        y[i] += a * x[i]
        i += 32 * cuda.gridDim.x


def test_01_3_rejects_a_block_size_of_its_own_whose_races_lose_every_update():
    passed, text = grade("01.3", axpy_kernel=axpy_block_32_racing)
    assert not passed and "with 5 x 16 threads: this is what a kernel that takes blocks to be 32 threads" in text, text


def test_01_3_names_a_block_of_its_own_from_a_result_with_lost_updates():
    """On a GPU the overlapping threads of a kernel with blocks of 32 launched with 64 race: some elements come out
    updated twice, others once (the second thread read y[i] before the first wrote it). Either count names it."""
    import numpy as np

    from kernelcourse.grading.ch01 import _own_block, _updates_with_block

    rng = np.random.default_rng(0)
    n, grid, block = 4099, 3, 64
    a, x = np.float32(1.3), rng.uniform(0.5, 2.0, n).astype(np.float32)
    y0 = rng.standard_normal(n).astype(np.float32)
    most = _updates_with_block(n, grid, block, 32)
    times = np.where(most > 1, rng.integers(1, 3, n), most)  # each racing update kept or lost at random
    assert (times == 2).any() and (times[most == 2] == 1).any()
    y = (y0 + times * a * x).astype(np.float32)
    assert _own_block(y, y0, a, x, grid, block) == 32
    y[7] = y0[7]  # an element every thread of that kernel reaches, never updated: another mistake
    assert _own_block(y, y0, a, x, grid, block) is None


def test_01_3_rejects_an_a_of_its_own():
    """a is drawn on every run (between 0.5 and 2, never exactly 2.0): a kernel that writes its own a fails."""
    passed, text = grade("01.3", axpy_kernel=axpy_own_a)
    assert not passed and "grew by 2 * x[i]" in text and "use the argument a" in text, text
