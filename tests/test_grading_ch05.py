"""Chapter 05's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted. Kernels run in Triton's interpreter on the CPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import kernels
from kernelcourse.grading import ch05
from tests.helpers import grade, memorised


def address_case(kernel, hint):
    """A wrong kernel that only the interpreter's address check names (skipped on a GPU)."""
    return pytest.param(kernel, hint, marks=pytest.mark.skipif(
        kc.world().gpu, reason="the address check runs in Triton's interpreter; on a GPU this kernel touches memory "
                               "outside its tensors (compute-sanitizer names it) and may take the process down"))

# ---- the reference matmul of kc.kernels --------------------------------------------------------


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 1e-2)])
def test_reference_matmul(dtype, tol):
    torch.manual_seed(0)
    if kc.world().gpu and dtype == torch.float32:
        tol = 2e-2  # tl.dot rounds float32 inputs to TF32 (10 mantissa bits) on a GPU
    dev = kc.world().device
    a, b = torch.randn(100, 70, dtype=dtype, device=dev), torch.randn(70, 45, dtype=dtype, device=dev)
    want = (a.double() @ b.double())
    torch.testing.assert_close(kernels.matmul(a, b).double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(kernels.matmul(a, b, activation="gelu").double(), F.gelu(want), rtol=tol, atol=tol)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, GROUP_M=2)  # B transposed, other tiles, a short last group
    torch.testing.assert_close(kernels.matmul(a, b.t().contiguous().t(), config=cfg).double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_pid_m, num_pid_n, group_m", [(5, 3, 2), (8, 8, 8), (3, 9, 4), (1, 6, 8)])
def test_grouped_tile_is_a_permutation(num_pid_m, num_pid_n, group_m):
    tiles = [kernels.grouped_tile(p, num_pid_m, num_pid_n, group_m) for p in range(num_pid_m * num_pid_n)]
    assert sorted(tiles) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]


def test_tf32_keeps_ten_mantissa_bits():
    x = np.array([1 + 2**-10, 1 + 2**-11, -3.0 - 2**-9 - 2**-12], dtype=np.float32)
    assert ch05.tf32(x).tolist() == [1 + 2**-10, 1.0, -3.0 - 2**-9]

# ---- 05.1 which program computes a tile --------------------------------------------------------


