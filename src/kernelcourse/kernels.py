"""The course's Triton kernels in their final form, with their launchers (chapters 04 and 05).

The lessons build each kernel step by step, inline; this module keeps the finished versions in one
place so that later chapters and the tests import them instead of copying them:

- chapter 04: ``add`` (vector add), ``softmax`` (row softmax: one row per program, several short
  rows per program),
  ``residual_layer_norm`` (residual add + LayerNorm, optionally + GELU, in one pass);
- chapter 05: ``matmul`` (tiled, grouped program order, K tail masks, an activation fused into the
  epilogue), the matmul that chapter 06's FlashAttention builds on.

Import it after ``kc.setup()``: Triton reads the interpreter switch when a kernel is defined. On a GPU
the launchers let ``triton.autotune`` pick ``num_warps`` (and, for the matmul, tile sizes and
``num_stages``) the first time each shape is seen; on the CPU they use fixed choices, because the
interpreter has nothing to time.

Chapter 09 adds, at the end, a lean launch path for the softmax, the residual LayerNorm and the matmul
(``softmax_lean``, ``residual_layer_norm_lean``, ``matmul_lean``: the launch options looked up once per
shape key instead of worked out on every call) and makes each a PyTorch operator,
``torch.ops.kernelcourse.softmax``, ``.residual_layer_norm`` and ``.matmul``, that ``torch.compile`` keeps
in its graph and autograd differentiates.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bench import gpu_time_for_autotune
from .launch import direct, specialization
from .world import device_capability, gpu_properties, world

__all__ = ["add", "softmax", "residual_layer_norm", "matmul", "grouped_tile", "softmax_num_warps",
           "softmax_lean", "residual_layer_norm_lean", "matmul_lean", "SoftmaxFunction", "TritonMatmul",
           "add_kernel", "softmax_kernel", "softmax_rows_kernel", "residual_layer_norm_kernel", "matmul_kernel", "MATMUL_CONFIGS"]

# ---- chapter 04 --------------------------------------------------------------------------------


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program's block runs past n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, BLOCK: int = 1024) -> torch.Tensor:
    """``x + y`` for contiguous tensors of one shape (chapter 04)."""
    assert x.shape == y.shape and x.is_contiguous() and y.is_contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    add_kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)
    return out


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2^31 on large inputs
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Padding is -inf: it never wins the max, and exp(-inf) = 0 adds nothing to the sum.
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)  # the largest exponent is exp(0) = 1: no overflow
    num = tl.exp(x)
    y = num * (1.0 / tl.sum(num, axis=0))
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax_num_warps(BLOCK: int) -> int:
    """A fixed choice of warps for a row of BLOCK elements: about 16 elements per thread."""
    return max(1, min(16, BLOCK // 512))


@triton.jit
def softmax_rows_kernel(x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # ROWS rows per program: a short row leaves one program too little work to cover its start-up
    # and the latency of its loads; a (ROWS, BLOCK) tile gives each program ROWS times as much.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # (ROWS,)
    cols = tl.arange(0, BLOCK)                                          # (BLOCK,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)           # (ROWS, BLOCK)
    # Padding is -inf, as in softmax_kernel; rows past n_rows (never stored) hold 0, not a row of -inf.
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    x = tl.where(rows[:, None] < n_rows, x, 0.0)
    x = x - tl.max(x, axis=1)[:, None]  # one max per row
    num = tl.exp(x)
    y = num * (1.0 / tl.sum(num, axis=1))[:, None]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# Rows up to SHORT_ROW elements (padded) go several to a program. From 1024 elements on, one row per
# program was as fast on an H100, its GPU time measured without launches (lesson 04, section 4b).
SHORT_ROW = 512
ROWS_TIMES_BLOCK_MAX = 4096  # at most this many elements per program


def rows_per_program(BLOCK: int) -> int:
    """A fixed choice of rows per program for the CPU: about 2048 elements per program."""
    return max(1, min(16, 2048 // BLOCK))


def _elements_per_thread_between(lo: int, hi: int):
    """An autotune pruner: keep the configs that give each thread lo..hi elements of its rows (and,
    for several rows per program, at most ROWS_TIMES_BLOCK_MAX elements per program)."""
    def prune(configs, named_args, **kwargs):
        block = kwargs["BLOCK"] if "BLOCK" in kwargs else named_args["BLOCK"]
        kept = [c for c in configs if lo <= c.kwargs.get("ROWS", 1) * block // (32 * c.num_warps) <= hi
                and c.kwargs.get("ROWS", 1) * block <= max(block, ROWS_TIMES_BLOCK_MAX)]
        return kept or configs[:1]
    return prune


_ROW_WARPS = [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8, 16)]
_ROWS_WARPS = [triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)]
_tuned: dict = {}


def _row_autotuned(kernel, configs, key, per_thread: tuple[int, int]):
    """``kernel`` under ``triton.autotune``, built on first use: among ``configs``, the candidates that
    give each thread ``per_thread`` = (lo, hi) elements of its rows, ranked by GPU time
    (``kc.bench.gpu_time``): at these sizes a call's wall time is mostly its launch, the same for all."""
    if kernel not in _tuned:
        prune = {"early_config_prune": _elements_per_thread_between(*per_thread)}
        _tuned[kernel] = triton.autotune(configs, key=key, prune_configs_by=prune, do_bench=gpu_time_for_autotune)(kernel)
    return _tuned[kernel]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a 2D tensor whose rows are contiguous (chapter 04).

    Long rows go one to a program (``softmax_kernel``); rows of up to ``SHORT_ROW`` elements go
    several to a program (``softmax_rows_kernel``). On a GPU the autotuner picks the warps (and the
    rows per program) for each row length and dtype (``_row_autotuned``).
    """
    assert x.ndim == 2 and x.stride(1) == 1
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    BLOCK = triton.next_power_of_2(n_cols)
    if BLOCK <= SHORT_ROW:
        args = (x, y, n_rows, n_cols, x.stride(0), y.stride(0))
        if world().gpu:
            tuned = _row_autotuned(softmax_rows_kernel, _ROWS_WARPS, ["BLOCK"], (4, 64))
            tuned[lambda meta: (triton.cdiv(n_rows, meta["ROWS"]),)](*args, BLOCK=BLOCK)
        else:
            ROWS = rows_per_program(BLOCK)
            softmax_rows_kernel[(triton.cdiv(n_rows, ROWS),)](*args, BLOCK=BLOCK, ROWS=ROWS,
                                                              num_warps=softmax_num_warps(ROWS * BLOCK))
        return y
    args = (x, y, n_cols, x.stride(0), y.stride(0))
    if world().gpu:
        _row_autotuned(softmax_kernel, _ROW_WARPS, ["BLOCK"], (4, 64))[(n_rows,)](*args, BLOCK=BLOCK)
    else:
        softmax_kernel[(n_rows,)](*args, BLOCK=BLOCK, num_warps=softmax_num_warps(BLOCK))
    return y


@triton.jit
def residual_layer_norm_kernel(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, n_cols, stride, eps,
                               BLOCK: tl.constexpr, ACTIVATION: tl.constexpr, STORE_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = x + r                                       # the residual stream, in fp32
    if STORE_H:
        tl.store(h_ptr + row * stride + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(h, axis=0) / n_cols               # padding is 0: it adds nothing to the sum
    d = tl.where(mask, h - mean, 0.0)               # ... but 0 - mean would add to the variance
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = d * rstd * w + b
    if ACTIVATION == "gelu":
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    tl.store(y_ptr + row * stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def residual_layer_norm(x, r, weight, bias, eps: float = 1e-5, activation: str = "", return_residual: bool = False):
    """``act(layer_norm(x + r))`` over the last dimension in one pass (chapter 04).

    ``activation`` is "" or "gelu" (the exact, erf form). With ``return_residual`` it returns
    ``(y, x + r)``: a transformer block needs the residual stream again later.
    """
    assert x.shape == r.shape and x.ndim == 2 and weight.shape == bias.shape == x.shape[-1:]
    x, r = x.contiguous(), r.contiguous()
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if return_residual else y
    BLOCK = triton.next_power_of_2(n_cols)
    args = (x, r, weight, bias, y, h, n_cols, x.stride(0), eps)
    meta = dict(BLOCK=BLOCK, ACTIVATION=activation, STORE_H=return_residual)
    if world().gpu:
        tuned = _row_autotuned(residual_layer_norm_kernel, _ROW_WARPS, ["BLOCK", "ACTIVATION", "STORE_H"], (4, 32))
        tuned[(n_rows,)](*args, **meta)
    else:
        residual_layer_norm_kernel[(n_rows,)](*args, **meta, num_warps=softmax_num_warps(BLOCK))
    return (y, h) if return_residual else y


# ---- chapter 05 --------------------------------------------------------------------------------


def grouped_tile(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """The output tile (pid_m, pid_n) that program ``pid`` computes in grouped order (chapter 05).

    Programs walk down a group of ``group_m`` tile rows, column by column, then move to the next
    group: consecutive programs share tiles of A and B, which then come from L2 instead of HBM. The
    same arithmetic as in ``matmul_kernel``, in plain Python.
    """
    in_group = group_m * num_pid_n
    first_m = (pid // in_group) * group_m
    rows = min(num_pid_m - first_m, group_m)  # the last group can be shorter
    return first_m + (pid % in_group) % rows, (pid % in_group) // rows


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, ACTIVATION: tl.constexpr):
    # program id -> output tile, in groups of GROUP_M tile rows (see grouped_tile)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % rows
    pid_n = (pid % in_group) // rows

    # Rows of A and columns of B past M and N wrap around (% M, % N) to valid ones: their results
    # land only in rows and columns of C that the masked store drops, and the loads need no mask.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak   # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn   # (BLOCK_K, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the last step may have fewer than BLOCK_K columns left: mask them
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # the epilogue: the accumulator is still in fp32 registers, so an activation costs no traffic
    if ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


def _mm_config(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)


# Candidates for the autotuner: large tiles for large GPUs (H100: 228 KB of shared memory per SM),
# smaller ones for small GPUs and small problems. A config that does not fit (too much shared
# memory, on a T4 say) fails to compile and the autotuner skips it.
MATMUL_CONFIGS = [
    _mm_config(128, 256, 64, 3, 8),
    _mm_config(128, 256, 64, 4, 8),
    _mm_config(256, 128, 64, 3, 8),
    _mm_config(128, 128, 64, 4, 8),
    _mm_config(128, 128, 64, 4, 4),
    _mm_config(64, 256, 32, 4, 4),
    _mm_config(128, 64, 32, 4, 4),
    _mm_config(64, 64, 32, 4, 4),
]
_matmul_tuned = None
# Before compute capability 8.0 (the T4) Triton turns tl.dot into scalar FMA instructions (chapter 05):
# a tile larger than this compiles for 10-20 s and runs no faster, so the autotuner tries no larger there.
FMA_TILE_MAX = 128 * 128


def _gpu_facts() -> tuple[tuple[int, int], int]:
    """(compute capability as the course sees it, shared memory per block in bytes) of the current GPU."""
    return device_capability(), gpu_properties()["max_shared_mem"]


def _prune_matmul_configs(configs, named_args, **kwargs):
    """The autotuner's candidates that fit this GPU's shared memory (``stages`` copies of an A and a B
    tile), and on a GPU without tensor cores for Triton (compute capability below 8.0) the tiles of at
    most ``FMA_TILE_MAX`` elements."""
    capability, smem = _gpu_facts()
    itemsize = named_args["a_ptr"].element_size()

    def fits(c):
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        small_enough = capability >= (8, 0) or m * n <= FMA_TILE_MAX
        return small_enough and c.num_stages * (m * k + k * n) * itemsize <= smem

    return [c for c in configs if fits(c)] or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def matmul(a: torch.Tensor, b: torch.Tensor, activation: str = "", config: dict | None = None) -> torch.Tensor:
    """``act(a @ b)`` for 2D ``a`` (M, K) and ``b`` (K, N) of one dtype (chapter 05).

    ``activation`` is "", "relu" or "gelu". On a GPU the tile sizes are autotuned per (M, N, K) unless
    ``config`` gives them (keys BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); on the
    CPU the default is 32 x 32 x 32 tiles.
    """
    global _matmul_tuned
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if config is None and world().gpu:
        if _matmul_tuned is None:
            _matmul_tuned = triton.autotune(MATMUL_CONFIGS, key=["M", "N", "K", "ACTIVATION"],
                                            prune_configs_by={"early_config_prune": _prune_matmul_configs})(matmul_kernel)
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
        _matmul_tuned[grid](*args, ACTIVATION=activation)
        return c
    cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8) | (config or {})
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    matmul_kernel[grid](*args, ACTIVATION=activation, **cfg)
    return c


# ---- lean launches and PyTorch operators (chapter 09) ---------------------------------------------
#
# The launchers above read top to bottom, and each call pays for it: ``triton.autotune``'s ``run`` rebuilds
# the autotuning key from every argument, a grid lambda is made and called, the world is asked again. For a
# kernel of a few microseconds that is most of the call. The lean paths below compute the same thing
# (tests/test_ops_rows.py checks they agree bit for bit): the first call for a shape key runs the readable
# launcher (on a GPU its autotuner picks the configuration), records the launch options it used in a dict,
# and every later call is a dict lookup, the output's allocation and one launch of the compiled kernel
# itself (``kernelcourse.launch.direct``: no argument binding or cache lookup by Triton on each call).

_LAUNCH: dict = {}  # (launcher, shape key) -> launch options that the readable launcher used


def _options_used(kernel, fixed: dict) -> dict:
    """What the readable launcher just ran ``kernel`` with: the autotuner's pick on a GPU, ``fixed`` on the
    CPU (the same fixed choices the launcher makes there)."""
    if world().gpu:
        return dict(_tuned[kernel].best_config.all_kwargs())
    return fixed


def softmax_lean(x: torch.Tensor) -> torch.Tensor:
    """``softmax(x)`` through the lean path: the options found once per (row length, dtype)."""
    assert x.stride(-1) == 1, "softmax wants rows with contiguous elements"
    n_rows, n_cols = x.shape
    key = ("softmax", n_cols, x.dtype)
    opts = _LAUNCH.get(key)
    if opts is None:  # first call for this key: the readable launcher tunes (on a GPU) and runs
        y = softmax(x)
        BLOCK = triton.next_power_of_2(n_cols)
        if BLOCK <= SHORT_ROW:
            ROWS = rows_per_program(BLOCK)
            fixed = dict(ROWS=ROWS, num_warps=softmax_num_warps(ROWS * BLOCK))
            _LAUNCH[key] = (softmax_rows_kernel, True, dict(BLOCK=BLOCK) | _options_used(softmax_rows_kernel, fixed))
        else:
            fixed = dict(num_warps=softmax_num_warps(BLOCK))
            _LAUNCH[key] = (softmax_kernel, False, dict(BLOCK=BLOCK) | _options_used(softmax_kernel, fixed))
        return y
    kernel, several_rows, meta = opts
    y = torch.empty_like(x)
    spec = key + (x.get_device(),) + specialization(x, y, n_rows, x.stride(0), y.stride(0))  # what the key leaves
    if several_rows:
        direct(kernel, spec, (triton.cdiv(n_rows, meta["ROWS"]),), (x, y, n_rows, n_cols, x.stride(0), y.stride(0)),
               meta)
    else:
        direct(kernel, spec, (n_rows,), (x, y, n_cols, x.stride(0), y.stride(0)), meta)
    return y


def residual_layer_norm_lean(x, r, weight, bias, eps: float = 1e-5, activation: str = ""):
    """``residual_layer_norm(x, r, weight, bias, eps, activation, return_residual=True)`` through the lean
    path: ``(y, x + r)``, the options found once per (row length, dtypes, activation)."""
    assert x.shape == r.shape, (x.shape, r.shape)
    n_rows, n_cols = x.shape
    key = ("residual_layer_norm", n_cols, x.dtype, r.dtype, weight.dtype, bias.dtype, activation)
    meta = _LAUNCH.get(key)
    if meta is None:
        y, h = residual_layer_norm(x, r, weight, bias, eps, activation, return_residual=True)
        BLOCK = triton.next_power_of_2(n_cols)
        _LAUNCH[key] = dict(BLOCK=BLOCK, ACTIVATION=activation, STORE_H=True) | _options_used(
            residual_layer_norm_kernel, dict(num_warps=softmax_num_warps(BLOCK)))
        return y, h
    x, r = x.contiguous(), r.contiguous()
    y = torch.empty_like(x)
    h = torch.empty_like(x)
    spec = key + (x.get_device(),) + specialization(x, r, weight, bias, y, h, x.stride(0))  # what the key leaves
    direct(residual_layer_norm_kernel, spec, (n_rows,), (x, r, weight, bias, y, h, n_cols, x.stride(0), eps), meta)
    return y, h


def matmul_lean(a: torch.Tensor, b: torch.Tensor, activation: str = "") -> torch.Tensor:
    """``matmul(a, b, activation)`` through the lean path: tiles found once per (M, N, K, dtype, activation),
    the autotuner's own key (an epilogue changes which tiles are fastest)."""
    assert a.shape[1] == b.shape[0] and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    M, K = a.shape
    N = b.shape[1]
    key = ("matmul", M, N, K, a.dtype, b.dtype, activation)
    opts = _LAUNCH.get(key)
    if opts is None:
        c = matmul(a, b, activation)
        cfg = (dict(_matmul_tuned.best_config.all_kwargs()) if world().gpu
               else dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=8))
        _LAUNCH[key] = (cfg, (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),))
        return c
    cfg, grid = opts
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    spec = key + (a.get_device(),) + specialization(a, b, c, *strides)  # what the key leaves free
    direct(matmul_kernel, spec, grid, (a, b, c, M, N, K, *strides), {"ACTIVATION": activation, **cfg})
    return c


