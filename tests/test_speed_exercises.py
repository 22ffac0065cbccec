"""The exercises graded on speed (01.6, 04.5, 05.4).

On the CPU their graders check correctness and report the speed check as not graded, never as passed.
On a GPU, each naive version named here must fail its speed check while the solution passes; measured on
an H100: the matrix add with threads of a warp running down a column reached 22% of a copy's bandwidth
(needs 60%), 04.4's RMSNorm kernel launched one row per program 29% of a copy (needs 60%; the solution
101%), and 05.2's matmul with 32 x 32 x 32 tiles 0.17x cuBLAS (needs 0.5x; 128 x 256 x 64 tiles 0.89x).
"""
import pytest
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import grading
from tests.helpers import grade

kc.setup()
from numba import cuda  # noqa: E402  (after setup: the simulator is chosen by the environment)
import torch  # noqa: E402

# The correct kernels of exercises 01.4, 04.4 and 05.2, as their own tests keep them: the speed exercises
# launch them at other sizes and tiles.
from tests.test_grading_ch01 import madd_ok  # noqa: E402
from tests.test_grading_ch04 import rms_ok  # noqa: E402
from tests.test_grading_ch05 import mm_ok  # noqa: E402

GPU = kc.world().gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="speed is graded on a GPU only")
cpu_only = pytest.mark.skipif(GPU, reason="on a GPU the speed check is graded")


def _speed_line(text: str) -> str:
    return next(line for line in text.splitlines() if "copy" in line or "cuBLAS" in line)


# ---- 01.6 matrix add at the memory's speed ----------------------------------------------------------

@cuda.jit
def _add_cols_slow(A, B, C):
    row, col = cuda.grid(2)  # x runs down a column: a warp's threads read 32 different rows
    if row < C.shape[0] and col < C.shape[1]:
        C[row, col] = A[row, col] + B[row, col]


@cuda.jit
def _add_flat_stride(A, B, C):
    # another correct answer: one thread per element of a flat grid-stride loop
    start, stride = cuda.grid(1), cuda.gridsize(1)
    rows, cols = C.shape
    for i in range(start, rows * cols, stride):
        r, c = i // cols, i % cols
        C[r, c] = A[r, c] + B[r, c]


@cuda.jit
def _add_no_bounds(A, B, C):
    col, row = cuda.grid(2)
    C[row, col] = A[row, col] + B[row, col]


