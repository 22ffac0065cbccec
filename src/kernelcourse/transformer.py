"""A transformer block from the course's kernels, a tiny GPT, and profiling helpers (chapter 08).

- LayerNorm backward in Triton: ``layer_norm_backward_kernel`` computes ``dX`` row by row and partial
  sums of ``dW``, ``dB`` per program; ``column_sum_kernel`` adds the partial sums up in a second pass.
  ``ResidualLayerNorm`` wraps chapter 04's forward (``kernels.residual_layer_norm``) and this backward
  in an ``autograd.Function``. The backward recomputes each row's mean and 1/std from the saved
  residual stream instead of saving them: the row is loaded anyway, and chapter 04's API stays as is.
- ``Block``: a pre-norm transformer block (LayerNorm -> QKV -> causal attention -> projection ->
  residual -> LayerNorm -> MLP with GELU -> residual), ``impl="torch"`` (eager PyTorch with SDPA, the
  reference) or ``impl="course"`` (this chapter's LayerNorm, chapter 07's FlashAttention, chapter 05's
  matmul where it wins). Both take and return the residual stream in two parts ``(h, delta)`` whose sum
  is the stream: the course's block adds them inside its LayerNorm kernel, so no residual add costs a
  pass of its own.
- ``GPT``: a character-level GPT of such blocks; ``course_text`` is the text it trains on, the course's
  own prose.
- The operators (chapter 09): ``torch.ops.kernelcourse.layer_norm_backward`` (the lean path
  ``layer_norm_backward_lean``) joins chapter 04-05's operators (``kernels``), and ``ResidualLayerNorm`` is
  the autograd of ``torch.ops.kernelcourse.residual_layer_norm``; the course's block calls the operators,
  so ``torch.compile(fullgraph=True)`` can take it whole.
- Measurements the lessons record (``bench_*``, ``train_compare``, ``profile_step``) and helpers that
  read a profiler trace (``compact_trace``, ``kernel_family``, ``by_kernel``, ``by_family``, ``gpu_idle``,
  ``plot_timeline``).

Import it after ``kc.setup()``.
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from . import bench, kernels
from .launch import direct, specialization
from .world import gpu_properties, low_precision_dtype, world

__all__ = ["layer_norm_backward_kernel", "column_sum_kernel", "layer_norm_backward", "layer_norm_backward_ref",
           "torch_layer_norm_backward", "layer_norm_backward_lean", "ops", "TritonMatmul", "bench_block", "bench_gpt",
           "ResidualLayerNorm", "residual_layer_norm", "Block", "GPT", "GPTConfig", "course_text", "CharCodec",
           "block_flops", "block_min_bytes", "bench_launch_cost", "compact_trace", "kernel_family", "by_kernel", "by_family", "gpu_idle",
           "plot_timeline"]

DATA_DIR = Path(__file__).parent / "data"
ops = torch.ops.kernelcourse  # the course's kernels as PyTorch operators (kernels.py, and below)

# ---- LayerNorm backward ---------------------------------------------------------------------------


@triton.jit
def layer_norm_backward_kernel(h_ptr, dy_ptr, dres_ptr, w_ptr, dx_ptr, part_ptr, n_rows, n_cols, stride, eps,
                               ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, HAS_DRES: tl.constexpr):
    # One program walks ROWS_PER_PROGRAM consecutive rows: dX row by row, and its share of dW and dB
    # summed in registers, written once per program to part[pid] = (dW partial, dB partial).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
        m = mask & (row < n_rows)  # the last program's rows can run past n_rows
        h = tl.load(h_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        # the forward's statistics, recomputed: the row is in registers anyway
        mean = tl.sum(h, axis=0) / n_cols
        d = tl.where(mask, h - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
        xhat = d * rstd
        g = dy * w                                     # the gradient reaching x̂
        c1 = tl.sum(xhat * g, axis=0) / n_cols
        c2 = tl.sum(g, axis=0) / n_cols
        dx = (g - (xhat * c1 + c2)) * rstd
        if HAS_DRES:  # the stream's own gradient flows past the LayerNorm: add it here, not in a pass of its own
            dx += tl.load(dres_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += dy * xhat
        db += dy
    tl.store(part_ptr + pid * 2 * n_cols + cols, dw, mask=mask)
    tl.store(part_ptr + pid * 2 * n_cols + n_cols + cols, db, mask=mask)


@triton.jit
def column_sum_kernel(part_ptr, out_ptr, n_parts, n_cols, stride, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[j] = sum over i of part[i, j]: each program owns BLOCK_N columns and walks all rows
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        m = (rows < n_parts)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + rows[:, None] * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


def _sm_count(device: int) -> int:
    return gpu_properties(device)["multiprocessor_count"]


def _programs(n_rows: int, per_sm: int = 4) -> int:
    """How many programs share the rows: on a GPU ``per_sm`` on each SM (a few: enough to fill it, few
    partial sums; ``resident_per_sm`` says how many fit at once), 4 on the CPU."""
    if world().gpu:
        return max(1, min(n_rows, per_sm * _sm_count(torch.cuda.current_device())))
    return max(1, min(n_rows, 4))


def programs_per_sm(n_regs: int, shared: int, num_warps: int, regs_per_sm: int = 65536, threads_per_sm: int = 2048,
                    shared_per_sm: int = 232448, warp_size: int = 32, most: int = 4) -> int:
    """How many programs of a compiled kernel one SM holds at once, at most ``most``: registers are handed
    out to each warp in blocks of 256, and the registers, the threads or the shared memory run out first.

    The programs that do not fit wait for a second wave: at 75 registers a thread an H100 holds three of
    the LayerNorm backward's 8-warp programs, not four, and a grid of four per SM then takes two rounds of a
    program's rows instead of one. (Triton's fused-softmax tutorial sizes its grid the same way.)"""
    regs_per_warp = -(-n_regs * warp_size // 256) * 256
    fit = [regs_per_sm // regs_per_warp // num_warps, threads_per_sm // (num_warps * warp_size), most]
    if shared:
        fit.append(shared_per_sm // shared)
    return max(1, min(fit))


_PER_SM: dict = {}  # (kernel, dtype, HAS_DRES, BLOCK, num_warps, device) -> programs an SM holds at once


def resident_per_sm(kernel, args: tuple, meta: dict) -> int:
    """``programs_per_sm`` of the LayerNorm backward ``kernel`` as it compiles on this GPU for the launch of
    ``layer_norm_backward`` (``args``: h, dy, dres, weight, dx, n_rows, n_cols, stride, eps; ``meta``: BLOCK,
    HAS_DRES, num_warps), with the rows per program of four programs per SM: 4 on the CPU, or for a kernel
    wrapped in something that cannot compile it ahead of its launch. Worked out once per kernel, dtype and
    launch options, from the compiled kernel's registers and shared memory."""
    if not world().gpu or not hasattr(kernel, "warmup"):
        return 4
    h, dy, dres, weight, dx, n_rows, *rest = args
    key = (kernel, h.dtype, meta.get("HAS_DRES"), meta.get("BLOCK"), meta.get("num_warps"), h.device)
    if key not in _PER_SM:
        part = torch.empty(16, device=h.device, dtype=torch.float32)  # its dtype and alignment are what count
        rows = triton.cdiv(n_rows, _programs(n_rows))
        try:  # compiles (or finds) the kernel for these arguments, launches nothing, and loads it
            compiled = kernel.warmup(h, dy, dres, weight, dx, part, n_rows, *rest, grid=(1,), ROWS_PER_PROGRAM=rows,
                                     **meta)
            compiled._init_handles()  # loading reads its register count
        except Exception:  # noqa: BLE001 - an autotuned kernel, say, or one that fails to compile: its launch says why
            return 4
        gpu = torch.cuda.get_device_properties(h.device)
        smem = getattr(gpu, "shared_memory_per_multiprocessor", 0) or gpu_properties(h.device.index)["max_shared_mem"]
        _PER_SM[key] = programs_per_sm(compiled.n_regs, compiled.metadata.shared, meta["num_warps"],
                                       regs_per_sm=getattr(gpu, "regs_per_multiprocessor", 65536),
                                       threads_per_sm=getattr(gpu, "max_threads_per_multi_processor", 2048),
                                       shared_per_sm=smem, warp_size=getattr(gpu, "warp_size", 32))
    return _PER_SM[key]


