"""The FlashAttention backward pass and differentiable attention (introduced in chapter 07).

Shapes and conventions are chapter 06's (see ``kernelcourse.attention``): ``q`` is ``(B, H, N_Q, d)``,
``k`` and ``v`` are ``(B, H, N_K, d)``, causal masks are top-left aligned (query ``i`` sees keys
``j <= i``), and ``lse`` is the float32 natural-log log-sum-exp of each row of scaled scores,
``(B, H, N_Q)``, that the forward kernel saves.

With ``S = sm_scale · Q Kᵀ``, ``P = softmax(S)`` and ``O = P V``, the gradients of a loss with
``dO = ∂L/∂O`` are

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D) with D = rowsum(dO ∘ O),
    dQ = sm_scale · dS K,   dK = sm_scale · dSᵀ Q.

- ``attention_backward_ref``: those formulas on whole matrices, the spec (it holds ``P``: N_Q × N_K);
- ``tiled_attention_backward_ref``: the same, tile by tile in plain PyTorch, recomputing each tile of
  ``P`` from the saved ``lse``; no tensor of N_Q × N_K elements is ever made;
- ``attention_bwd_preprocess_kernel``, ``attention_bwd_dkdv_kernel``, ``attention_bwd_dq_kernel``: the
  Triton kernels (plain pointer loads and stores with masks, so they run on any GPU and in the
  interpreter), and ``flash_attention_backward``, their launcher;
- ``FlashAttention``: the ``torch.autograd.Function`` whose forward is chapter 06's kernel (it saves
  ``q``, ``k``, ``v``, ``o`` and ``lse``, never ``P``) and whose backward is this module's. Call it
  through ``kernelcourse.attention.attention(q, k, v, causal, sm_scale)``, which checks its input.

Import this module after ``kc.setup()``: Triton reads the interpreter switch when a kernel is defined.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import _device_properties, _scale, attention_flops, causal_mask, flash_attention
from .world import world

__all__ = ["attention_backward_ref", "tiled_attention_backward_ref", "attention_backward_flops",
           "attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel",
           "flash_attention_backward", "tuned_configs", "FlashAttention", "DKDV_CONFIGS", "DQ_CONFIGS"]

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x · log2(e)); a constexpr, so kernels can read it
# Causal backwards take the heads four at a time (tile_and_head); without a mask, head by head was faster.
CAUSAL_HEAD_GROUP = tl.constexpr(4)


# ---- the spec ------------------------------------------------------------------------------------


def attention_backward_flops(B: int, H: int, n_q: int, n_k: int, d: int, causal: bool = False) -> float:
    """FLOPs of an attention backward: 2.5 times the forward's. The forward does two matmuls of
    2·N_Q·N_K·d FLOPs each (QKᵀ, PV); the backward does five (QKᵀ again, to recompute P; dV = PᵀdO;
    dP = dO Vᵀ; dQ = dS K; dK = dSᵀ Q). Half of it with a causal mask, as ``attention_flops``."""
    return 2.5 * attention_flops(B, H, n_q, n_k, d, causal)


def attention_backward_ref(q, k, v, do, causal: bool = False, sm_scale: float | None = None):
    """``(dq, dk, dv)`` from the formulas on whole matrices: the spec, in plain PyTorch.

    Computes in float32 (float64 stays float64) and returns gradients in the inputs' dtype. Holds
    ``S`` and ``P``, ``(B, H, N_Q, N_K)``: for checking, at sizes where that fits.
    """
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc, doc = (t.to(ct) for t in (q, k, v, do))
    scale = _scale(q, sm_scale)
    s = (qc @ kc.transpose(-2, -1)) * scale                                   # (B, H, N_Q, N_K)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = p @ vc                                                                # (B, H, N_Q, d)
    dv = p.transpose(-2, -1) @ doc                                            # Pᵀ dO
    dp = doc @ vc.transpose(-2, -1)                                           # dO Vᵀ
    delta = (doc * o).sum(dim=-1, keepdim=True)                               # D = rowsum(dO ∘ O)
    ds = p * (dp - delta)
    dq = (ds @ kc) * scale
    dk = (ds.transpose(-2, -1) @ qc) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def tiled_attention_backward_ref(q, k, v, o, lse, do, causal: bool = False, sm_scale: float | None = None,
                                 block_m: int = 64, block_n: int = 64):
    """The backward tile by tile in plain PyTorch: what the Triton kernels do, without an N × N tensor.

    ``o`` and ``lse`` are what the forward returned. ``D = rowsum(dO ∘ O)`` is computed once. Then,
    for each tile of ``block_n`` keys, a loop over the tiles of ``block_m`` queries that see it
    recomputes that tile of ``P = exp(S − lse)`` and adds its share to ``dK``, ``dV`` (and ``dQ``).
    With ``causal``, query tiles entirely before the key tile are skipped. Computes in float32
    (float64 stays float64); returns ``(dq, dk, dv)`` in the inputs' dtype.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc, oc, doc = (t.to(ct) for t in (q, k, v, o, do))
    lse = lse.to(ct)
    scale = _scale(q, sm_scale)
    delta = (doc * oc).sum(dim=-1)                                            # (B, H, N_Q)
    dq = torch.zeros_like(qc)
    dk = torch.zeros_like(kc)
    dv = torch.zeros_like(vc)
    for n0 in range(0, n_k, block_n):
        k_t, v_t = kc[:, :, n0:n0 + block_n], vc[:, :, n0:n0 + block_n]      # (B, H, bn, d)
        cols = torch.arange(n0, n0 + k_t.shape[2], device=q.device)
        # causal: the queries before the tile's first key see none of it
        m_lo = (n0 // block_m) * block_m if causal else 0
        for m0 in range(m_lo, n_q, block_m):
            sl = slice(m0, m0 + block_m)
            s = (qc[:, :, sl] @ k_t.transpose(-2, -1)) * scale                # (B, H, bm, bn)
            p = torch.exp(s - lse[:, :, sl, None])                            # P recomputed from the lse
            if causal:
                rows = torch.arange(m0, m0 + s.shape[2], device=q.device)
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dv[:, :, n0:n0 + block_n] += p.transpose(-2, -1) @ doc[:, :, sl]  # Pᵀ dO
            dp = doc[:, :, sl] @ v_t.transpose(-2, -1)                        # dO Vᵀ
            ds = p * (dp - delta[:, :, sl, None])
            dq[:, :, sl] += (ds @ k_t) * scale
            dk[:, :, n0:n0 + block_n] += (ds.transpose(-2, -1) @ qc[:, :, sl]) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the Triton kernels --------------------------------------------------------------------------


@triton.jit
def head_start(ptr, off_hz, H, stride_b, stride_h):
    """Where head ``off_hz`` (= b·H + h) of a (B, H, N, d) tensor with these strides begins."""
    return ptr + (off_hz // H) * stride_b + (off_hz % H) * stride_h


@triton.jit
def tile_and_head(GROUP: tl.constexpr):
    """This program's (tile, batch·head) in a grid of (tiles, B·H), taking the heads GROUP at a time.

    A GPU starts programs in the order of their ids, program_id(0) fastest: GROUP = 1 runs every tile of
    head 0, then of head 1, and so on. GROUP = G runs tile 0 of heads 0 … G-1, then tile 1 of those heads,
    and so on, then moves to the next G heads: under a causal mask the tiles with the most work start
    first across the whole grid, not only within each head, while the few heads in flight keep their
    tensors in L2.
    """
    if GROUP == 1:
        return tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_tiles = tl.num_programs(0)
    pid = tl.program_id(1) * n_tiles + tl.program_id(0)          # the launch order
    first = pid // (GROUP * n_tiles) * GROUP                     # the group's first head
    in_group = tl.minimum(GROUP, tl.num_programs(1) - first)     # the last group may be smaller
    rest = pid - first * n_tiles
    return rest // in_group, (first + rest % in_group).to(tl.int64)


@triton.jit
def attention_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, H, N_Q, stride_ob, stride_oh, stride_on,
                                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO ∘ O) for BLOCK_M rows of one head: (B·H, N_Q) float32. One program per
    (query tile, batch·head); o and do are (B, H, N_Q, HEAD_DIM) with the same strides (stride_o*)."""
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < N_Q
    ptrs = offs_m[:, None] * stride_on + offs_d[None, :]
    o = tl.load(head_start(o_ptr, off_hz, H, stride_ob, stride_oh) + ptrs, mask=rows[:, None], other=0.0)
    do = tl.load(head_start(do_ptr, off_hz, H, stride_ob, stride_oh) + ptrs, mask=rows[:, None], other=0.0)
    tl.store(delta_ptr + off_hz * N_Q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, lo, hi, N_Q,
                stride_qn, stride_don,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the query tiles lo, lo + BLOCK_M, ... < hi into this key tile's dk and dv (fp32).

    Works on the transposed tile, keys × queries, so that pᵀ and dsᵀ come out in the shape the two
    accumulating matmuls want. MASKED tiles (the causal diagonal, the last partial query tile) load
    with a mask and zero pᵀ where a query is past N_Q or, causal, comes before the key.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_head + offs_m[:, None] * stride_qn + offs_d[None, :]
        do_ptrs = do_head + offs_m[:, None] * stride_don + offs_d[None, :]
        if MASKED:
            rows = offs_m < N_Q
            q = tl.load(q_ptrs, mask=rows[:, None], other=0.0)                        # (BLOCK_M, HEAD_DIM)
            do = tl.load(do_ptrs, mask=rows[:, None], other=0.0)
            lse2 = tl.load(lse_head + offs_m, mask=rows, other=0.0) * LOG2E  # base 2
            delta = tl.load(delta_head + offs_m, mask=rows, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(lse_head + offs_m) * LOG2E
            delta = tl.load(delta_head + offs_m)
        # pᵀ = exp(s - lse), recomputed: (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASKED:
            keep = rows[None, :]
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :])               # top-left: key j <= query i
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)                                      # dV += Pᵀ dO
        dp_t = tl.dot(v, tl.trans(do))                                             # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])                                       # dSᵀ = Pᵀ ∘ (dPᵀ - D)
        dk = tl.dot(ds_t.to(q.dtype), q, dk)                                       # dK += dSᵀ Q (scaled at the end)
    return dk, dv


# Triton compiles a variant of a kernel for integer arguments divisible by 16. For N_Q that matters:
# each head's rows of lse and D then start on a 64-byte boundary and load as vectors. H only picks a head.
# EVEN_M, worked out at each launch from the arguments: no partial query tile, so no loop for one.
@triton.heuristics({"EVEN_M": lambda args: args["N_Q"] % args["BLOCK_M"] == 0})
@triton.jit(do_not_specialize=["H"])
def attention_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, sm_scale, H, N_Q, N_K,
                              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                              stride_dob, stride_doh, stride_don,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, EVEN_M: tl.constexpr):
    # program (key tile, batch·head): it owns BLOCK_N rows of dK and dV and writes each once.
    # Causal: key tile 0 has the most work; heads four at a time start it first (see tile_and_head)
    start_n, off_hz = tile_and_head(CAUSAL_HEAD_GROUP if CAUSAL else 1)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # this tile's keys
    offs_d = tl.arange(0, HEAD_DIM)
    kv = offs_n[:, None] * stride_kn + offs_d[None, :]                          # k and v share strides
    keys = offs_n[:, None] < N_K
    k = tl.load(head_start(k_ptr, off_hz, H, stride_kb, stride_kh) + kv, mask=keys, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(head_start(v_ptr, off_hz, H, stride_kb, stride_kh) + kv, mask=keys, other=0.0)
    q_head = head_start(q_ptr, off_hz, H, stride_qb, stride_qh)
    do_head = head_start(do_ptr, off_hz, H, stride_dob, stride_doh)
    lse_head = lse_ptr + off_hz * N_Q
    delta_head = delta_ptr + off_hz * N_Q
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Queries [lo, m_full) need the causal mask; [m_full, m_whole) none; [.., N_Q) the tail's mask.
    m_whole = (N_Q // BLOCK_M) * BLOCK_M               # query tiles that lie entirely before N_Q
    if CAUSAL:
        k0 = start_n * BLOCK_N
        lo = (k0 // BLOCK_M) * BLOCK_M                 # queries before k0 see none of these keys
        # from the first query tile whose first query is at or after the tile's last key, all see all
        m_full = tl.maximum(lo, tl.minimum(tl.cdiv(k0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, N_Q))
    else:
        lo = 0
        m_full = 0
    m_tail = tl.maximum(m_full, m_whole)
    # The unmasked tiles first, then the masked ones: the sums are the same in any order, but compiled for a
    # Hopper GPU with the diagonal's loop first, ptxas makes every matmul of the kernel wait for the one
    # before it (its warning C7515: "wgmma.mma_async instructions are serialized").
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, m_full, m_whole, N_Q,
                         stride_qn, stride_don, BLOCK_M, HEAD_DIM, False, CAUSAL)
    if CAUSAL:
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, lo, m_full, N_Q,
                             stride_qn, stride_don, BLOCK_M, HEAD_DIM, True, CAUSAL)
    if not EVEN_M:  # an empty loop where BLOCK_M divides N_Q, but compiled in, it slows the ones before it
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, m_tail, N_Q, N_Q,
                             stride_qn, stride_don, BLOCK_M, HEAD_DIM, True, CAUSAL)
    out = off_hz * N_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]  # dk, dv: contiguous
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=keys)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=keys)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_head, v_head, qk_scale, offs_m, lo, hi, N_K, stride_kn,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the key tiles lo, lo + BLOCK_N, ... < hi into this query tile's dq (fp32)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ptrs = offs_n[:, None] * stride_kn + offs_d[None, :]
        if MASKED:
            keys = offs_n < N_K
            k = tl.load(k_head + ptrs, mask=keys[:, None], other=0.0)                 # (BLOCK_N, HEAD_DIM)
            v = tl.load(v_head + ptrs, mask=keys[:, None], other=0.0)
        else:
            k = tl.load(k_head + ptrs)
            v = tl.load(v_head + ptrs)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])          # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = keys[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))                                                  # dO Vᵀ
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)                                            # dQ += dS K (scaled at the end)
    return dq


@triton.jit(do_not_specialize=["H"])
def attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, sm_scale, H, N_Q, N_K,
                            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                            stride_dob, stride_doh, stride_don,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr):
    # program (query tile, batch·head), as in the forward; causal tiles near the end have the most keys
    start_m, off_hz = tile_and_head(CAUSAL_HEAD_GROUP if CAUSAL else 1)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < N_Q
    q = tl.load(head_start(q_ptr, off_hz, H, stride_qb, stride_qh) + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=rows[:, None], other=0.0)                                  # (BLOCK_M, HEAD_DIM)
    do = tl.load(head_start(do_ptr, off_hz, H, stride_dob, stride_doh) + offs_m[:, None] * stride_don + offs_d[None, :],
                 mask=rows[:, None], other=0.0)
    lse2 = tl.load(lse_ptr + off_hz * N_Q + offs_m, mask=rows, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + off_hz * N_Q + offs_m, mask=rows, other=0.0)
    k_head = head_start(k_ptr, off_hz, H, stride_kb, stride_kh)
    v_head = head_start(v_ptr, off_hz, H, stride_kb, stride_kh)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Keys [0, n_full) need no mask; [n_full, n_end) do; [n_end, N_K) are never loaded (chapter 06).
    n_whole = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        q0 = start_m * BLOCK_M
        n_end = tl.minimum(q0 + BLOCK_M, N_K)
        n_full = tl.minimum((q0 + 1) // BLOCK_N * BLOCK_N, n_whole)
    else:
        n_end = N_K
        n_full = n_whole
    dq = _dq_tiles(dq, q, do, lse2, delta, k_head, v_head, qk_scale, offs_m, 0, n_full, N_K, stride_kn,
                   BLOCK_N, HEAD_DIM, False, CAUSAL)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_head, v_head, qk_scale, offs_m, n_full, n_end, N_K, stride_kn,
                   BLOCK_N, HEAD_DIM, True, CAUSAL)
    out = off_hz * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]   # dq: contiguous
    tl.store(dq_ptr + out, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])


# ---- configs and launcher ------------------------------------------------------------------------


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Candidates for the dK/dV kernel: a key tile of BLOCK_N rows stays in registers while query tiles of
# BLOCK_M rows stream past. The last ones fit a small GPU's shared memory.
DKDV_CONFIGS = [
    _config(64, 128, 8, 3), _config(64, 128, 8, 2), _config(64, 64, 4, 2), _config(32, 128, 4, 3),
    _config(32, 64, 4, 3), _config(64, 64, 4, 3), _config(32, 64, 4, 2), _config(32, 64, 4, 1),
    _config(16, 64, 4, 2), _config(16, 32, 4, 1),
]
# Candidates for the dQ kernel: the other way round, a query tile stays while key tiles stream past.
DQ_CONFIGS = [
    _config(128, 128, 8, 2), _config(128, 64, 8, 4), _config(128, 64, 8, 3), _config(128, 32, 4, 3),
    _config(64, 32, 4, 3), _config(64, 64, 4, 3), _config(64, 32, 4, 2), _config(64, 16, 4, 2),
    _config(32, 16, 4, 1),
]
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


# Which candidates a large GPU (200 KB of shared memory or more) tries for each head dim, the three fastest
# at some shape in sweeps on an H100. dK/dV: with d = 64, 64-key tiles in 4 warps; with d = 128, 64-key
# tiles in 4 warps, or 128-key tiles in 8 warps (with 128 keys in 4 warps, each thread would hold 256
# floats of dK and dV: registers spill, and the kernel runs 3 to 4 times slower). dQ: 64-query tiles in
# 4 warps or 128 in 8 with d = 64; 128-query tiles in 8 warps with d = 128. Timing the slower candidates
# only gives the autotuner's noise a chance.
_TRIED = {
    "kv": {64: {(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3)},
           128: {(64, 64, 4, 2), (64, 128, 8, 3), (64, 128, 8, 2)}},
    "q": {64: {(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3)},
          128: {(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)}},
}


def _key(c: triton.Config) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _smem_bytes(c: triton.Config, head_dim: int, resident: str, itemsize: int = 2) -> int:
    """Shared memory a config needs, roughly: the resident tile pair (K, V or Q, dO) once, the
    streaming pair num_stages times, and one tile of p."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    stay, stream = (bn, bm) if resident == "kv" else (bm, bn)
    return itemsize * (head_dim * (2 * stay + 2 * c.num_stages * stream) + bm * bn)


def _pruner(resident: str):
    def prune(configs, named_args, **kwargs):
        """The candidates whose tiles fit in this GPU's shared memory (64 KB per block on a T4, 227 KB
        on an H100), on a large GPU the few chosen for this head dim, not much larger than the sequences."""
        d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        smem = _device_properties().get("max_shared_mem", 0) or 1 << 30
        kept = [c for c in configs if _smem_bytes(c, d, resident) <= smem]
        if smem >= 200 * 1024 and d in _TRIED[resident]:
            kept = [c for c in kept if _key(c) in _TRIED[resident][d]]
        n_q = named_args.get("N_Q", kwargs.get("N_Q"))
        n_k = named_args.get("N_K", kwargs.get("N_K"))
        short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(n_q, 32) and c.kwargs["BLOCK_N"] <= max(n_k, 32)]
        return short or kept or configs[-1:]
    return prune


