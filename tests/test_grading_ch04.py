"""Chapter 04's graders: typical wrong kernels are rejected with a message that teaches, and
different but correct kernels are accepted. Kernels run in Triton's interpreter on the CPU."""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import kernels
from tests.helpers import grade


def dtype_case(kernel, hint):
    """A kernel computing in float16 where the statement asks for float32, named by the interpreter's dtype
    check (on a GPU only its numbers are graded)."""
    return pytest.param(kernel, hint, marks=pytest.mark.skipif(
        kc.world().gpu, reason="the float32 check runs in Triton's interpreter"))


def address_case(kernel, hint):
    """A wrong kernel that only the interpreter's address check names (skipped on a GPU)."""
    return pytest.param(kernel, hint, marks=pytest.mark.skipif(
        kc.world().gpu, reason="the address check runs in Triton's interpreter; on a GPU this kernel touches memory "
                               "outside its tensors (compute-sanitizer names it) and may take the process down"))

# ---- the reference kernels of kc.kernels -------------------------------------------------------


def test_reference_kernels_match_pytorch():
    torch.manual_seed(0)
    with torch.device(kc.world().device):  # factory calls below make tensors where kernels run
        _check_reference_kernels()


def _check_reference_kernels():
    x, y = torch.randn(4099), torch.randn(4099)
    torch.testing.assert_close(kernels.add(x, y), x + y, rtol=0, atol=0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = (torch.randn(7, 1000) * 100).to(dtype)
        torch.testing.assert_close(kernels.softmax(x).float(), torch.softmax(x.float(), -1), rtol=tol, atol=tol)
        x, r = torch.randn(5, 777, dtype=dtype), torch.randn(5, 777, dtype=dtype)
        w, b = torch.randn(777, dtype=dtype), torch.randn(777, dtype=dtype)
        y, h = kernels.residual_layer_norm(x, r, w, b, activation="gelu", return_residual=True)
        want = F.gelu(F.layer_norm(x.float() + r.float(), (777,), w.float(), b.float()))
        torch.testing.assert_close(y.float(), want, rtol=4 * tol, atol=4 * tol)
        torch.testing.assert_close(h.float(), x.float() + r.float(), rtol=tol, atol=tol)

# ---- 04.1 fused scale + GELU -------------------------------------------------------------------


@triton.jit
def gelu_ok(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


@triton.jit
def gelu_ok_sigmoid_free(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):  # other= given, math spelled differently
    pid = tl.program_id(axis=0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    z = x.to(tl.float32) * scale
    cdf = (tl.erf(z / 1.4142135623730951) + 1.0) / 2.0
    tl.store(y_ptr + offs, (z * cdf).to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def gelu_no_store_mask(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)))


@triton.jit
def gelu_no_load_mask(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=offs < n)


@triton.jit
def gelu_fp16_scale(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):  # scaled in float16, then converted
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    x = (x * scale).to(tl.float32)
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


@triton.jit
def gelu_off_by_one(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - 1
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


@triton.jit
def gelu_no_pid(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


@triton.jit
def gelu_no_scale(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


@triton.jit
def gelu_tanh(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    tanh = 2 * tl.sigmoid(2 * inner) - 1
    tl.store(y_ptr + offs, 0.5 * x * (1 + tanh), mask=mask)


@triton.jit
def gelu_fp16_math(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


def gelu_plain_python(x_ptr, y_ptr, n, scale, BLOCK):
    pass


@pytest.mark.parametrize("kernel", [gelu_ok, gelu_ok_sigmoid_free])
def test_04_1_accepts_correct(kernel):
    passed, text = grade("04.1", scale_gelu_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    # The address check: in the interpreter, a lane outside every tensor stops the launch and is named.
    address_case(gelu_no_store_mask, "writes 24 lane(s) past the end of `y_ptr`, outside every tensor the kernel was given "
                         "(it has no mask)"),
    # The garbage read past x never reaches a stored element: only the address check sees it.
    address_case(gelu_no_load_mask, "reads 24 lane(s) past the end of `x_ptr`, outside every tensor the kernel was given "
                        "(it has no mask)"),
    (gelu_off_by_one, "the mask is offs < n"),
    (gelu_no_pid, "pid * BLOCK + tl.arange(0, BLOCK)"),
    (gelu_no_scale, "multiply x by scale first"),
    (gelu_tanh, "tanh approximation"),
    # Compiled for a GPU, this version stays within the fp16 tolerance; only the interpreter tells it apart.
    pytest.param(gelu_fp16_math, "x.to(tl.float32)",
                 marks=pytest.mark.skipif(kc.world().gpu, reason="fp16 math only in the interpreter")),
    dtype_case(gelu_fp16_scale, "(`x = (x * scale).to(tl.float32)`) computes in fp16: do the math in float32"),
    (gelu_plain_python, "@triton.jit"),
])
def test_04_1_rejects_wrong(kernel, hint):
    passed, text = grade("04.1", scale_gelu_kernel=kernel)
    assert not passed
    assert hint in text, text

# ---- 04.2 2D tiles: add a bias row -------------------------------------------------------------


@triton.jit
def bias_ok(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@triton.jit
def bias_ok_2d_bias(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # the bias loaded as a 2D block
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    inside = (r < n_rows) & (c < n_cols)
    b = tl.load(b_ptr + c + 0 * r, mask=inside)
    tl.store(y_ptr + r * stride_y + c, tl.load(x_ptr + r * stride_x + c, mask=inside) + b, mask=inside)


@triton.jit
def bias_ncols_stride(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@triton.jit
def bias_col_mask_only(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] >= 0) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@triton.jit
def bias_unmasked_bias_load(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):  # the bias past n_cols is read, never stored
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@triton.jit
def bias_per_row(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + rows, mask=rows < n_rows)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[:, None], mask=mask)


@triton.jit
def bias_swapped_pids(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@pytest.mark.parametrize("kernel", [bias_ok, bias_ok_2d_bias])
def test_04_2_accepts_correct(kernel):
    passed, text = grade("04.2", add_bias_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (bias_ncols_stride, "stride_x elements apart"),
    address_case(bias_col_mask_only, "past the end of `x_ptr`, outside every tensor the kernel was given (its mask lets "
                         "them through)"),
    address_case(bias_unmasked_bias_load, "reads 15 lane(s) past the end of `b_ptr`, outside every tensor the kernel was "
                              "given (it has no mask)"),
    (bias_per_row, "one value per column"),
    (bias_swapped_pids, "tl.program_id(0) runs over blocks of rows"),
])
def test_04_2_rejects_wrong(kernel, hint):
    passed, text = grade("04.2", add_bias_kernel=kernel)
    assert not passed
    assert hint in text, text


@triton.jit
def bias_tile_16(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # the 16 x 16 tile it was tried with, whatever the launch passes
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    cols = tl.program_id(1) * 16 + tl.arange(0, 16)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@triton.jit
def bias_tile_32x64(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # a tile as large as the blocks of the cases it saw pass: 32 x 64
    rows = tl.program_id(0) * 32 + tl.arange(0, 32)
    cols = tl.program_id(1) * 64 + tl.arange(0, 64)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], x + b[None, :], mask=mask)


@pytest.mark.parametrize("seed", [None, "7", "8"])
@pytest.mark.parametrize("kernel", [bias_tile_16, bias_tile_32x64])
def test_04_2_rejects_a_tile_of_its_own(kernel, seed, monkeypatch):
    # the 32 x 64 tile covered every case but a drawn one with BLOCK_M=64 or BLOCK_N=128, and passed most runs;
    # the grader now launches once with the largest blocks it draws, so it fails on every run
    if seed is None:
        monkeypatch.delenv("KC_GRADE_SEED", raising=False)  # a fresh draw, as a learner's run gets
    else:
        monkeypatch.setenv("KC_GRADE_SEED", seed)
    passed, text = grade("04.2", add_bias_kernel=kernel)
    assert not passed
    assert "never written" in text and "use the BLOCK_M and BLOCK_N the launch passes" in text, text


@triton.jit
def bias_one_stride(x_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):  # x's offsets reused for y: stride_y ignored, as if it were stride_x
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * stride_x + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask)
    b = tl.load(b_ptr + cols, mask=cols < n_cols)
    tl.store(y_ptr + offs, x + b[None, :], mask=mask)


def test_04_2_rejects_a_kernel_that_ignores_stride_y():
    # the grader's stride_y always differs from stride_x: a kernel that uses one for both is named, on a GPU as on
    # the CPU (y's stride is the wider, so the stores land inside y's rows, not past its end)
    passed, text = grade("04.2", add_bias_kernel=bias_one_stride)
    assert not passed
    assert "y was stored with x's row stride" in text and "each tensor with its own stride" in text, text

# ---- 04.3 row log-softmax ----------------------------------------------------------------------


@triton.jit
def lsm_ok(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    y = z - tl.log(tl.sum(tl.exp(z), axis=0))
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


@triton.jit
def lsm_ok_exp2(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):  # base-2 exp and log, where
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp2((x - m) * 1.4426950408889634), axis=0)
    y = tl.where(cols < n_cols, x - m - tl.log2(s) * 0.6931471805599453, 0.0)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def lsm_no_max(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    y = x - tl.log(tl.sum(tl.exp(x), axis=0))
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


@triton.jit
def lsm_zero_padding(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z = x - tl.max(x, axis=0)
    y = z - tl.log(tl.sum(tl.exp(z), axis=0))
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


@triton.jit
def lsm_softmax(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * stride_y + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def lsm_forgets_max(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    y = x - tl.log(tl.sum(tl.exp(x - tl.max(x, axis=0)), axis=0))
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


@triton.jit
def lsm_ncols_stride(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    tl.store(y_ptr + row * stride_y + cols, z - tl.log(tl.sum(tl.exp(z), axis=0)), mask=mask)


@triton.jit
def lsm_no_store_mask(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    tl.store(y_ptr + row * stride_y + cols, z - tl.log(tl.sum(tl.exp(z), axis=0)))


@triton.jit
def lsm_fp16_shift(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    # the shift and the final subtraction in the input's dtype: float16 arithmetic, float32 only for exp
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf"))
    z = x - tl.max(x, axis=0).to(x.dtype)
    y = z - tl.log(tl.sum(tl.exp(z.to(tl.float32)), axis=0)).to(x.dtype)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


@pytest.mark.parametrize("kernel", [lsm_ok, lsm_ok_exp2])
def test_04_3_accepts_correct(kernel):
    passed, text = grade("04.3", log_softmax_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (lsm_no_max, "subtract the row max"),
    (lsm_zero_padding, "other=-float('inf')"),
    (lsm_softmax, "that is softmax"),
    (lsm_forgets_max, "subtract the max from x as well"),
    (lsm_ncols_stride, "stride_x elements apart"),
    dtype_case(lsm_fp16_shift, "(`z = x - tl.max(x, axis=0).to(x.dtype)`) computes in fp16: do the math in float32"),
    address_case(lsm_no_store_mask, "past the end of `y_ptr`, outside every tensor the kernel was given (it has no mask)"),
])
def test_04_3_rejects_wrong(kernel, hint):
    passed, text = grade("04.3", log_softmax_kernel=kernel)
    assert not passed
    assert hint in text, text

# ---- 04.4 RMSNorm ------------------------------------------------------------------------------


@triton.jit
def rms_ok(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_ok_rsqrt(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.rsqrt(ms + eps)) * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def rms_block_mean(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_no_eps(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_no_weight(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd, mask=mask)


@triton.jit
def rms_fp16_stats(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    ms = tl.sum(x * x, axis=0) / n_cols
    tl.store(y_ptr + row * stride_y + cols, x / tl.sqrt(ms.to(tl.float32) + eps) * w, mask=mask)


@triton.jit
def rms_no_load_mask(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_own_eps(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + 1e-5)  # the statement's eps, written in
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@triton.jit
def rms_ncols_stride(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)  # rows taken as packed
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


@pytest.mark.parametrize("kernel", [rms_ok, rms_ok_rsqrt])
def test_04_4_accepts_correct(kernel):
    passed, text = grade("04.4", rms_norm_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (rms_block_mean, "not BLOCK"),
    (rms_no_eps, "add eps inside the square root"),
    (rms_own_eps, "use the eps argument"),
    (rms_ncols_stride, "rows of x are stride_x elements apart, not n_cols"),
    (rms_no_weight, "multiply by the weight"),
    dtype_case(rms_fp16_stats, "(`ms = tl.sum(x * x, axis=0) / n_cols`) computes in fp16: do the math in float32"),
    address_case(rms_no_load_mask, "past the end of `x_ptr`, outside every tensor the kernel was given (it has no mask)"),
])
def test_04_4_rejects_wrong(kernel, hint):
    passed, text = grade("04.4", rms_norm_kernel=kernel)
    assert not passed
    assert hint in text, text


# ---- one harness ---------------------------------------------------------------------------------------


def test_one_harness_shared_by_chapters_04_to_06():
    from kernelcourse.grading import ch04, ch05, ch06, harness

    # chapters 05 and later import the harness from ch04 too: the names stay, and are the harness's own
    for name in ("not_a_kernel", "torch_dtype", "framed", "launch", "diagnose", "compare_rows", "rand", "sizes",
                 "tolerance", "exact", "host", "data_mask", "outside_writes", "nothing_written", "STUB", "NAN"):
        assert getattr(ch04, name) is getattr(harness, name), name
    assert ch05.diagnose is harness.diagnose and ch06.diagnose is harness.diagnose
    assert not any(hasattr(ch06, n) for n in ("_framed_heads", "_torch_dtype", "_matches", "_diagnose"))


def test_the_tolerance_rule_is_compares():
    import numpy as np

    from kernelcourse.grading import compare, harness

    truth = np.linspace(-3, 5, 50)
    reference = truth + np.where(np.arange(50) == 7, 1e-4, 0.0)
    tol = harness.tolerance(truth, reference, np.float32)
    assert tol == pytest.approx(2e-4)
    assert compare((truth + 0.9 * tol).astype(np.float32), truth, reference, what="x",
                   rtol_floor=harness.rounding_floor(np.float32))[0]
    assert not compare((truth + 1.5 * tol).astype(np.float32), truth, reference, what="x",
                       rtol_floor=harness.rounding_floor(np.float32))[0]


def test_diagnose_names_the_nearest_mistake_and_nothing_for_a_mistake_that_changes_nothing():
    import numpy as np

    from kernelcourse.grading.harness import diagnose

    truth = np.arange(1.0, 6.0)
    mistakes = [("doubled", 2 * truth), ("shifted", truth + 1), ("same", truth + 1e-9)]
    assert diagnose(2 * truth + 1e-3, mistakes, truth=truth) == "doubled"
    assert diagnose(truth + 1.01, mistakes, truth=truth) == "shifted"
    assert diagnose(truth + 0.5, mistakes, truth=truth) is None
    assert diagnose(np.full(5, np.nan), [("nan", np.full(5, np.nan))], truth=truth) == "nan"


def test_call_stops_an_exercise_on_an_exception_or_none():
    from kernelcourse.grading import Report, Stop, call

    lines = []
    report = Report(exercise=None, sink=lines.append)
    assert call(report, "f()", lambda: 3) == 3
    with pytest.raises(Stop):
        call(report, "f()", lambda: 1 / 0)
    with pytest.raises(Stop):
        call(report, "g()", lambda: None)
    assert len(lines) == 2 and lines[0].startswith("✘ f(): ZeroDivisionError: division by zero (line ")
    assert lines[1] == "✘ g() returned None: did you forget `return`?"
    # in a grader, the stop ends that exercise with its one line
    passed, text = grade("04.1", scale_gelu_kernel=gelu_plain_python)
    assert not passed and text.count("✘") == 1


# ---- 04.6 fused GroupNorm + SiLU ---------------------------------------------------------------------


class GroupNormWith:
    """The kernel below launched with its MISTAKE constexpr set: what a learner's kernel with that mistake does."""

    def __init__(self, mistake):
        self.fn, self.mistake = gn_kernel.fn, mistake

    def __getitem__(self, grid):
        return lambda *args, **meta: gn_kernel[grid](*args, MISTAKE=self.mistake, **meta)

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a kernel is launched as kernel[grid](...)")


@triton.jit
def gn_kernel(x_ptr, w_ptr, b_ptr, y_ptr, C, HW, n_groups, eps, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    # sum and sum of squares in one sweep (no shift), a second sweep to store: a correct alternative to
    # the package's kernel, and, with MISTAKE set, the typical wrong versions
    pid = tl.program_id(0).to(tl.int64)
    if MISTAKE == "groups32":  # Stable Diffusion's 32 groups, written in
        n_groups = 32
    per = C // n_groups
    n = per * HW
    start_el = pid * n
    group = pid % n_groups
    lanes = tl.arange(0, BLOCK)
    STEP: tl.constexpr = 256 if MISTAKE == "hardcoded" else BLOCK
    if MISTAKE == "fp16":
        acc = tl.zeros((BLOCK,), dtype=tl.float16)
        acc_sq = tl.zeros((BLOCK,), dtype=tl.float16)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, STEP):
        offs = start + lanes
        mask = offs < n
        if MISTAKE == "interleaved":  # channel group + i * n_groups instead of group * per + i
            addr = (pid // n_groups) * C * HW + (group + (offs // HW) * n_groups) * HW + offs % HW
        else:
            addr = start_el + offs
        if MISTAKE == "unmasked":
            v = tl.load(x_ptr + addr)
        else:
            v = tl.load(x_ptr + addr, mask=mask, other=0.0)
        if MISTAKE != "fp16":
            v = v.to(tl.float32)
        acc += v
        acc_sq += v * v
    mean = tl.sum(acc, axis=0).to(tl.float32) / n
    if MISTAKE == "n-1":
        var = (tl.sum(acc_sq, axis=0) - n * mean * mean) / (n - 1)
    else:
        var = tl.sum(acc_sq, axis=0).to(tl.float32) / n - mean * mean
    rstd = 1.0 / tl.sqrt(var + (1e-5 if MISTAKE == "own_eps" else eps))
    for start in range(0, n, STEP):
        offs = start + lanes
        mask = offs < n
        if MISTAKE == "interleaved":
            channel = group + (offs // HW) * n_groups
            addr = (pid // n_groups) * C * HW + channel * HW + offs % HW
        else:
            channel = group * per + offs // HW
            addr = start_el + offs
        if MISTAKE == "channel_in_group":
            channel = offs // HW
        v = tl.load(x_ptr + addr, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        xhat = (v - mean) * rstd
        if MISTAKE == "silu_first":
            z = xhat * tl.sigmoid(xhat) * w + b
        else:
            z = xhat * w + b
            z = z * tl.sigmoid(z)
        tl.store(y_ptr + addr, z.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gn_stub(x_ptr, w_ptr, b_ptr, y_ptr, C, HW, n_groups, eps, BLOCK: tl.constexpr):
    pass


@pytest.mark.parametrize("kernel", [GroupNormWith(""), kernels.group_norm_silu_kernel], ids=["one sweep", "shifted"])
def test_04_6_accepts_correct(kernel):
    passed, text = grade("04.6", group_norm_silu_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("mistake, hint", [
    dtype_case("fp16", "computes in fp16: do the math in float32"),
    ("n-1", "the variance divides by n - 1"),
    ("silu_first", "SiLU comes after the affine"),
    ("channel_in_group", "w and b are indexed by the channel within the group"),
    ("interleaved", "a group is C // n_groups consecutive channels"),
    address_case("unmasked", "past the end of `x_ptr`, outside every tensor the kernel was given (it has no mask)"),
    ("hardcoded", "wrong with BLOCK=64: use the BLOCK argument everywhere"),
    ("own_eps", "use the eps argument"),
    ("groups32", "with the C, HW and n_groups the launch passes (here 6, 35 and 3: the grader varies them)"),
])
def test_04_6_rejects_wrong(mistake, hint):
    passed, text = grade("04.6", group_norm_silu_kernel=GroupNormWith(mistake))
    assert not passed
    assert hint in text, text


def test_04_6_stub_fails():
    passed, text = grade("04.6", group_norm_silu_kernel=gn_stub)
    assert not passed and "stub" in text, text
# ---- what the statements leave free: launch parameters, layouts, dtypes --------------------------------


@triton.jit
def gelu_fixed_block(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):  # 128 elements a program, whatever BLOCK is
    offs = tl.program_id(0) * 128 + tl.arange(0, 128)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
    tl.store(y_ptr + offs, 0.5 * x * (1 + tl.erf(x * 0.7071067811865476)), mask=mask)


def test_04_1_rejects_a_block_of_its_own():
    passed, text = grade("04.1", scale_gelu_kernel=gelu_fixed_block)
    assert not passed and "use the BLOCK the launch passes" in text, text


@triton.jit
def log_softmax_fixed_block(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, 1024)  # enough for every row the statement shows, not for every row
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    y = z - tl.log(tl.sum(tl.exp(z), axis=0))
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def test_04_3_rejects_a_block_of_its_own():
    passed, text = grade("04.3", log_softmax_kernel=log_softmax_fixed_block)
    assert not passed and "use the BLOCK the launch passes" in text, text


@triton.jit
def rms_norm_fixed_block(x_ptr, w_ptr, y_ptr, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, 1024)  # enough for every row the statement shows, not for every row
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * stride_y + cols, x * rstd * w, mask=mask)


def test_04_4_rejects_a_block_of_its_own():
    passed, text = grade("04.4", rms_norm_kernel=rms_norm_fixed_block)
    assert not passed and "never written" in text and "use the BLOCK the launch passes" in text, text


@triton.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rows_kernel_fp16(x_ptr, w_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, eps, BLOCK: tl.constexpr,
                      ROWS: tl.constexpr):  # the sum of squares in the input's dtype: float16 for float16 rows
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(ms.to(tl.float32) + eps)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)


def rows_launcher(packed=False, out_dtype=None, kernel=None, block=None):
    def rms_norm_rows(x, w, eps):
        n_rows, n_cols = x.shape
        y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)  # contiguous, whatever x is
        BLOCK = block or triton.next_power_of_2(n_cols)
        ROWS = max(1, 2048 // BLOCK)
        (kernel or _rows_kernel)[(triton.cdiv(n_rows, ROWS),)](x, w, y, n_rows, n_cols, n_cols if packed else x.stride(0),
                                                               y.stride(0), eps, BLOCK=BLOCK, ROWS=ROWS)
        return y
    return rms_norm_rows


def test_04_5_rejects_an_eps_of_its_own():
    launcher = rows_launcher()
    passed, text = grade("04.5", rms_norm_rows=lambda x, w, eps: launcher(x, w, 1e-5))
    assert not passed and "use the eps argument" in text, text


@pytest.mark.parametrize("block", [64, 128])
def test_04_5_rejects_a_block_fixed_for_the_heads_it_was_written_for(block):
    # rows of 64 or 128 values, as the statement's QK-norm heads: BLOCK written in, not taken from n_cols. The
    # columns past it keep whatever torch.empty left there (NaN at times): the hint must not be float16's overflow
    passed, text = grade("04.5", rms_norm_rows=rows_launcher(block=block))
    assert not passed
    assert f"only the first {block} values of each row were normalised" in text, text
    assert "choose BLOCK from n_cols, triton.next_power_of_2(n_cols)" in text and "overflows" not in text, text


def test_04_5_accepts_a_strided_x():
    passed, text = grade("04.5", rms_norm_rows=rows_launcher())
    assert passed and "elements apart" in text, text


@pytest.mark.parametrize("fn, hint", [
    (rows_launcher(packed=True), "the rows were read as if packed"),
    (rows_launcher(out_dtype=torch.float32), "allocate y with x's dtype"),
])
def test_04_5_rejects_a_fixed_layout_or_dtype(fn, hint):
    passed, text = grade("04.5", rms_norm_rows=fn)
    assert not passed and hint in text, text


@pytest.mark.skipif(kc.world().gpu, reason="the float32 check runs in Triton's interpreter")
def test_04_5_rejects_float16_arithmetic():
    passed, text = grade("04.5", rms_norm_rows=rows_launcher(kernel=_rows_kernel_fp16))
    assert not passed and "computes in fp16: do the math in float32" in text, text