def layer_norm_backward(h, weight, dy, eps: float = 1e-5, dres=None, programs: int | None = None, kernel=None):
    """``(dx, dw, db)`` of ``y = layer_norm(h) * weight + bias`` over the last dimension (chapter 08).

    ``h`` and ``dy`` are 2D with contiguous rows; ``dres``, if given, is added to ``dx`` (the gradient
    that reaches the residual stream past the LayerNorm). ``dw`` and ``db`` have ``weight``'s dtype.
    ``kernel`` replaces ``layer_norm_backward_kernel`` (one with the same signature: an exercise's).
    """
    assert h.ndim == 2 and dy.shape == h.shape and weight.shape == h.shape[-1:]
    h, dy = h.contiguous(), dy.contiguous()
    n_rows, n_cols = h.shape
    kernel = kernel or layer_norm_backward_kernel
    dx = torch.empty_like(h)
    BLOCK = triton.next_power_of_2(n_cols)
    has_dres = dres is not None
    dres = dres.contiguous() if has_dres else dx
    meta = dict(BLOCK=BLOCK, HAS_DRES=has_dres, num_warps=max(1, min(16, BLOCK // 256)))
    if not programs:  # as many as the GPU holds at once, so that every program runs in the first wave
        programs = _programs(n_rows, resident_per_sm(kernel, (h, dy, dres, weight, dx, n_rows, n_cols, h.stride(0),
                                                              eps), meta))
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    part = torch.empty((programs, 2 * n_cols), device=h.device, dtype=torch.float32)
    kernel[(programs,)](h, dy, dres, weight, dx, part, n_rows, n_cols, h.stride(0), eps,
                        ROWS_PER_PROGRAM=rows_per_program, **meta)
    dwdb = torch.empty(2 * n_cols, device=h.device, dtype=weight.dtype)
    BLOCK_N = 64
    column_sum_kernel[(triton.cdiv(2 * n_cols, BLOCK_N),)](part, dwdb, programs, 2 * n_cols, part.stride(0),
                                                          BLOCK_P=32, BLOCK_N=BLOCK_N)
    return dx, dwdb[:n_cols], dwdb[n_cols:]


def layer_norm_backward_ref(h, weight, dy, eps: float = 1e-5):
    """``(dx, dw, db)`` by autograd through ``F.layer_norm``, in ``h``'s precision: the spec."""
    h = h.detach().clone().requires_grad_(True)
    w = weight.detach().to(h.dtype).clone().requires_grad_(True)
    b = torch.zeros_like(w, requires_grad=True)
    F.layer_norm(h, h.shape[-1:], w, b, eps).backward(dy.to(h.dtype))
    return h.grad, w.grad, b.grad


def torch_layer_norm_backward(h, weight, dy, eps: float = 1e-5):
    """PyTorch's own fused LayerNorm backward on ``h`` (2D) as a call with no arguments, the timing peer
    of ``layer_norm_backward``: the row statistics its forward would have saved are computed here, once,
    and ``weight`` is cast to ``h``'s dtype, as autograd would hand them over."""
    mean = h.float().mean(-1, keepdim=True)
    rstd = torch.rsqrt(h.float().var(-1, unbiased=False, keepdim=True) + eps)
    w = weight.to(h.dtype)
    return lambda: torch.ops.aten.native_layer_norm_backward(dy, h, [h.shape[-1]], mean, rstd, w, w, [True, True, True])


class ResidualLayerNorm(torch.autograd.Function):
    """``(y, h) = (layer_norm(x + r) * weight + bias, x + r)``: chapter 04's fused forward, this chapter's
    backward. ``x`` and ``r`` are 2D; ``weight`` and ``bias`` may be float32 with ``x`` in 16 bits. It is
    the autograd of the operator ``torch.ops.kernelcourse.residual_layer_norm``, whose kernels the forward
    and the backward call as operators, so that ``torch.compile`` can trace both (chapter 09)."""

    @staticmethod
    def forward(ctx, x, r, weight, bias, eps):
        # chapter 04's kernel: the operator, called past its autograd (which is this class)
        y, h = kernels._below_autograd(ops.residual_layer_norm.default, x, r, weight, bias, eps)
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight = ctx.saved_tensors
        dx, dwdb = ops.layer_norm_backward(h, weight, dy, dh, ctx.eps)  # layer_norm_backward, as an operator
        return dx, dx, dwdb[0], dwdb[1], None  # h = x + r: x and r get the same gradient


def residual_layer_norm(x, r, weight, bias, eps: float = 1e-5):
    """Differentiable ``(layer_norm(x + r), x + r)`` for tensors of any shape (..., d) (chapter 08)."""
    shape = x.shape
    y, h = ops.residual_layer_norm(x.reshape(-1, shape[-1]), r.reshape(-1, shape[-1]), weight, bias, eps)
    return y.view(shape), h.view(shape)


# ---- the operators (chapter 09) -------------------------------------------------------------------
# kernels.py explains why these are torch.library operators; here chapter 08's LayerNorm backward joins
# them, and ResidualLayerNorm becomes the autograd of kernelcourse::residual_layer_norm.

_LN_BACKWARD: dict = {}  # (rows, columns, device, dtype, with dres) -> (programs, launch options): found once


def layer_norm_backward_lean(h, weight, dy, dres=None, eps: float = 1e-5):
    """``layer_norm_backward(h, weight, dy, eps, dres)`` through a lean path: ``(dx, dwdb)`` with ``dwdb``
    (2, d) = (dw, db). The number of programs, rows per program and warps are worked out once per shape
    (no device query per call) and the two kernels launched with tuple grids; the kernels and the launch
    options are the same as ``layer_norm_backward``'s, so the results agree bit for bit."""
    assert h.ndim == 2 and dy.shape == h.shape, (h.shape, dy.shape)
    n_rows, n_cols = h.shape
    has_dres = dres is not None
    key = (n_rows, n_cols, h.get_device(), h.dtype, has_dres)
    h, dy = h.contiguous(), dy.contiguous()
    dx = torch.empty_like(h)
    dres = dres.contiguous() if has_dres else dx
    opts = _LN_BACKWARD.get(key)
    if opts is None:
        BLOCK = triton.next_power_of_2(n_cols)
        meta = dict(BLOCK=BLOCK, num_warps=max(1, min(16, BLOCK // 256)))
        programs = _programs(n_rows, resident_per_sm(layer_norm_backward_kernel, (h, dy, dres, weight, dx, n_rows,
                                                                                  n_cols, h.stride(0), eps),
                                                     dict(meta, HAS_DRES=has_dres)))
        rows_per_program = triton.cdiv(n_rows, programs)
        programs = triton.cdiv(n_rows, rows_per_program)
        opts = _LN_BACKWARD[key] = (programs, dict(meta, ROWS_PER_PROGRAM=rows_per_program),
                                    (triton.cdiv(2 * n_cols, 64),))
    programs, meta, sum_grid = opts
    part = torch.empty((programs, 2 * n_cols), device=h.device, dtype=torch.float32)
    # the key fixes the sizes, h's dtype and dres's presence; the other dtypes, the alignment and the row
    # stride are what it leaves free
    spec = key + (dy.dtype, dres.dtype, weight.dtype) + specialization(h, dy, dres, weight, h.stride(0))
    direct(layer_norm_backward_kernel, spec, (programs,),
           (h, dy, dres, weight, dx, part, n_rows, n_cols, h.stride(0), eps), {"HAS_DRES": has_dres, **meta})
    dwdb = torch.empty((2, n_cols), device=h.device, dtype=weight.dtype)
    direct(column_sum_kernel, key + (weight.dtype,), sum_grid, (part, dwdb, programs, 2 * n_cols, 2 * n_cols),
           {"BLOCK_P": 32, "BLOCK_N": 64})
    return dx, dwdb


def _ln_backward_fake(h, weight, dy, dres=None, eps=1e-5):
    return torch.empty_like(h, memory_format=torch.contiguous_format), weight.new_empty((2, h.shape[1]))


kernels._define("layer_norm_backward(Tensor h, Tensor weight, Tensor dy, Tensor? dres=None, float eps=1e-05) "
                "-> (Tensor, Tensor)", layer_norm_backward_lean, _ln_backward_fake)

NO_SECOND_DERIVATIVE = ("kernelcourse's LayerNorm has no second derivative: its backward kernel is not "
                        "differentiable itself. Use torch.nn.functional.layer_norm where you need one "
                        "(create_graph=True, torch.autograd.functional.hessian, gradient penalties)")


class _LayerNormBackwardOnce(torch.autograd.Function):
    """The autograd of ``kernelcourse::layer_norm_backward``: a backward of the backward raises, instead of
    PyTorch's warning and gradients that silently leave out the terms through it."""

    @staticmethod
    def forward(ctx, h, weight, dy, dres, eps):
        return kernels._below_autograd(ops.layer_norm_backward.default, h, weight, dy, dres, eps)

    @staticmethod
    def backward(ctx, ddx, ddwdb):
        raise RuntimeError(NO_SECOND_DERIVATIVE)


kernels._register_autograd("layer_norm_backward", _LayerNormBackwardOnce)
kernels._register_autograd("residual_layer_norm", ResidualLayerNorm)


# ---- matmuls --------------------------------------------------------------------------------------

TritonMatmul = kernels.TritonMatmul  # the autograd of kernelcourse::matmul: Triton forward, cuBLAS backward


def _mm(x2d, w, use_triton: bool, activation: str = ""):
    if use_triton:
        return ops.matmul(x2d, w, activation)
    out = x2d @ w
    return F.gelu(out) if activation == "gelu" else out


# ---- the block ------------------------------------------------------------------------------------

MATMULS = ("qkv", "proj", "fc", "out")


class Block(nn.Module):
    """A pre-norm transformer block (chapter 08), in eager PyTorch (``impl="torch"``) or from the course's
    kernels (``impl="course"``). Linear layers have no bias; weights are stored (in, out) so that a
    projection is ``x @ w``. ``forward(h, delta)`` takes the residual stream as two tensors whose sum it
    is, (B, N, d) each, and returns it the same way; ``triton_matmuls`` names the projections (from
    "qkv", "proj", "fc", "out") that use chapter 05's matmul instead of cuBLAS in the course's block.
    """

    def __init__(self, d_model: int, n_heads: int, impl: str = "torch", causal: bool = True,
                 triton_matmuls=(), dtype=torch.float32, device=None, std: float = 0.02, eps: float = 1e-5):
        super().__init__()
        assert d_model % n_heads == 0 and impl in ("torch", "course")
        d = d_model
        self.d_model, self.n_heads, self.impl, self.causal, self.eps = d, n_heads, impl, causal, eps
        self.triton_matmuls = tuple(triton_matmuls)
        f = dict(device=device, dtype=dtype)
        p = lambda *shape: nn.Parameter(torch.randn(*shape, **f) * std)  # noqa: E731
        self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(d, **f)), nn.Parameter(torch.zeros(d, **f))
        self.w_qkv, self.w_proj = p(d, 3 * d), p(d, d)
        self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(d, **f)), nn.Parameter(torch.zeros(d, **f))
        self.w_fc, self.w_out = p(d, 4 * d), p(4 * d, d)

    def _attention(self, y2d, B, N, dt):
        H, d = self.n_heads, self.d_model
        qkv = _mm(y2d, self.w_qkv.to(dt), "qkv" in self.triton_matmuls and self.impl == "course")  # (B*N, 3d)
        q, k, v = qkv.view(B, N, 3, H, d // H).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, N, d/H), strided
        if self.impl == "course":
            from .attention_backward import attention

            o = attention(q, k, v, causal=self.causal)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        o = o.transpose(1, 2).reshape(B * N, d)  # (B*N, d)
        return _mm(o, self.w_proj.to(dt), "proj" in self.triton_matmuls and self.impl == "course")

    def _mlp(self, y2d, dt):
        tri = self.impl == "course"
        z = _mm(y2d, self.w_fc.to(dt), tri and "fc" in self.triton_matmuls, activation="gelu")  # (B*N, 4d)
        return _mm(z, self.w_out.to(dt), tri and "out" in self.triton_matmuls)

    def forward(self, h, delta):
        B, N, d = h.shape
        dt = h.dtype
        if self.impl == "torch":
            x = h + delta
            x = x + self._attention(F.layer_norm(x, (d,), self.ln1_w.to(dt), self.ln1_b.to(dt), self.eps)
                                    .view(B * N, d), B, N, dt).view(B, N, d)
            m = self._mlp(F.layer_norm(x, (d,), self.ln2_w.to(dt), self.ln2_b.to(dt), self.eps).view(B * N, d), dt)
            return x, m.view(B, N, d)
        y, x = ops.residual_layer_norm(h.reshape(B * N, d), delta.reshape(B * N, d), self.ln1_w, self.ln1_b, self.eps)
        a = self._attention(y, B, N, dt)
        y, x = ops.residual_layer_norm(x, a, self.ln2_w, self.ln2_b, self.eps)  # the residual add, fused
        m = self._mlp(y, dt)
        return x.view(B, N, d), m.view(B, N, d)


def block_flops(B: int, N: int, d: int, causal: bool = True) -> float:
    """FLOPs of one block's forward: the four projections (24·B·N·d²) and attention's two products
    (4·B·N²·d, half of it when causal). LayerNorms and GELU add O(B·N·d), left out (chapter 08)."""
    matmuls = 2 * B * N * d * (3 * d + d + 4 * d + 4 * d)
    attn = 4 * B * N * N * d * (0.5 if causal else 1.0)
    return float(matmuls + attn)


def block_train_flops(B: int, N: int, d: int, causal: bool = True) -> float:
    """FLOPs of a forward and backward: a matmul's backward is two matmuls (dX and dW), attention's is
    five products where its forward has two (it recomputes the scores)."""
    attn = 4 * B * N * N * d * (0.5 if causal else 1.0)
    return 3 * (block_flops(B, N, d, causal) - attn) + 3.5 * attn


def block_min_bytes(B: int, N: int, d: int, itemsize: int = 2) -> float:
    """The least bytes a block's forward must move: its 12·d² weights and its input read once, its
    output written once, everything in between kept on chip (chapter 08)."""
    return float((12 * d * d + 2 * B * N * d) * itemsize)


# ---- the tiny GPT ---------------------------------------------------------------------------------


def build_course_text(root) -> str:
    """The course's prose: the book's pages, then the markdown cells of the lessons, in reading order."""
    import nbformat

    root = Path(root)
    parts = [p.read_text(encoding="utf-8") for p in sorted((root / "book").glob("*.md"))]
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        parts += [c.source for c in nb.cells if c.cell_type == "markdown"]
    return "\n\n".join(parts)


def course_text() -> str:
    """The text the chapter's GPT trains on: the course's own prose, shipped with the package."""
    return (DATA_DIR / "course_text.txt").read_text(encoding="utf-8")


class CharCodec:
    """Characters <-> integer ids, the vocabulary being every character the text uses."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class GPTConfig(dict):
    """vocab, d_model, n_heads, n_layers, seq_len."""


class GPT(nn.Module):
    """A character-level GPT of ``Block``s (chapter 08). Parameters are float32; the forward computes in
    ``compute_dtype``. Two GPTs built after the same ``torch.manual_seed`` hold the same weights
    whatever their ``impl``."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int, impl: str = "torch",
                 compute_dtype=torch.float32, triton_matmuls=(), device=None):
        super().__init__()
        self.impl, self.compute_dtype, self.d_model = impl, compute_dtype, d_model
        self.tok = nn.Parameter(torch.randn(vocab, d_model, device=device) * 0.02)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model, device=device) * 0.02)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, impl, True, triton_matmuls, device=device)
                                     for _ in range(n_layers)])
        self.lnf_w = nn.Parameter(torch.ones(d_model, device=device))
        self.lnf_b = nn.Parameter(torch.zeros(d_model, device=device))
        self.head = nn.Parameter(torch.randn(d_model, vocab, device=device) * 0.02)

    def forward(self, idx, targets=None):
        B, N = idx.shape
        dt, d = self.compute_dtype, self.d_model
        h = self.tok[idx].to(dt)                                  # (B, N, d)
        delta = self.pos[:N].to(dt).expand(B, N, d)
        for blk in self.blocks:
            h, delta = blk(h, delta)
        if self.impl == "course":
            y = residual_layer_norm(h, delta.contiguous(), self.lnf_w, self.lnf_b)[0]
        else:
            y = F.layer_norm(h + delta, (d,), self.lnf_w.to(dt), self.lnf_b.to(dt))
        logits = (y.reshape(B * N, d) @ self.head.to(dt)).float()
        if targets is None:
            return logits.view(B, N, -1)
        return F.cross_entropy(logits, targets.reshape(-1))