def program_ok(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
    first = pid_m // group_m * group_m
    rows = min(num_pid_m - first, group_m)
    return first * num_pid_n + pid_n * rows + pid_m - first


def program_ok_search(pid_m, pid_n, num_pid_m, num_pid_n, group_m):  # by brute force: also right
    return next(p for p in range(num_pid_m * num_pid_n)
                if kernels.grouped_tile(p, num_pid_m, num_pid_n, group_m) == (pid_m, pid_n))


def test_05_1_cases_are_fresh_every_run(monkeypatch):
    """A table of one run's answers fails the next run: the grader adds grids drawn fresh."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    recording, table = memorised(program_ok, default=-1)
    assert grade("05.1", grouped_program=recording)[0]
    passed, text = grade("05.1", grouped_program=table)
    assert not passed and "KC_GRADE_SEED=" in text, text


@pytest.mark.parametrize("fn", [program_ok, program_ok_search])
def test_05_1_accepts_correct(fn):
    passed, text = grade("05.1", grouped_program=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (ch05._row_major, "row-major order"),
    (ch05._full_groups_only, "the last group can be shorter"),
    (lambda m, n, nm, nn, g: n * min(nm - m // g * g, g) + m % g, "the groups before this one"),
    (lambda m, n, nm, nn, g: m + n, "the groups before this one hold first_pid_m * num_pid_n programs"),
    (lambda m, n, nm, nn, g: None, "forget `return`"),
    (lambda m, n, nm, nn, g: (m, n), "is an int"),
])
def test_05_1_rejects_wrong(fn, hint):
    passed, text = grade("05.1", grouped_program=fn)
    assert not passed
    assert hint in text, text


# ---- 05.2 the K loop with masks ----------------------------------------------------------------


@triton.jit
def mm_ok(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_k_mask_only(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                    stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # recomputes the pointers from k0 each step, but masks only the K tail: B's columns past N are read
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak, mask=rk[None, :] < K, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=rk[:, None] < K, other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def mm_no_k_mask(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_floor_steps(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_no_advance(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_overwrites_acc(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                      stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_no_store_mask(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                     stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc)


@triton.jit
def mm_assumes_row_major_b(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                           stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * N
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_ok_wrapped(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # rows and columns wrapped with % M and % N (every address inside A and B), only the K tail masked
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak, mask=rk[None, :] < K, other=0.0)
        b = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=rk[:, None] < K, other=0.0)
        acc += tl.dot(a, b)
    om = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    on = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + om[:, None] * stride_cm + on[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(om[:, None] < M) & (on[None, :] < N))


@triton.jit
def mm_unit_ak(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A's K stride taken as 1: right for a row-major A only
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def mm_unit_cn(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # C's column stride taken as 1: right for a row-major C only
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@pytest.mark.parametrize("kernel", [mm_ok, mm_ok_wrapped])
def test_05_2_accepts_correct(kernel):
    passed, text = grade("05.2", matmul_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    address_case(mm_no_k_mask, "(its mask lets them through)"),
    # B's columns past N (and A's rows past M) are read and never stored: only the address check sees it.
    address_case(mm_k_mask_only, "past the end of `b_ptr`, outside every tensor the kernel was given (its mask lets them "
                      "through)"),
    (mm_floor_steps, "loop over tl.cdiv(K, BLOCK_K) steps"),
    (mm_no_advance, "advance a_ptrs by BLOCK_K * stride_ak"),
    (mm_overwrites_acc, "add each step to the accumulator"),
    address_case(mm_no_store_mask, "past the end of `c_ptr`, outside every tensor the kernel was given (it has no mask)"),
    (mm_assumes_row_major_b, "check the strides"),
    (mm_unit_ak, "A is column-major"),
    (mm_unit_cn, "C is a transposed view"),
])
def test_05_2_rejects_wrong(kernel, hint):
    passed, text = grade("05.2", matmul_kernel=kernel)
    assert not passed
    assert hint in text, text

@triton.jit
def mm_mistakes(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MISTAKE: tl.constexpr):
    """mm_ok with one typical mistake, picked by MISTAKE."""
    if MISTAKE == "tiles_of_32":  # an example's tile size written in: the launch's BLOCK_M/N/K never used
        offs_m = tl.program_id(0) * 32 + tl.arange(0, 32)
        offs_n = tl.program_id(1) * 32 + tl.arange(0, 32)
        offs_k = tl.arange(0, 32)
        acc = tl.zeros((32, 32), dtype=tl.float32)
        step: tl.constexpr = 32
    else:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        step: tl.constexpr = BLOCK_K
        if MISTAKE == "acc_in_c_dtype":  # float16 whenever C is: the sum is rounded to float16 at every step
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        elif MISTAKE == "acc_in_a_dtype":  # float16 whenever A is, tl.dot told to sum in it too
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=a_ptr.dtype.element_ty)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    for k in range(0, tl.cdiv(K, step)):
        k_left = K - k * step
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if MISTAKE == "acc_in_c_dtype":
            acc += tl.dot(a, b).to(c_ptr.dtype.element_ty)
        elif MISTAKE == "acc_in_a_dtype":
            acc = tl.dot(a, b, acc, out_dtype=a_ptr.dtype.element_ty)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += step * stride_ak
        b_ptrs += step * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class WithMistake:
    """A kernel with a MISTAKE constexpr, launched as the exercise's kernel is: kernel[grid](...)."""

    def __init__(self, kernel, mistake):
        self.kernel, self.mistake, self.fn = kernel, mistake, kernel.fn

    def __getitem__(self, grid):
        return lambda *args, **meta: self.kernel[grid](*args, MISTAKE=self.mistake, **meta)

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it as kernel[grid](...)")


def test_05_2_accepts_the_mistake_kernel_without_a_mistake():
    passed, text = grade("05.2", matmul_kernel=WithMistake(mm_mistakes, "none"))
    assert passed, text


def test_05_2_rejects_tiles_of_its_own():
    """A kernel that writes in 32 x 32 tiles passed whenever the tiles drawn were 16 or 32 (4 runs in 9): a
    fixed case has 64 x 64 tiles, and the hint says which rows and columns were written."""
    passed, text = grade("05.2", matmul_kernel=WithMistake(mm_mistakes, "tiles_of_32"))
    assert not passed
    assert "BLOCK_M/N/K = 64/64/16" in text and "only the rows below 64 and the columns below 64" in text, text
    assert "build offs_m, offs_n and the accumulator from BLOCK_M and BLOCK_N" in text, text


@pytest.mark.parametrize("mistake, case", [
    # float16 where C is: float32 cases pass, and fp16 ones round away digits no fp16 output shows, except in
    # the case whose later K steps each add less than half a float16 step to the sum
    ("acc_in_c_dtype", "a large product, then small ones"),
    # float16 where A is: shows where C is float32
    ("acc_in_a_dtype", "fp16 A and B, fp32 C"),
])
def test_05_2_rejects_a_float16_accumulator(mistake, case):
    """The statement asks for a float32 accumulator; a float16 one passed every case before."""
    passed, text = grade("05.2", matmul_kernel=WithMistake(mm_mistakes, mistake))
    assert not passed
    failing = next(line for line in text.splitlines() if line.startswith("✘"))
    assert case in failing and "this is what a float16 accumulator gives: accumulate in float32" in failing, text


class Copied:
    """A "kernel" that answers from a book kept in a file (the grader runs it in a child process): ``record``
    launches ``kernel`` and writes down the output (argument ``out``) it made for each launch's sizes, strides
    and tiles; otherwise it copies the output written down for the same launch, if any."""

    def __init__(self, kernel, book, out, record):
        self.kernel, self.book, self.out, self.record, self.fn = kernel, book, out, record, kernel.fn

    def __getitem__(self, grid):
        import pickle

        def launch(*args, **meta):
            key = (grid, tuple(a for a in args if isinstance(a, int)), tuple(sorted(meta.items())))
            seen = pickle.loads(self.book.read_bytes()) if self.book.exists() else {}
            if self.record:
                self.kernel[grid](*args, **meta)
                seen[key] = args[self.out].cpu().numpy()
                self.book.write_bytes(pickle.dumps(seen))
            elif key in seen:
                args[self.out].copy_(torch.from_numpy(seen[key]))
        return launch

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it as kernel[grid](...)")


# ---- 05.3 fused epilogue: bias + leaky ReLU ----------------------------------------------------


@triton.jit
def linear_epilogues(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_wk, stride_wn,
                     stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EPILOGUE: tl.constexpr):
    """The exercise's kernel, with its epilogue picked by EPILOGUE (right ones and typical wrong ones)."""
    if EPILOGUE == "tiles_of_32":  # the right epilogue, in tiles of an example's size: BLOCK_M and BLOCK_N unused
        offs_m = tl.program_id(0) * 32 + tl.arange(0, 32)
        offs_n = tl.program_id(1) * 32 + tl.arange(0, 32)
        acc = tl.zeros((32, 32), dtype=tl.float32)
    else:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + (offs_n % N)[None, :] * stride_wn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if EPILOGUE == "ok" or EPILOGUE == "tiles_of_32":
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        acc = tl.where(acc >= 0, acc, 0.01 * acc)
    elif EPILOGUE == "bias_unmasked":  # the bias read at every column of the tile, past N too
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        acc = tl.where(acc >= 0, acc, 0.01 * acc)
    elif EPILOGUE == "ok_max":  # leaky ReLU as max(x, 0.01 x), the bias loaded without other=
        x = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N)[None, :]
        acc = tl.maximum(x, 0.01 * x)
    elif EPILOGUE == "relu":
        acc = tl.maximum(acc + tl.load(bias_ptr + offs_n, mask=offs_n < N)[None, :], 0.0)
    elif EPILOGUE == "act_then_bias":
        acc = tl.where(acc >= 0, acc, 0.01 * acc) + tl.load(bias_ptr + offs_n, mask=offs_n < N)[None, :]
    elif EPILOGUE == "bias_per_row":
        acc += tl.load(bias_ptr + offs_m, mask=offs_m < M)[:, None]
        acc = tl.where(acc >= 0, acc, 0.01 * acc)
    elif EPILOGUE == "no_bias":
        acc = tl.where(acc >= 0, acc, 0.01 * acc)
    elif EPILOGUE == "unit_cn":  # the right epilogue, stored as if C's columns were always 1 element apart
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        acc = tl.where(acc >= 0, acc, 0.01 * acc)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * (1 if EPILOGUE == "unit_cn" else stride_cn)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