_tuned: dict[str, object] = {}


def _tuned_kernel(which: str):
    if which not in _tuned:
        def bench(fn, quantiles):
            # at least 40 ms and ten calls of each candidate: a long backward's call takes over 10 ms.
            # The first call compiles the candidate; the second, timed, sizes the measurement.
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            rep = max(40.0, 10 * start.elapsed_time(end))
            return triton.testing.do_bench(fn, warmup=10, rep=rep, quantiles=quantiles)

        configs, kernel, resident = ((DKDV_CONFIGS, attention_bwd_dkdv_kernel, "kv") if which == "dkdv"
                                     else (DQ_CONFIGS, attention_bwd_dq_kernel, "q"))
        tune = triton.autotune(configs, key=["N_Q", "N_K", "HEAD_DIM", "CAUSAL"],
                               prune_configs_by={"early_config_prune": _pruner(resident)}, do_bench=bench)
        _tuned[which] = tune(kernel)
    return _tuned[which]


def tuned_configs() -> dict[str, str]:
    """The configs the autotuner chose for the last GPU launch of each backward kernel, in words."""
    out = {}
    for which, kernel in _tuned.items():
        c = getattr(kernel, "best_config", None)
        if c is not None:
            out[which] = (f"BLOCK_M={c.kwargs['BLOCK_M']}, BLOCK_N={c.kwargs['BLOCK_N']}, "
                          f"{c.num_warps} warps, {c.num_stages} stages")
    return out