_lib = torch.library.Library("kernelcourse", "FRAGMENT")


def _define(schema: str, launcher, fake) -> None:
    """Make ``launcher`` the PyTorch operator ``kernelcourse::<name>`` of ``schema`` (in both worlds: tensors
    on the CPU run in Triton's interpreter), with ``fake`` saying what its outputs look like.

    As an operator, ``torch.compile`` keeps the launch in its graph as one opaque call (with
    ``fullgraph=True``, no graph break), gets its outputs' shapes from ``fake`` without running a kernel, and
    differentiates it through the autograd registered on the operator (``_register_autograd``).

    Why ``torch.library.Library`` (``define`` + ``impl``) and not ``torch.library.custom_op``: both register
    the same kind of operator, but ``custom_op`` wraps the function in Python layers that cost several
    microseconds per call (more with its ``register_autograd``), as much as the launch the lean path trims;
    ``Library.impl`` puts the launcher straight behind PyTorch's dispatcher. Why an operator and not
    ``torch.library.wrap_triton`` (which lets ``torch.compile`` trace into a Triton launch): the launchers
    autotune and keep state in Python, which ``wrap_triton`` cannot trace, and in Triton's interpreter (the
    CPU world) a wrapped kernel under fake tensors fails with "Cannot access data pointer"; an operator with
    a fake function compiles in both worlds.
    """
    name = schema.split("(", 1)[0]
    if not hasattr(torch.ops.kernelcourse, name):  # defined already if this module is imported again
        _lib.define(schema)
    for key in ("CPU", "CUDA"):  # CPU: the interpreter's world; CUDA: a GPU
        _lib.impl(name, launcher, key)
    torch.library.register_fake(f"kernelcourse::{name}", fake, lib=_lib)