def batches(data: torch.Tensor, batch: int, seq_len: int, seed: int, device):
    """An endless stream of (inputs, targets) windows of ``data``, in an order fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq_len] for s in starts])
        y = torch.stack([data[s + 1:s + seq_len + 1] for s in starts])
        yield x.to(device), y.to(device)


def train(impl: str, *, steps: int, batch: int, seq_len: int, d_model: int, n_heads: int, n_layers: int,
          lr: float = 3e-3, seed: int = 0, data_seed: int = 0, compute_dtype=None, triton_matmuls=(),
          text: str | None = None) -> dict:
    """Train a GPT on the course's text with AdamW (linear warm-up over the first tenth of the steps,
    gradients clipped to norm 1); returns the loss at every step and the tokens per second (measured
    over the steps after the first few, which compile and tune kernels)."""
    dev = world().device
    text = course_text() if text is None else text
    codec = CharCodec(text)
    data = codec.encode(text)
    compute_dtype = compute_dtype or low_precision_dtype()  # bf16, fp16 before compute capability 8.0, fp32 on the CPU
    torch.manual_seed(seed)
    model = GPT(len(codec), d_model, n_heads, n_layers, seq_len, impl, compute_dtype, triton_matmuls, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)  # a linear warm-up keeps the first steps of Adam from overshooting
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    stream = batches(data, batch, seq_len, data_seed, dev)
    losses, t0, warm = [], None, min(5, steps // 2)
    for step in range(steps):
        if step == warm:
            if world().gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = next(stream)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())  # .item() waits for the GPU: the timing includes every step's work
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    return {"impl": impl, "losses": losses, "tokens_per_s": (steps - warm) * batch * seq_len / elapsed}


# ---- measurements the lesson records ------------------------------------------------------------------


def make_pair(B, N, d, H, dtype, triton_matmuls=(), seed=0):
    """The same block's weights in both implementations, and one input, on this world's device."""
    dev = world().device
    torch.manual_seed(seed)
    ref = Block(d, H, "torch", dtype=dtype, device=dev)
    course = Block(d, H, "course", triton_matmuls=triton_matmuls, dtype=dtype, device=dev)
    course.load_state_dict(ref.state_dict())
    h = torch.randn(B, N, d, device=dev, dtype=dtype, requires_grad=True)
    delta = torch.randn(B, N, d, device=dev, dtype=dtype, requires_grad=True)
    return ref, course, h, delta


def step_fn(block, h, delta, grads):
    """One forward and backward of ``block``, the gradients ``grads`` flowing into its two outputs."""
    def step():
        x, m = block(h, delta)
        torch.autograd.backward((x, m), grads)
    return step


def cuda_graph(fn):
    """``fn`` captured in a CUDA graph: one launch replays every kernel ``fn`` launches, with no Python,
    autograd or launch work between them. ``fn`` runs a few times first (on a side stream, as capture
    wants), which also lets autotuners settle. Returns the graph's ``replay``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