class WithEpilogue:
    """linear_epilogues with one EPILOGUE, launched as the exercise's kernel is: kernel[grid](...)."""

    def __init__(self, epilogue):
        self.epilogue, self.fn = epilogue, linear_epilogues.fn

    def __getitem__(self, grid):
        return lambda *args, **meta: linear_epilogues[grid](*args, EPILOGUE=self.epilogue, **meta)

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it as kernel[grid](...)")


@pytest.mark.parametrize("epilogue", ["ok", "ok_max"])
def test_05_3_accepts_correct(epilogue):
    passed, text = grade("05.3", linear_leaky_relu_kernel=WithEpilogue(epilogue))
    assert passed, text


@pytest.mark.parametrize("epilogue, hint", [
    ("none", "that is a @ w alone"),
    ("relu", "not 0"),
    ("act_then_bias", "add the bias before the activation"),
    ("bias_per_row", "one value per column"),
    ("no_bias", "load the bias"),
    ("unit_cn", "here C is a transposed view"),
])
def test_05_3_rejects_wrong(epilogue, hint):
    passed, text = grade("05.3", linear_leaky_relu_kernel=WithEpilogue(epilogue))
    assert not passed
    assert hint in text, text


def test_05_3_rejects_tiles_of_its_own():
    """Tiles of 32 passed whenever the tiles drawn were 16 or 32: a fixed case has 64 x 64 tiles."""
    passed, text = grade("05.3", linear_leaky_relu_kernel=WithEpilogue("tiles_of_32"))
    assert not passed
    assert "BLOCK_M/N/K = 64/64/16" in text and "only the rows below 64 and the columns below 64" in text, text
    assert "from BLOCK_M and BLOCK_N, never from a tile size of your own" in text, text