def _below_autograd(op, *args):
    """``op(*args)`` past the operator's autograd kernel, as PyTorch's own autograd kernels redispatch."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _register_autograd(name: str, function) -> None:
    """Make ``function`` (an ``autograd.Function`` whose forward takes the operator's arguments) the autograd
    of ``kernelcourse::name``; when no input needs a gradient, the call goes straight to the kernel."""
    op = getattr(torch.ops.kernelcourse, name).default
    defaults = tuple(a.default_value for a in op._schema.arguments)  # the dispatcher leaves them out

    def autograd_kernel(*args):
        args += defaults[len(args):]
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function.apply(*args)
        return _below_autograd(op, *args)

    _lib.impl(name, autograd_kernel, "Autograd")


def _rows_fake(x):
    return torch.empty_like(x)


class SoftmaxFunction(torch.autograd.Function):
    """The autograd of ``kernelcourse::softmax``: ``dx = y * (dy - sum(dy * y))`` per row, in PyTorch."""

    @staticmethod
    def forward(ctx, x):
        y = _below_autograd(torch.ops.kernelcourse.softmax.default, x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return y * (dy - (dy * y).sum(-1, keepdim=True))


class TritonMatmul(torch.autograd.Function):
    """``act(x @ w)`` with chapter 05's matmul (activation fused into its epilogue) in the forward,
    cuBLAS in the backward. With GELU, the backward recomputes the pre-activation ``x @ w`` (one more
    matmul) because the fused kernel never writes it to memory. The autograd of ``kernelcourse::matmul``."""

    @staticmethod
    def forward(ctx, x, w, activation):
        ctx.save_for_backward(x, w)
        ctx.activation = activation
        return _below_autograd(torch.ops.kernelcourse.matmul.default, x, w, activation)

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        if ctx.activation == "gelu":
            dout = torch.ops.aten.gelu_backward(dout, x @ w)
        elif ctx.activation:
            raise NotImplementedError(ctx.activation)
        return dout @ w.t(), x.t() @ dout, None


def _rln_fake(x, r, weight, bias, eps=1e-5):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, torch.empty_like(y)


def _mm_fake(a, b, activation=""):
    return a.new_empty((a.shape[0], b.shape[1]))


_define("softmax(Tensor x) -> Tensor", softmax_lean, _rows_fake)
_register_autograd("softmax", SoftmaxFunction)
_define("residual_layer_norm(Tensor x, Tensor r, Tensor weight, Tensor bias, float eps=1e-05) -> (Tensor, Tensor)",
        residual_layer_norm_lean, _rln_fake)
# its autograd is chapter 08's backward: kernelcourse.transformer registers it (ResidualLayerNorm)
_define("matmul(Tensor a, Tensor b, str activation='') -> Tensor", matmul_lean, _mm_fake)
_register_autograd("matmul", TritonMatmul)

# ---- chapter 04: GroupNorm + SiLU in one kernel -----------------------------------------------------
# (appended after the chapter 05 section so that edits above it stay separate; it belongs to chapter 04)

__all__ += ["group_norm_silu", "group_norm_silu_ref", "group_norm_silu_kernel", "group_norm_stats_kernel",
            "group_norm_apply_silu_kernel", "group_norm_split", "group_norm_tiles", "GROUP_NORM_CONFIGS"]


def group_norm_silu_ref(x: torch.Tensor, n_groups: int, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float = 1e-5) -> torch.Tensor:
    """The spec: ``silu(group_norm(x))`` in PyTorch, two kernels in eager mode (chapter 04)."""
    return torch.nn.functional.silu(torch.nn.functional.group_norm(x, n_groups, weight, bias, eps))


@triton.jit
def group_norm_silu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, C, HW, n_groups, eps, BLOCK: tl.constexpr):
    # One program per (batch, group). In a contiguous (B, C, H, W) tensor the group's C / n_groups
    # channels of H * W values are one contiguous run of n elements, starting at pid * n.
    pid = tl.program_id(0).to(tl.int64)  # int64: pid * n passes 2^31 on large inputs
    per_group = C // n_groups
    n = per_group * HW
    x_row = x_ptr + pid * n
    y_row = y_ptr + pid * n
    first_channel = (pid % n_groups) * per_group
    lanes = tl.arange(0, BLOCK)

    # Pass 1: the statistics, in float32. The group is longer than a block, so each lane keeps a running
    # sum and sum of squares over the chunks, added up once at the end. They are sums of x - shift, with
    # shift one value of the group: E[(x - s)^2] - E[x - s]^2 is the variance for any s, and with s near
    # the mean the two terms stay small, so a large mean (x = 1000 + noise) cannot cancel the digits
    # the variance lives in.
    shift = tl.load(x_row).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n  # the last chunk runs past the group: n need not be a multiple of BLOCK
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.where(mask, v - shift, 0.0)  # padding must add nothing, and 0 - shift would
        acc += v
        acc_sq += v * v
    mean_shifted = tl.sum(acc, axis=0) / n
    var = tl.maximum(tl.sum(acc_sq, axis=0) / n - mean_shifted * mean_shifted, 0.0)  # biased, as group_norm
    mean = shift + mean_shifted
    rstd = 1.0 / tl.sqrt(var + eps)

    # Pass 2: normalise, the per-channel affine, then SiLU, and the only store. The group was just read,
    # so on a GPU this second read mostly comes from the L2 cache, not from HBM.
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        channel = first_channel + offs // HW  # w and b have one value per channel: a gather, cached
        w = tl.load(w_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        z = (v - mean) * rstd * w + b
        tl.store(y_row + offs, (z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def group_norm_stats_kernel(x_ptr, part_ptr, C, HW, n_groups, TILE, BLOCK: tl.constexpr):
    # The split version, step 1 of 2. Program (pid, s) adds up tile s (TILE values) of group pid: its
    # sum and sum of squares about the group's first value, the same shift in every tile of the group.
    pid = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = C // n_groups * HW
    x_row = x_ptr + pid * n
    shift = tl.load(x_row).to(tl.float32)
    lo = s * TILE
    hi = tl.minimum(lo + TILE, n)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        mask = offs < hi
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.where(mask, v - shift, 0.0)
        acc += v
        acc_sq += v * v
    part = part_ptr + (pid * tl.num_programs(1) + s) * 2
    tl.store(part, tl.sum(acc, axis=0))
    tl.store(part + 1, tl.sum(acc_sq, axis=0))


@triton.jit
def group_norm_apply_silu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, C, HW, n_groups, eps, TILE,
                                 SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    # The split version, step 2 of 2. Program (pid, s) combines its group's partial sums (a few
    # values, the same for every tile) and writes tile s of y; x comes again, mostly from L2.
    pid = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n_tiles = tl.num_programs(1)
    per_group = C // n_groups
    n = per_group * HW
    x_row = x_ptr + pid * n
    y_row = y_ptr + pid * n
    parts = tl.arange(0, SPLIT)                        # SPLIT: n_tiles rounded up to a power of two
    part = part_ptr + (pid * n_tiles + parts) * 2
    sums = tl.load(part, mask=parts < n_tiles, other=0.0)
    sums_sq = tl.load(part + 1, mask=parts < n_tiles, other=0.0)
    mean_shifted = tl.sum(sums, axis=0) / n
    var = tl.maximum(tl.sum(sums_sq, axis=0) / n - mean_shifted * mean_shifted, 0.0)
    mean = tl.load(x_row).to(tl.float32) + mean_shifted
    rstd = 1.0 / tl.sqrt(var + eps)
    first_channel = (pid % n_groups) * per_group
    lo = s * TILE
    hi = tl.minimum(lo + TILE, n)
    lanes = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        mask = offs < hi
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        channel = first_channel + offs // HW
        w = tl.load(w_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        z = (v - mean) * rstd * w + b
        tl.store(y_row + offs, (z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty), mask=mask)


def group_norm_split(programs: int, n: int, BLOCK: int = 1024) -> int:
    """How many tiles to split each group into, on this GPU: none (1) when there is already a program
    per SM, else enough for about four programs per SM, at least a BLOCK of values per tile."""
    if not world().gpu:
        return 1
    sms = gpu_properties()["multiprocessor_count"]
    return 1 if programs >= sms else max(1, min(triton.cdiv(4 * sms, programs), triton.cdiv(n, BLOCK)))


def group_norm_tiles(n: int, split: int, BLOCK: int) -> tuple[int, int]:
    """``(TILE, tiles)``: a group of ``n`` values cut into about ``split`` tiles of whole BLOCKs (chunks never
    straddle two tiles), so the tiles launched can be fewer than ``split``."""
    TILE = triton.cdiv(triton.cdiv(n, split), BLOCK) * BLOCK
    return TILE, triton.cdiv(n, TILE)


# Candidates for the autotuner on a GPU: the chunk each program loads per step, and the warps that share it.
GROUP_NORM_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w)
                      for b, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))]
_group_norm_tuned = None


def group_norm_silu(x: torch.Tensor, n_groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
                    BLOCK: int | None = None, split: int | None = None) -> torch.Tensor:
    """``silu(group_norm(x, n_groups, weight, bias, eps))`` in one kernel (chapter 04).

    ``x`` is (B, C, ...) with C a multiple of ``n_groups``; ``weight`` and ``bias`` have C values. One
    program per (batch, group) loops over its C / n_groups * H * W values twice: once for the statistics,
    once to write y. On a GPU the chunk size and warps are autotuned per shape unless ``BLOCK`` is given;
    on the CPU the chunk is at most 1024 values.

    With ``split`` > 1 each group is cut into about ``split`` tiles and the work takes two kernels:
    partial statistics per tile (``group_norm_stats_kernel``), then one program per tile that combines
    its group's partial sums and writes y (``group_norm_apply_silu_kernel``): more programs where
    there are few groups, for a second launch. ``split=None`` lets ``group_norm_split`` choose (1 on
    the CPU); ``split=1`` is the one-kernel version.
    """
    global _group_norm_tuned
    B, C = x.shape[:2]
    assert C % n_groups == 0 and weight.shape == bias.shape == (C,)
    x = x.contiguous()
    HW = x[0, 0].numel()
    y = torch.empty_like(x)
    n = C // n_groups * HW
    split = group_norm_split(B * n_groups, n) if split is None else split
    if split > 1:
        BLOCK = BLOCK or (1024 if world().gpu else min(1024, triton.next_power_of_2(n)))
        TILE, tiles = group_norm_tiles(n, split, BLOCK)
        part = torch.empty((B * n_groups, tiles, 2), device=x.device, dtype=torch.float32)
        grid = (B * n_groups, tiles)
        group_norm_stats_kernel[grid](x, part, C, HW, n_groups, TILE, BLOCK=BLOCK, num_warps=4)
        group_norm_apply_silu_kernel[grid](x, weight, bias, y, part, C, HW, n_groups, eps, TILE,
                                           SPLIT=triton.next_power_of_2(tiles), BLOCK=BLOCK, num_warps=4)
        return y
    args = (x, weight, bias, y, C, HW, n_groups, eps)
    grid = (B * n_groups,)
    if BLOCK is None and world().gpu:
        if _group_norm_tuned is None:
            _group_norm_tuned = triton.autotune(GROUP_NORM_CONFIGS, key=["C", "HW", "n_groups"],
                                                do_bench=gpu_time_for_autotune)(group_norm_silu_kernel)
        _group_norm_tuned[grid](*args)
        return y
    if BLOCK is None:
        BLOCK = min(1024, triton.next_power_of_2(C // n_groups * HW))
    group_norm_silu_kernel[grid](*args, BLOCK=BLOCK, num_warps=4)
    return y