# the course's graph before the compiled one: if capturing compiled code fails, the others are measured
BLOCK_VARIANTS = ("eager PyTorch + SDPA", "torch.compile(eager)", "course kernels",
                  "eager PyTorch + SDPA, CUDA graph", "course kernels, CUDA graph", "torch.compile(eager), CUDA graph")
# chapter 09: the course's block compiled whole (fullgraph=True), and both compiled blocks with
# mode="reduce-overhead", where Inductor captures the compiled step in CUDA graphs itself
COMPILE_VARIANTS = ("eager PyTorch + SDPA", "torch.compile(eager)", "course kernels", "torch.compile(course)",
                    "torch.compile(eager), reduce-overhead", "torch.compile(course), reduce-overhead")


def _compiled_blocks(ref, course, variants) -> dict:
    """The blocks ``variants`` name: eager, the course's, and ``torch.compile`` of either (the course's with
    ``fullgraph=True``: its kernels are operators, so a graph break is a bug), with or without
    ``mode="reduce-overhead"``."""
    blocks = {"eager PyTorch + SDPA": ref, "course kernels": course}
    for name in variants:
        key = name.removesuffix(", CUDA graph")  # a CUDA graph of a variant captures that variant's block
        if key in blocks:
            continue
        mode = "reduce-overhead" if key.endswith(", reduce-overhead") else None
        if key.startswith("torch.compile(eager)"):
            blocks[key] = torch.compile(ref, mode=mode)
        elif key.startswith("torch.compile(course)"):
            blocks[key] = torch.compile(course, mode=mode, fullgraph=True)
    return blocks