def matrix_add_fast(A, B, C):
    grid = ((C.shape[1] + 31) // 32, (C.shape[0] + 7) // 8)
    madd_ok[grid, (32, 8)](A, B, C)


def matrix_add_slow(A, B, C):  # the naive version: correct, uncoalesced
    grid = ((C.shape[0] + 31) // 32, (C.shape[1] + 7) // 8)
    _add_cols_slow[grid, (32, 8)](A, B, C)


def matrix_add_flat(A, B, C):  # correct and coalesced, but 4 blocks of 128 threads cannot keep a GPU's memory busy
    _add_flat_stride[4, 128](A, B, C)


def matrix_add_short_grid(A, B, C):  # forgets the partial blocks
    grid = (C.shape[1] // 32, C.shape[0] // 8)
    madd_ok[grid or (1, 1), (32, 8)](A, B, C)


def matrix_add_no_bounds(A, B, C):
    grid = ((C.shape[1] + 31) // 32, (C.shape[0] + 7) // 8)
    _add_no_bounds[grid, (32, 8)](A, B, C)


@pytest.mark.parametrize("fn", [matrix_add_fast, matrix_add_flat, matrix_add_slow])
def test_01_6_correct_versions_pass_the_correctness_checks(fn):
    passed, text = grade("01.6", matrix_add=fn)
    if GPU and fn is not matrix_add_fast:
        # on a GPU the slow ones fail on speed only (see below for the uncoalesced one)
        assert not passed and all(line.startswith("✔") for line in text.splitlines() if "copy" not in line), text
        return
    assert passed, text


@cpu_only
def test_01_6_speed_is_not_graded_on_the_cpu():
    passed, text = grade("01.6", matrix_add=matrix_add_fast)
    assert passed and "speed needs a GPU (not graded here)" in text
    assert "1 not graded here" in text


@pytest.mark.parametrize("fn, hint", [
    (matrix_add_short_grid, "never written"),
    (madd_ok, "plain Python function"),
])
def test_01_6_rejects_wrong(fn, hint):
    passed, text = grade("01.6", matrix_add=fn)
    assert not passed
    assert hint in text, text


_STATEMENT_SHAPES = {(37, 53), (8, 130), (130, 8), (1000, 1003)}  # the shapes the grader always checks


def matrix_add_for_known_shapes(A, B, C):
    """A launcher tuned to the shapes it has seen: the right grid for those, one block for any other."""
    rows, cols = C.shape
    grid = ((cols + 31) // 32, (rows + 7) // 8) if (rows, cols) in _STATEMENT_SHAPES else (1, 1)
    madd_ok[grid, (32, 8)](A, B, C)


# 978590 drew a 7x20 shape, which one block of 32 x 8 threads covers: the launcher passed it, and failed only
# at 8192x8192 on a GPU, on the values there and not on elements never written
@pytest.mark.parametrize("seed", [None, "7", "8", "978590"])
def test_01_6_a_launcher_for_the_fixed_shapes_fails_on_the_drawn_one(seed, monkeypatch):
    if seed is None:
        monkeypatch.delenv("KC_GRADE_SEED", raising=False)  # a fresh draw, as a learner's run gets
    else:
        monkeypatch.setenv("KC_GRADE_SEED", seed)
    passed, text = grade("01.6", matrix_add=matrix_add_for_known_shapes)
    assert not passed
    failing = [line for line in text.splitlines() if line.startswith("✘")]
    assert failing and "never written" in failing[0] and "the grid must cover every row and every column" in failing[0]
    rows, cols = (int(x) for x in failing[0].split(":")[0].split()[-2].split("x"))
    assert (rows, cols) not in _STATEMENT_SHAPES and "KC_GRADE_SEED=" in text, text


@pytest.mark.skipif(GPU, reason="an out-of-bounds write on a GPU would corrupt this process's context")
def test_01_6_rejects_a_missing_bounds_check():
    passed, text = grade("01.6", matrix_add=matrix_add_no_bounds)
    assert not passed and ("out-of-bounds" in text or "past the end" in text), text


@needs_gpu
def test_01_6_naive_fails_and_solution_passes_on_speed():
    passed, text = grade("01.6", matrix_add=matrix_add_slow)
    assert not passed and "needs at least 60%" in _speed_line(text), text
    passed, text = grade("01.6", matrix_add=matrix_add_fast)
    assert passed, text


# ---- 04.5 RMSNorm on many short rows -------------------------------------------------------------------

@triton.jit
def _rms_rows_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, eps,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, MASK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = cols[None, :] < n_cols
    if MASK_ROWS:
        mask = mask & (rows[:, None] < n_rows)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)


def _rows_launcher(rows_target, mask_rows=True, grid_floor=False):
    def rms_norm_rows(x, w, eps):
        n_rows, n_cols = x.shape
        y = torch.empty_like(x)
        BLOCK = triton.next_power_of_2(n_cols)
        ROWS = max(1, min(64, rows_target // BLOCK))
        grid = max(1, n_rows // ROWS) if grid_floor else triton.cdiv(n_rows, ROWS)
        _rms_rows_kernel[(grid,)](x, w, y, n_rows, n_cols, x.stride(0), y.stride(0), eps, BLOCK=BLOCK, ROWS=ROWS,
                                  MASK_ROWS=mask_rows)
        return y
    return rms_norm_rows


def rms_norm_one_row(x, w, eps):  # the naive version: 04.4's kernel, one row per program
    y = torch.empty_like(x)
    rms_ok[(x.shape[0],)](x, w, y, x.shape[1], x.stride(0), y.stride(0), eps,
                                       BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def rms_norm_torch_without_eps(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) * w.float()).to(x.dtype)


@pytest.mark.parametrize("fn", [_rows_launcher(4096), _rows_launcher(1024), rms_norm_one_row])
def test_04_5_correct_versions_pass_the_correctness_checks(fn):
    passed, text = grade("04.5", rms_norm_rows=fn)
    if GPU and fn is rms_norm_one_row:
        return
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (_rows_launcher(4096, grid_floor=True), "rows from"),
    (rms_norm_torch_without_eps, "max error"),
    (lambda x, w, eps: None, "returned NoneType"),
])
def test_04_5_rejects_wrong(fn, hint):
    passed, text = grade("04.5", rms_norm_rows=fn)
    assert not passed
    assert hint in text, text


@pytest.mark.skipif(GPU, reason="an unmasked out-of-bounds access on a GPU would corrupt this process's context")
def test_04_5_rejects_unmasked_rows():
    passed, text = grade("04.5", rms_norm_rows=_rows_launcher(4096, mask_rows=False))
    assert not passed, text


@needs_gpu
def test_04_5_naive_fails_and_solution_passes_on_speed():
    passed, text = grade("04.5", rms_norm_rows=rms_norm_one_row)
    assert not passed and "needs at least 60%" in _speed_line(text), text
    passed, text = grade("04.5", rms_norm_rows=_rows_launcher(4096))
    assert passed, text


# ---- 05.4 tiles for your GPU ----------------------------------------------------------------------------

from tests.test_grading_ch05 import mm_floor_steps, mm_no_store_mask  # noqa: E402  (05.2's wrong kernels)

GOOD = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3)
NAIVE = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)


@pytest.mark.parametrize("config", [GOOD, NAIVE, dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=2, num_stages=1)])
def test_05_4_correct_configs_pass_the_correctness_checks(config):
    passed, text = grade("05.4", matmul_kernel=mm_ok, matmul_config=config)
    if GPU and config is not GOOD:
        return
    assert passed, text


@pytest.mark.parametrize("config, hint", [
    (dict(GOOD, BLOCK_N=96), "power of two"),
    (dict(GOOD, BLOCK_K=8), "power of two, at least 16"),
    ({k: v for k, v in GOOD.items() if k != "num_stages"}, "has no num_stages"),
    (dict(GOOD, GROUP_M=8), "keys the kernel does not take"),
    ((128, 128, 32), "make it a dict"),
    (dict(GOOD, num_warps=3), "num_warps"),
])
def test_05_4_rejects_wrong_configs(config, hint):
    passed, text = grade("05.4", matmul_kernel=mm_ok, matmul_config=config)
    assert not passed
    assert hint in text, text


@pytest.mark.parametrize("kernel, hint", [
    (mm_floor_steps, "the last, partial K step is missing"),
    # on a GPU the tile's rows and columns past C land in its frame (inside the allocation): the frame check names them
    (mm_no_store_mask, "wrote outside C" if GPU else "past the end of `c_ptr`"),
])
def test_05_4_checks_the_tails_before_speed(kernel, hint):
    """05.2's kernel with a mistake at an edge (K past the last whole step, C past M and N) fails the shape of
    (BLOCK_M + 3) x (BLOCK_N - 5) x (2 BLOCK_K + 7), whatever the tiles, before any timing."""
    passed, text = grade("05.4", matmul_kernel=kernel, matmul_config=GOOD)
    assert not passed
    failing = next(line for line in text.splitlines() if line.startswith("✘"))
    assert failing.startswith("✘ (131x71) @ (71x123) fp16") and hint in failing, text
    assert "cuBLAS" not in text, text


class _OutOfSharedMemory:
    """05.2's kernel launched with a config too big for this GPU's shared memory: Triton raises OutOfResources
    at the launch, at every shape, or (``aligned_only``) only where the operands' sizes are multiples of 16, as
    for a kernel pipelined through shared memory only where its loads can be (the grader's 4096^3 speed shape;
    its tail shapes are not)."""
    fn = mm_ok.fn

    def __init__(self, aligned_only: bool):
        self.aligned_only = aligned_only

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it as matmul_kernel[grid](...)")

    def __getitem__(self, grid):
        def launch(a, b, c, M, N, K, *rest, **meta):
            if not self.aligned_only or (M % 16, N % 16, K % 16) == (0, 0, 0):
                raise triton.runtime.errors.OutOfResources(98304, 65536, "shared memory")
            return mm_ok[grid](a, b, c, M, N, K, *rest, **meta)
        return launch


@pytest.mark.parametrize("aligned_only", [False, pytest.param(True, marks=needs_gpu)])
def test_05_4_a_config_too_big_for_shared_memory_says_what_to_change(aligned_only):
    """A config that does not fit fails with what to change, at the tail shapes or at the speed shape alike."""
    passed, text = grade("05.4", matmul_kernel=_OutOfSharedMemory(aligned_only), matmul_config=GOOD)
    assert not passed
    failing = next(line for line in text.splitlines() if line.startswith("✘"))
    assert "needs more shared memory than this GPU has" in failing, text
    assert "Required: 98304, Hardware limit: 65536" in failing and "smaller tiles or fewer stages" in failing, text
    assert failing.startswith("✘ 4096x4096x4096 fp16" if aligned_only else "✘ (131x71) @ (71x123) fp16"), text


def test_05_4_needs_a_kernel():
    passed, text = grade("05.4", matmul_kernel=lambda *a: None, matmul_config=GOOD)
    assert not passed and "matmul_kernel" in text, text


@needs_gpu
def test_05_4_naive_tiles_fail_and_large_tiles_pass_on_speed():
    from kernelcourse.world import pre_hopper_emulation

    passed, text = grade("05.4", matmul_kernel=mm_ok, matmul_config=NAIVE)
    if pre_hopper_emulation():  # gpu_check --pre-hopper: a shortfall against cuBLAS is declined, with why
        assert "needs 0.5x), not graded here: DISABLE_MMA_V3" in text, text
    else:
        assert not passed and "needs at least 0.5x" in _speed_line(text), text
    passed, text = grade("05.4", matmul_kernel=mm_ok, matmul_config=GOOD)
    assert passed, text


@cpu_only
@pytest.mark.parametrize("exercise, objects", [
    ("01.6", dict(matrix_add=matrix_add_fast)),
    ("04.5", dict(rms_norm_rows=_rows_launcher(4096))),
    ("05.4", dict(matmul_kernel=mm_ok, matmul_config=GOOD)),
])
def test_without_a_gpu_the_speed_line_is_not_graded_never_passed(exercise, objects):
    passed, text = grade(exercise, **objects)
    assert passed, text
    speed = [line for line in text.splitlines() if "speed needs a GPU" in line]
    assert len(speed) == 1 and speed[0].startswith(grading.NOT_GRADED), text
    assert "not graded here" in text.splitlines()[-1], text