@pytest.mark.skipif(kc.world().gpu, reason="the address check runs in Triton's interpreter; on a GPU the lanes past N "
                                           "read the bias's frame and are never stored, so nothing shows")
def test_05_3_rejects_an_unmasked_bias_load():
    """The bias has N values; a tile's columns run past N at the right edge, and so does an unmasked load."""
    passed, text = grade("05.3", linear_leaky_relu_kernel=WithEpilogue("bias_unmasked"))
    assert not passed
    assert "past the end of `bias_ptr`" in text and "(it has no mask)" in text, text


@pytest.mark.parametrize("exercise, name, kernel, out", [
    ("05.2", "matmul_kernel", mm_ok, 2),
    ("05.3", "linear_leaky_relu_kernel", WithEpilogue("ok"), 3),
])
def test_05_2_and_05_3_draw_their_values_on_every_run(exercise, name, kernel, out, monkeypatch, tmp_path):
    """Outputs copied from one run (keyed by the launch's sizes, strides and tiles) answer nothing on the next:
    every case's values are drawn fresh."""
    book = tmp_path / "answers.pkl"
    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade(exercise, **{name: Copied(kernel, book, out, record=True)})[0]
    same = grade(exercise, **{name: Copied(kernel, book, out, record=False)})
    assert same[0], same[1]  # the same run's cases: the copy answers them
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    passed, text = grade(exercise, **{name: Copied(kernel, book, out, record=False)})
    assert not passed and "max error" in text and "KC_GRADE_SEED=22" in text, text