def _rows_readable(*tensors):
    """The tensors as the kernels read them: (B, H, N, d) with rows of d contiguous elements, all of one
    stride pattern (k and v are read with one set of strides, o and do with another). Views such as
    heads split off a fused QKV projection are read in place; anything else gets contiguous copies."""
    if all(t.stride(-1) == 1 for t in tensors) and len({t.stride() for t in tensors}) == 1:
        return tensors
    return tuple(t.contiguous() for t in tensors)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def flash_attention_backward(q, k, v, o, lse, do, causal: bool = False, sm_scale: float | None = None,
                             dkdv_config: dict | None = None, dq_config: dict | None = None):
    """FlashAttention backward: ``(dq, dk, dv)`` from the inputs, the forward's ``o`` and ``lse``, and ``do``.

    Three launches: ``D = rowsum(dO ∘ O)``; one program per (key tile, batch·head) that loops over the
    query tiles and writes ``dK`` and ``dV``; one per (query tile, batch·head) that loops over the key
    tiles and writes ``dQ``. Every output element is written once, by one program: no atomics, and the
    result is the same from run to run. The inputs are read through their strides (heads that are views
    of a fused projection are not copied); the gradients come out contiguous. On a GPU the tiles are
    autotuned per (N_Q, N_K, d, causal, dtype) unless a config is given; in the interpreter they are 16 × 16.
    """
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    (q,), (k, v), (o, do) = _rows_readable(q), _rows_readable(k, v), _rows_readable(o, do)
    lse = lse.float().contiguous()
    scale = _scale(q, sm_scale)
    gpu = world().gpu
    delta = torch.empty_like(lse)
    block = (64 if d <= 128 else 32) if gpu else 16
    attention_bwd_preprocess_kernel[(triton.cdiv(n_q, block), B * H)](o, do, delta, H, n_q, *_strides(o),
                                                                       HEAD_DIM=d, BLOCK_M=block)
    dq, dk, dv = (torch.empty((B, H, n, d), device=q.device, dtype=q.dtype) for n in (n_q, n_k, n_k))
    args = (q, k, v, do, lse, delta)
    strides = (*_strides(q), *_strides(k), *_strides(do))
    if gpu and dkdv_config is None:
        grid = lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), B * H)  # noqa: E731
        _tuned_kernel("dkdv")[grid](*args, dk, dv, scale, H, n_q, n_k, *strides, HEAD_DIM=d, CAUSAL=causal)
    else:
        cfg = {**INTERPRETER_CONFIG, **(dkdv_config or {})}
        grid = (triton.cdiv(n_k, cfg["BLOCK_N"]), B * H)
        attention_bwd_dkdv_kernel[grid](*args, dk, dv, scale, H, n_q, n_k, *strides, HEAD_DIM=d, CAUSAL=causal, **cfg)
    if gpu and dq_config is None:
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
        _tuned_kernel("dq")[grid](*args, dq, scale, H, n_q, n_k, *strides, HEAD_DIM=d, CAUSAL=causal)
    else:
        cfg = {**INTERPRETER_CONFIG, **(dq_config or {})}
        grid = (triton.cdiv(n_q, cfg["BLOCK_M"]), B * H)
        attention_bwd_dq_kernel[grid](*args, dq, scale, H, n_q, n_k, *strides, HEAD_DIM=d, CAUSAL=causal, **cfg)
    return dq, dk, dv


# ---- autograd ------------------------------------------------------------------------------------


class FlashAttention(torch.autograd.Function):
    """Differentiable FlashAttention: chapter 06's forward kernel, this chapter's backward kernels.

    The forward saves ``q``, ``k``, ``v``, the output ``o`` and the log-sum-exp ``lse`` (B, H, N_Q):
    memory that grows as N, never the (B, H, N_Q, N_K) probabilities, which the backward recomputes
    tile by tile. Use it through ``kernelcourse.attention.attention``, which checks the input.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool = False, sm_scale: float | None = None):
        o, lse = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.sm_scale = sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None