def _spread(values) -> dict:
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_block(B=8, N=1024, d=768, H=12, dtype=None, triton_matmuls=(), variants=BLOCK_VARIANTS,
                rounds: int = 1) -> list[dict]:
    """Forward + backward of one block at (B, N, d, H): time, TFLOP/s and peak memory of eager PyTorch with
    SDPA, ``torch.compile`` of it and the course's block, each launched from Python and replayed as a
    CUDA graph (``variants``; ``COMPILE_VARIANTS`` adds the course's block compiled whole and both compiled
    blocks with ``mode="reduce-overhead"``). With ``rounds`` > 1 every variant is timed once per round, in
    turn, and ``ms`` is the median, ``ms_min`` and ``ms_max`` the spread. A variant that cannot be compiled
    or captured gets a row with its error instead of a time. ``dtype``: ``world.low_precision_dtype()``."""
    from .bench import do_bench

    dtype = dtype or low_precision_dtype()
    ref, course, h, delta = make_pair(B, N, d, H, dtype, triton_matmuls)
    grads = (torch.randn_like(h), torch.randn_like(h))
    blocks = _compiled_blocks(ref, course, variants)
    rows, fns, fl = [], {}, block_train_flops(B, N, d)
    for name in variants:
        base_name, graphed = name.removesuffix(", CUDA graph"), name.endswith(", CUDA graph")
        fn = step_fn(blocks[base_name], h, delta, grads)
        row = {"variant": name, "triton_matmuls": ",".join(triton_matmuls) if "course" in base_name else ""}
        try:
            if graphed:
                fn = cuda_graph(fn)
            for _ in range(3):  # compile, tune, and let reduce-overhead record its graphs
                fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            # a graph's memory is allocated once, at capture: its replays allocate nothing
            peak = float("nan") if graphed or "reduce-overhead" in name else torch.cuda.max_memory_allocated() - base
            row |= {"peak_mib": peak / 2**20, "error": ""}
            fns[name] = fn
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            torch.cuda.synchronize()
            row |= {"ms": float("nan"), "ms_min": float("nan"), "ms_max": float("nan"), "tflops": float("nan"),
                    "peak_mib": float("nan"),
                    "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        rows.append(row)
    times = {name: [] for name in fns}
    for _ in range(rounds):  # in turn, so that every variant meets the GPU's clocks at every point of their drift
        for name, fn in fns.items():
            times[name].append(do_bench(fn))
    for row in rows:
        if row["variant"] in times:
            t = _spread(times[row["variant"]])
            row |= {"ms": t["median"], "ms_min": t["min"], "ms_max": t["max"], "tflops": fl / (t["median"] * 1e-3) / 1e12}
    return rows


def _cpu_gpu_us(fn, calls: int) -> tuple[float, float]:
    """CPU microseconds per call (``kc.bench.cpu_time_per_call``: ``calls`` back to back, no waiting for the
    GPU, after a warm-up) and GPU microseconds per call (replayed in a CUDA graph, ``do_bench_cudagraph``)."""
    from triton.testing import do_bench_cudagraph

    cpu_us = bench.cpu_time_per_call(fn, calls=calls, warmup=5)
    return cpu_us, do_bench_cudagraph(fn) * 1e3


def bench_launch_cost(B=8, N=1024, d=768, H=12, dtype=None, calls: int = 200, lean: bool = False) -> list[dict]:
    """What one call costs the CPU and what it costs the GPU, for the block's pieces at (B, N, d, H): the
    CPU's microseconds per call (``calls`` calls issued back to back, no waiting for the GPU) against the
    GPU's (the same call replayed in a CUDA graph, ``triton.testing.do_bench_cudagraph``). With ``lean``,
    the LayerNorm's rows also time the lean launch paths and the ``torch.ops.kernelcourse`` operators
    (chapter 09). ``dtype``: ``world.low_precision_dtype()``."""
    from .attention import flash_attention

    dtype = dtype or low_precision_dtype()
    dev = world().device
    x, r = (torch.randn(B * N, d, device=dev, dtype=dtype) for _ in range(2))
    w, b = torch.rand(d, device=dev) + 0.5, torch.randn(d, device=dev)
    wt, bt = w.to(dtype), b.to(dtype)
    q, k, v = (torch.randn(B, H, N, d // H, device=dev, dtype=dtype) for _ in range(3))
    cases = [
        ("residual add + LayerNorm", "PyTorch", lambda: F.layer_norm(x + r, (d,), wt, bt)),
        ("residual add + LayerNorm", "course (Triton)", lambda: kernels.residual_layer_norm(x, r, w, b, return_residual=True)),
        ("LayerNorm backward", "PyTorch", torch_layer_norm_backward(x, w, r)),
        ("LayerNorm backward", "course (Triton)", lambda: layer_norm_backward(x, w, r)),
        ("attention forward", "PyTorch SDPA", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        ("attention forward", "course (Triton)", lambda: flash_attention(q, k, v, causal=True)),
    ]
    if lean:
        cases[2:2] = [("residual add + LayerNorm", "course, lean launch", lambda: kernels.residual_layer_norm_lean(x, r, w, b)),
                      ("residual add + LayerNorm", "course, operator", lambda: ops.residual_layer_norm(x, r, w, b))]
        cases[6:6] = [("LayerNorm backward", "course, lean launch", lambda: layer_norm_backward_lean(x, w, r)),
                      ("LayerNorm backward", "course, operator", lambda: ops.layer_norm_backward(x, w, r))]
    rows = []
    for op, impl, fn in cases:
        cpu_us, gpu_us = _cpu_gpu_us(fn, calls)
        rows.append({"op": op, "impl": impl, "cpu_us": cpu_us, "gpu_us": gpu_us})
    return rows


GPT_VARIANTS = ("eager PyTorch + SDPA", "course kernels", "torch.compile(eager)", "torch.compile(course)")


def bench_gpt(rounds: int = 5, steps: int = 20, warmup: int = 5, batch=32, seq_len=256, d_model=384, n_heads=6,
              n_layers=4, triton_matmuls=(), variants=GPT_VARIANTS, dtype=None) -> list[dict]:
    """Training throughput of the tiny GPT (``train_compare``'s shape): tokens per second of ``steps`` AdamW
    steps with no wait for the GPU between them, for each variant in turn, ``rounds`` times; one row per
    variant with the median, min and max over the rounds and the median's ratio to eager PyTorch. The
    compiled course GPT uses ``fullgraph=True``. A variant that fails gets a row with its error."""
    dtype = dtype or low_precision_dtype()
    dev = world().device
    text = course_text()
    codec = CharCodec(text)
    stream = batches(codec.encode(text), batch, seq_len, 0, dev)
    data = [next(stream) for _ in range(8)]  # a few batches, reused: no input pipeline in the timing
    runs, rows = {}, []
    for name in variants:
        impl = "course" if "course" in name else "torch"
        torch.manual_seed(0)
        model = GPT(len(codec), d_model, n_heads, n_layers, seq_len, impl, dtype,
                    triton_matmuls if impl == "course" else (), device=dev)
        fwd = torch.compile(model, fullgraph=impl == "course") if name.startswith("torch.compile") else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

        def train_steps(n, fwd=fwd, opt=opt, model=model):
            for i in range(n):
                x, y = data[i % len(data)]
                loss = fwd(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            torch.cuda.synchronize()

        row = {"variant": name, "error": ""}
        try:
            train_steps(warmup)
            runs[name] = train_steps
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            torch.cuda.synchronize()
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
    rates = {name: [] for name in runs}
    for _ in range(rounds):
        for name, train_steps in runs.items():
            t0 = time.perf_counter()
            train_steps(steps)
            rates[name].append(steps * batch * seq_len / (time.perf_counter() - t0))
    for row in rows:
        if row["variant"] in rates:
            t = _spread(rates[row["variant"]])
            row |= {"tokens_per_s": t["median"], "tokens_per_s_min": t["min"], "tokens_per_s_max": t["max"]}
        else:
            row |= {"tokens_per_s": float("nan"), "tokens_per_s_min": float("nan"), "tokens_per_s_max": float("nan")}
    eager = next((r["tokens_per_s"] for r in rows if r["variant"] == "eager PyTorch + SDPA"), float("nan"))
    for row in rows:
        row["vs_eager"] = row["tokens_per_s"] / eager
    return rows


def bench_layer_norm_backward(shapes=((8192, 768), (8192, 1024), (16384, 2048)), dtype=None) -> list[dict]:
    """LayerNorm backward (dx, dw, db) with this chapter's kernels and with PyTorch's: ``ms`` per call from
    Python (``do_bench``), ``gpu_ms`` of the kernels alone (``gpu_time``), GB/s at least moved in that time."""
    from .bench import do_bench, gbps, gpu_time

    dtype = dtype or low_precision_dtype()
    rows, dev = [], world().device
    for n_rows, n_cols in shapes:
        h = torch.randn(n_rows, n_cols, device=dev, dtype=dtype)
        dy = torch.randn_like(h)
        w = torch.rand(n_cols, device=dev, dtype=torch.float32) + 0.5
        peers = {
            "course (Triton)": lambda: layer_norm_backward(h, w, dy),
            "PyTorch": torch_layer_norm_backward(h, w, dy),
        }
        nbytes = 3 * h.numel() * h.element_size()  # read h and dy, write dx
        for name, fn in peers.items():
            ms, gpu_ms = do_bench(fn), gpu_time(fn)
            rows.append({"rows": n_rows, "cols": n_cols, "impl": name, "ms": ms, "gpu_ms": gpu_ms,
                         "gbps": gbps(nbytes, gpu_ms)})
    return rows


def bench_matmuls(M=8192, d=768, dtype=None) -> list[dict]:
    """Each projection of the block at M = B·N rows: chapter 05's Triton matmul against cuBLAS (forward)."""
    from .bench import do_bench

    dtype = dtype or low_precision_dtype()
    dev, rows = world().device, []
    for name, (K, N, act) in {"qkv": (d, 3 * d, ""), "proj": (d, d, ""), "fc+gelu": (d, 4 * d, "gelu"),
                              "out": (4 * d, d, "")}.items():
        a = torch.randn(M, K, device=dev, dtype=dtype)
        b = torch.randn(K, N, device=dev, dtype=dtype) / math.sqrt(K)
        cublas = (lambda: F.gelu(a @ b)) if act else (lambda: a @ b)
        t_tri = do_bench(lambda: kernels.matmul(a, b, activation=act))
        t_cub = do_bench(cublas)
        rows.append({"matmul": name, "M": M, "K": K, "N": N, "triton_ms": t_tri, "cublas_ms": t_cub,
                     "triton_tflops": 2 * M * K * N / (t_tri * 1e-3) / 1e12,
                     "cublas_tflops": 2 * M * K * N / (t_cub * 1e-3) / 1e12})
    return rows


# ---- profiling ------------------------------------------------------------------------------------

compact_trace = bench.compact_trace  # one implementation of the trace format, in kc.bench


def profile_step(impl: str, B=8, N=1024, d=768, H=12, dtype=None, triton_matmuls=(), steps=2) -> list[dict]:
    """Profile ``steps`` forward + backward steps of one block with ``kc.bench.profile`` (after the compile
    and tuning calls, on its wait/warm-up/active schedule), with ``record_function`` labels around the
    forward and the backward; returns the compact trace."""
    from torch.profiler import record_function

    dtype = dtype or low_precision_dtype()
    ref, course, h, delta = make_pair(B, N, d, H, dtype, triton_matmuls)
    blk = course if impl == "course" else (torch.compile(ref) if impl == "compiled" else ref)
    grads = (torch.randn_like(h), torch.randn_like(h))
    step_fn(blk, h, delta, grads)()  # compiles and tunes outside the profiler

    def step():
        with record_function("forward"):
            x, m = blk(h, delta)
        with record_function("backward"):
            torch.autograd.backward((x, m), grads)

    return bench.profile(step, active=steps)["events"]


FAMILIES = [  # (family, pattern): the first that matches a kernel's name wins
    ("attention", r"attention|attn|fmha|flash"),
    ("layer norm", r"layer_norm|layernorm|column_sum"),
    ("matmul", r"gemm|matmul|nvjet|cutlass|sm90_xmma|cublas|mm_kernel|triton_tem"),
    ("GELU", r"gelu"),
    ("copy / layout", r"copy|transpose|cat|memcpy|memset|clone|contiguous|Memcpy|Memset"),
    ("elementwise", r"elementwise|vectorized|add|mul|fill|triton_poi|triton_per|triton_red"),
]


def kernel_family(name: str) -> str:
    """A kernel's family from its name: matmul, attention, layer norm, GELU, copy / layout, elementwise, other."""
    for family, pattern in FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return family
    return "other"


def _gpu(events):
    return [e for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]


def by_kernel(events) -> list[dict]:
    """One row per GPU kernel name: calls, total µs, share of all GPU time; largest first."""
    rows: dict[str, dict] = {}
    for e in _gpu(events):
        r = rows.setdefault(e["name"], {"kernel": e["name"], "family": kernel_family(e["name"]), "calls": 0, "us": 0.0})
        r["calls"] += 1
        r["us"] += e["dur"]
    total = sum(r["us"] for r in rows.values()) or 1.0
    out = sorted(rows.values(), key=lambda r: -r["us"])
    for r in out:
        r["share"] = r["us"] / total
    return out


def by_family(events) -> list[dict]:
    """GPU time per kernel family: calls, total µs, share; largest first."""
    fam: dict[str, dict] = {}
    for r in by_kernel(events):
        f = fam.setdefault(r["family"], {"family": r["family"], "calls": 0, "us": 0.0, "share": 0.0})
        f["calls"] += r["calls"]
        f["us"] += r["us"]
        f["share"] += r["share"]
    return sorted(fam.values(), key=lambda r: -r["us"])


def gpu_idle(events) -> dict:
    """From the first kernel's start to the last one's end: how long the GPU ran kernels and how long it
    sat idle between them (launch gaps), in µs, and the launches of every launch API (``kc.bench.trace_stats``)."""
    return bench.trace_stats(events)


def roofline_points(events, B=8, N=1024, d=768, steps: int = 2, itemsize: int = 2, causal: bool = True,
                    dtype: str = "bf16"):
    """The block's kernel families on the roofline: per training step (forward + backward), the FLOPs
    and the least bytes of each family (napkin counts, below), with its GPU time from the trace.

    - matmul: 3x the forward's projection FLOPs; bytes: each forward matmul reads A and B and writes C
      once, and its backward does that twice more;
    - attention: 3.5x the forward's FLOPs (the backward's five products against the forward's two);
      bytes: the forward reads q, k, v and writes o, the backward reads q, k, v, o, dO, writes dq, dk, dv;
    - layer norm (two per block): the forward reads x and r and writes y and h, the backward reads h, dy
      and the residual's gradient and writes dx; about 8 FLOPs per element forward, 12 backward.

    ``dtype`` names the roofline's compute ceiling: "bf16", or "fp16" where the block ran in float16.
    """
    from .roofline import Point

    M = B * N
    fam = {r["family"]: r["us"] for r in by_family(events)}
    shapes = [(M, d, 3 * d), (M, d, d), (M, d, 4 * d), (M, 4 * d, d)]
    mm_flops = 3 * sum(2 * m * k * n for m, k, n in shapes)
    mm_bytes = 3 * sum(m * k + k * n + m * n for m, k, n in shapes) * itemsize
    attn_fwd = 4 * B * N * N * d * (0.5 if causal else 1.0)
    counts = {"matmul": (mm_flops, mm_bytes),
              "attention": (3.5 * attn_fwd, 12 * M * d * itemsize),
              "layer norm": (2 * 20 * M * d, 2 * 8 * M * d * itemsize)}
    return [Point(f"{name} (fwd+bwd)", fl, nb, fam[name] / steps / 1e3, dtype=dtype)
            for name, (fl, nb) in counts.items() if fam.get(name)]


def plot_timeline(events, ax=None, title: str = ""):
    """The trace as a timeline: one lane of GPU kernels coloured by family, one lane of CPU launch calls,
    and the forward/backward annotations."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fams = [f for f, _ in FAMILIES] + ["other"]
    for i, f in enumerate(fams):
        spans = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in _gpu(events) if kernel_family(e["name"]) == f]
        if spans:
            ax.broken_barh(spans, (1, 0.8), color=colors[i % len(colors)], label=f)
    spans = [(e["ts"] / 1e3, max(e["dur"], 0.5) / 1e3) for e in events if e["cat"] in ("cuda_runtime", "cuda_driver")]
    ax.broken_barh(spans, (0, 0.8), color="0.5")
    for e in events:
        if e["cat"] == "user_annotation" and e["name"] in ("forward", "backward"):
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (2, 0.5), color="0.85", edgecolor="0.3")
            ax.annotate(e["name"], (e["ts"] / 1e3, 2.25), fontsize=8, va="center", xytext=(3, 0),
                        textcoords="offset points")
    ax.set_ylim(-0.2, 3.3)
    ax.set_yticks([0.4, 1.4, 2.25], ["CPU: CUDA calls", "GPU: kernels", "CPU: ranges"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=7, ncol=len(fams), frameon=False, handlelength=1, columnspacing=1)
    return ax
