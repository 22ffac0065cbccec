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
  ``q``, ``k``, ``v``, ``o`` and ``lse``, never ``P``) and whose backward is this module's;
- ``attention(q, k, v, causal=False, sm_scale=None)``: the public entry, differentiable, checked once, with
  grouped-query attention (``k``, ``v`` with fewer heads than ``q``). It runs the same kernels as the
  PyTorch operators ``torch.ops.kernelcourse.attention_fwd`` and ``attention_bwd``, which
  ``torch.compile`` traces without a graph break, through lean launchers that work out each shape's
  launch once.

Import this module after ``kc.setup()``: Triton reads the interpreter switch when a kernel is defined.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (INTERPRETER_CONFIG, LOG2E, _TUNING, _chosen, _config, _describe, _device_properties,
                        _forward, _key, _key_range, _launch_tuned, _new_output, _plans, _scale, _smem_bytes,
                        _smem_estimate, attention_flops, causal_mask, causal_query_range, causal_visible,
                        check_inputs, flash_attention, longest_first)
from .launch import direct, specialization
from .world import world

__all__ = ["attention_backward_ref", "tiled_attention_backward_ref", "attention_backward_flops",
           "attention_bwd_preprocess_kernel", "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel",
           "flash_attention_backward", "tuned_configs", "FlashAttention", "DKDV_CONFIGS", "DQ_CONFIGS",
           "attention", "attention_fwd", "attention_bwd"]

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
    first across the whole grid, not only within each head, while only a few heads are in flight, so that
    their tensors can stay in L2 where they fit (chapter 07 prints, for a few shapes, whether four heads' do).
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
                keep = keep & causal_visible(offs_m[None, :], offs_n[:, None])
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
                              CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    # program (key tile, batch·key head): it owns BLOCK_N rows of dK and dV and writes each once.
    # Causal: key tile 0 has the most work; heads four at a time start it first (see tile_and_head)
    start_n, off_hz = tile_and_head(CAUSAL_HEAD_GROUP if CAUSAL else 1)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # this tile's keys
    offs_d = tl.arange(0, HEAD_DIM)
    kv = offs_n[:, None] * stride_kn + offs_d[None, :]                          # k and v share strides
    keys = offs_n[:, None] < N_K
    k_head = head_start(k_ptr, off_hz, H // KV_GROUP, stride_kb, stride_kh)     # k, v: H / KV_GROUP heads
    k = tl.load(k_head + kv, mask=keys, other=0.0)                              # (BLOCK_N, HEAD_DIM)
    v = tl.load(head_start(v_ptr, off_hz, H // KV_GROUP, stride_kb, stride_kh) + kv, mask=keys, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Queries [lo, m_full) need the causal mask; [m_full, m_whole) none; [.., N_Q) the tail's mask.
    m_whole = (N_Q // BLOCK_M) * BLOCK_M               # query tiles that lie entirely before N_Q
    if CAUSAL:
        lo, m_full = causal_query_range(start_n * BLOCK_N, BLOCK_M, BLOCK_N)  # skipped before lo, masked to m_full
        m_full = tl.maximum(lo, tl.minimum(m_full, N_Q))
    else:
        lo = 0
        m_full = 0
    m_tail = tl.maximum(m_full, m_whole)
    # Grouped-query attention: the KV_GROUP query heads that read this key head each add their share, with
    # K and V loaded once (without grouping, KV_GROUP = 1: one head, and the compiler drops the loop).
    for g in range(KV_GROUP):
        off_hq = off_hz * KV_GROUP + g                 # a query head (batch·head) that reads key head off_hz
        q_head = head_start(q_ptr, off_hq, H, stride_qb, stride_qh)
        do_head = head_start(do_ptr, off_hq, H, stride_dob, stride_doh)
        lse_head = lse_ptr + off_hq * N_Q
        delta_head = delta_ptr + off_hq * N_Q
        # The unmasked tiles first, then the masked ones: the sums are the same in any order, but compiled for
        # a Hopper GPU with the diagonal's loop first, ptxas makes every matmul of the kernel wait for the one
        # before it (its warning C7515: "wgmma.mma_async instructions are serialized").
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, m_full, m_whole,
                             N_Q, stride_qn, stride_don, BLOCK_M, HEAD_DIM, False, CAUSAL)
        if CAUSAL:
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, lo, m_full,
                                 N_Q, stride_qn, stride_don, BLOCK_M, HEAD_DIM, True, CAUSAL)
        if not EVEN_M:  # an empty loop where BLOCK_M divides N_Q, but compiled in, it slows the ones before it
            dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, do_head, lse_head, delta_head, qk_scale, offs_n, m_tail, N_Q,
                                 N_Q, stride_qn, stride_don, BLOCK_M, HEAD_DIM, True, CAUSAL)
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
                keep = keep & causal_visible(offs_m[:, None], offs_n[None, :])
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
                            CAUSAL: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    # program (query tile, batch·head), as in the forward; causal tiles near the end have the most keys
    start_m, off_hz = tile_and_head(CAUSAL_HEAD_GROUP if CAUSAL else 1)
    start_m = longest_first(start_m, CAUSAL=CAUSAL)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < N_Q
    q = tl.load(head_start(q_ptr, off_hz, H, stride_qb, stride_qh) + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=rows[:, None], other=0.0)                                  # (BLOCK_M, HEAD_DIM)
    do = tl.load(head_start(do_ptr, off_hz, H, stride_dob, stride_doh) + offs_m[:, None] * stride_don + offs_d[None, :],
                 mask=rows[:, None], other=0.0)
    lse2 = tl.load(lse_ptr + off_hz * N_Q + offs_m, mask=rows, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + off_hz * N_Q + offs_m, mask=rows, other=0.0)
    # query head h reads key head h // KV_GROUP, of H / KV_GROUP
    k_head = head_start(k_ptr, off_hz // KV_GROUP, H // KV_GROUP, stride_kb, stride_kh)
    v_head = head_start(v_ptr, off_hz // KV_GROUP, H // KV_GROUP, stride_kb, stride_kh)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Keys [0, n_full) need no mask; [n_full, n_end) do; [n_end, N_K) are never loaded (chapter 06).
    n_full, n_end = _key_range(start_m * BLOCK_M, N_K, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_head, v_head, qk_scale, offs_m, 0, n_full, N_K, stride_kn,
                   BLOCK_N, HEAD_DIM, False, CAUSAL)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_head, v_head, qk_scale, offs_m, n_full, n_end, N_K, stride_kn,
                   BLOCK_N, HEAD_DIM, True, CAUSAL)
    out = off_hz * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]   # dq: contiguous
    tl.store(dq_ptr + out, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=rows[:, None])


# ---- configs and launcher ------------------------------------------------------------------------
#
# The tile configs, the shared-memory estimate, the autotuning and the interpreter's tiles are chapter 06's
# (kernelcourse.attention): this module only lists its own candidates and which of them a large GPU tries.

# Candidates for the dK/dV kernel: a key tile of BLOCK_N rows stays in registers while query tiles of
# BLOCK_M rows stream past. The last ones fit a small GPU's shared memory (16 x 16 tiles: d = 256 on a T4).
DKDV_CONFIGS = [
    _config(64, 128, 8, 3), _config(64, 128, 8, 2), _config(64, 64, 4, 2), _config(32, 128, 4, 3),
    _config(32, 64, 4, 3), _config(64, 64, 4, 3), _config(32, 64, 4, 2), _config(32, 64, 4, 1),
    _config(16, 64, 4, 2), _config(16, 32, 4, 1), _config(16, 16, 4, 1),
]
# Candidates for the dQ kernel: the other way round, a query tile stays while key tiles stream past.
DQ_CONFIGS = [
    _config(128, 128, 8, 2), _config(128, 64, 8, 4), _config(128, 64, 8, 3), _config(128, 32, 4, 3),
    _config(64, 32, 4, 3), _config(64, 64, 4, 3), _config(64, 32, 4, 2), _config(64, 16, 4, 2),
    _config(32, 16, 4, 1), _config(16, 16, 4, 1),
]


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


def _pruner(resident: str):
    def prune(configs, named_args, **kwargs):
        """The candidates whose tiles fit in this GPU's shared memory (64 KB per block on a T4, 227 KB
        on an H100), on a large GPU the few chosen for this head dim, not much larger than the sequences."""
        d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
        props = _device_properties()
        smem, smem_of = props.get("max_shared_mem", 0) or 1 << 30, _smem_estimate(props.get("fma_dot", False))
        kept = [c for c in configs if smem_of(c, d, resident, resident_tiles=2) <= smem]
        if smem >= 200 * 1024 and d in _TRIED[resident]:
            kept = [c for c in kept if _key(c) in _TRIED[resident][d]]
        n_q = named_args.get("N_Q", kwargs.get("N_Q"))
        n_k = named_args.get("N_K", kwargs.get("N_K"))
        short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(n_q, 32) and c.kwargs["BLOCK_N"] <= max(n_k, 32)]
        return short or kept or configs[-1:]
    return prune


def _bench_long(fn, quantiles):
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


_TUNING["dkdv"] = (attention_bwd_dkdv_kernel, DKDV_CONFIGS, _pruner("kv"), _bench_long)
_TUNING["dq"] = (attention_bwd_dq_kernel, DQ_CONFIGS, _pruner("q"), _bench_long)


def tuned_configs() -> dict[str, str]:
    """The configs of the last GPU launch of each backward kernel, in words."""
    return {which: _describe(_chosen[which]) for which in ("dkdv", "dq") if which in _chosen}


def _rows_readable(*tensors):
    """The tensors as the kernels read them: (B, H, N, d) with rows of d contiguous elements, all of one
    stride pattern (k and v are read with one set of strides, o and do with another). Views such as
    heads split off a fused QKV projection are read in place; anything else gets contiguous copies."""
    if all(t.stride(-1) == 1 for t in tensors) and len({t.stride() for t in tensors}) == 1:
        return tensors
    return tuple(t.contiguous() for t in tensors)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _preprocess_block(d: int) -> int:
    return (64 if d <= 128 else 32) if world().gpu else 16


def flash_attention_backward(q, k, v, o, lse, do, causal: bool = False, sm_scale: float | None = None,
                             dkdv_config: dict | None = None, dq_config: dict | None = None):
    """FlashAttention backward: ``(dq, dk, dv)`` from the inputs, the forward's ``o`` and ``lse``, and ``do``.

    Three launches: ``D = rowsum(dO ∘ O)``; one program per (key tile, batch·key head) that loops over the
    query tiles (of every query head that reads this key head) and writes ``dK`` and ``dV``; one per (query
    tile, batch·head) that loops over the key tiles and writes ``dQ``. Every output element is written once,
    by one program: no atomics, and the result is the same from run to run. The inputs are read through
    their strides (heads that are views of a fused projection are not copied); the gradients come out
    contiguous. ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention, as in
    ``flash_attention``): ``dk`` and ``dv`` then sum over the query heads that share a key head. On a GPU the
    tiles are autotuned per (N_Q, N_K, d, causal, dtype) unless a config is given; in the interpreter they
    are ``INTERPRETER_CONFIG``'s.
    """
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    (q,), (k, v), (o, do) = _rows_readable(q), _rows_readable(k, v), _rows_readable(o, do)
    lse = lse.float().contiguous()
    scale = _scale(q, sm_scale)
    gpu = world().gpu
    delta = torch.empty_like(lse)
    block = _preprocess_block(d)
    attention_bwd_preprocess_kernel[(triton.cdiv(n_q, block), B * H)](o, do, delta, H, n_q, *_strides(o),
                                                                       HEAD_DIM=d, BLOCK_M=block)
    dq = torch.empty((B, H, n_q, d), device=q.device, dtype=q.dtype)
    dk, dv = (torch.empty((B, h_kv, n_k, d), device=q.device, dtype=q.dtype) for _ in "kv")
    args = (q, k, v, do, lse, delta)
    strides = (*_strides(q), *_strides(k), *_strides(do))
    consts = {"HEAD_DIM": d, "CAUSAL": causal, "KV_GROUP": H // h_kv}
    if gpu and dkdv_config is None:
        grid = lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), B * h_kv)  # noqa: E731
        _launch_tuned("dkdv", grid, *args, dk, dv, scale, H, n_q, n_k, *strides, **consts)
    else:
        cfg = {**INTERPRETER_CONFIG, **(dkdv_config or {})}
        grid = (triton.cdiv(n_k, cfg["BLOCK_N"]), B * h_kv)
        attention_bwd_dkdv_kernel[grid](*args, dk, dv, scale, H, n_q, n_k, *strides, **consts, **cfg)
    if gpu and dq_config is None:
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
        _launch_tuned("dq", grid, *args, dq, scale, H, n_q, n_k, *strides, **consts)
    else:
        cfg = {**INTERPRETER_CONFIG, **(dq_config or {})}
        grid = (triton.cdiv(n_q, cfg["BLOCK_M"]), B * H)
        attention_bwd_dq_kernel[grid](*args, dq, scale, H, n_q, n_k, *strides, **consts, **cfg)
    return dq, dk, dv


# ---- autograd ------------------------------------------------------------------------------------

NO_SECOND_DERIVATIVE = ("kernelcourse attention has no second derivative: its backward kernels are not "
                        "differentiable, so the gradient of its gradients (create_graph=True) would miss terms. "
                        "Use attention_ref where a second derivative is needed.")



class FlashAttention(torch.autograd.Function):
    """Differentiable FlashAttention: chapter 06's forward kernel, this chapter's backward kernels.

    The forward saves ``q``, ``k``, ``v``, the output ``o`` and the log-sum-exp ``lse`` (B, H, N_Q):
    memory that grows as N, never the (B, H, N_Q, N_K) probabilities, which the backward recomputes
    tile by tile. The backward kernels are not themselves differentiable: a backward that would build a
    graph for a second derivative (``create_graph=True``) raises instead of silently missing its terms.
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
        if torch.is_grad_enabled():                     # create_graph=True: a second derivative is coming
            raise RuntimeError(NO_SECOND_DERIVATIVE)
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal=ctx.causal, sm_scale=ctx.sm_scale)
        return dq, dk, dv, None, None


# ---- the lean backward ---------------------------------------------------------------------------
#
# flash_attention_backward for inputs that come from the operator's forward (lse float32 and contiguous,
# o laid out by _forward), with each shape's launches worked out once, as chapter 06's _forward does.


def _backward(q, k, v, o, lse, do, causal: bool, scale: float):
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    if do.stride() != o.stride():                # o is the forward's: rows contiguous
        o, do = o.contiguous(), do.contiguous()
    key = ("bwd", q.dtype, q.get_device(), B, H, h_kv, n_q, n_k, d, causal)
    plan = _plans.get(key)
    delta = torch.empty((B, H, n_q), device=q.device, dtype=torch.float32)
    dq = torch.empty((B, H, n_q, d), device=q.device, dtype=q.dtype)
    dk = torch.empty((B, h_kv, n_k, d), device=q.device, dtype=q.dtype)
    dv = torch.empty((B, h_kv, n_k, d), device=q.device, dtype=q.dtype)
    so, sq, sk, sdo = o.stride(), q.stride(), k.stride(), do.stride()
    strides = (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sdo[0], sdo[1], sdo[2])
    if plan is not None:
        pre_grid, pre_kw, dkdv_grid, dkdv_kw, dq_grid, dq_kw, tuned = plan
        # the plan fixes the sizes and constexprs; the layouts and the pointers' alignment can still vary
        spec = key + so + strides + specialization(q, k, v, o, do, lse)
        direct(_PRE, spec, pre_grid, (o, do, delta, H, n_q, so[0], so[1], so[2]), pre_kw)
        direct(_DKDV, spec, dkdv_grid, (q, k, v, do, lse, delta, dk, dv, scale, H, n_q, n_k, *strides), dkdv_kw)
        direct(_DQ, spec, dq_grid, (q, k, v, do, lse, delta, dq, scale, H, n_q, n_k, *strides), dq_kw)
        if tuned:
            _chosen.update(tuned)                # what tuned_configs() reports
        return dq, dk, dv
    # the first call of this shape: through the autotuners on a GPU, and the launches kept
    block = _preprocess_block(d)
    pre_grid, pre_kw = (triton.cdiv(n_q, block), B * H), {"HEAD_DIM": d, "BLOCK_M": block}
    _PRE.run(o, do, delta, H, n_q, so[0], so[1], so[2], grid=pre_grid, warmup=False, **pre_kw)
    consts = {"HEAD_DIM": d, "CAUSAL": causal, "KV_GROUP": H // h_kv}
    args = (q, k, v, do, lse, delta)
    if world().gpu:
        tuned = {"dkdv": _launch_tuned("dkdv", lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), B * h_kv),
                                       *args, dk, dv, scale, H, n_q, n_k, *strides, **consts),
                 "dq": _launch_tuned("dq", lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H),
                                     *args, dq, scale, H, n_q, n_k, *strides, **consts)}
        dkdv_cfg, dq_cfg = ({**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} for c in tuned.values())
    else:
        tuned = None
        dkdv_cfg = dq_cfg = INTERPRETER_CONFIG
    dkdv_kw = {**consts, **dkdv_cfg, "EVEN_M": n_q % dkdv_cfg["BLOCK_M"] == 0}
    dq_kw = {**consts, **dq_cfg}
    plan = (pre_grid, pre_kw, (triton.cdiv(n_k, dkdv_cfg["BLOCK_N"]), B * h_kv), dkdv_kw,
            (triton.cdiv(n_q, dq_cfg["BLOCK_M"]), B * H), dq_kw, tuned)
    if not world().gpu:
        _DKDV.run(*args, dk, dv, scale, H, n_q, n_k, *strides, grid=plan[2], warmup=False, **dkdv_kw)
        _DQ.run(*args, dq, scale, H, n_q, n_k, *strides, grid=plan[4], warmup=False, **dq_kw)
    _plans[key] = plan
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """What ``attention`` runs eagerly: ``FlashAttention`` with the lean launchers."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled():
            raise RuntimeError(NO_SECOND_DERIVATIVE)
        return (*_backward(*ctx.saved_tensors, do, ctx.causal, ctx.scale), None, None)


_PRE = attention_bwd_preprocess_kernel
_DKDV = attention_bwd_dkdv_kernel.fn   # under triton.heuristics: the lean path passes EVEN_M itself
_DQ = attention_bwd_dq_kernel


# ---- the operator -------------------------------------------------------------------------------
#
# Why custom operators and not torch.library.wrap_triton: PyTorch's compiler (torch.compile, Dynamo)
# cannot look inside this launcher (it reads data_ptr() to decide whether to copy, and the autotuner's
# configs carry pre-hooks, which it refuses for user Triton kernels), and in Triton's interpreter a
# wrapped kernel fails under the fake tensors that tracing uses ("Cannot access data pointer"). A custom
# operator is opaque to the compiler: it traces the operator's fake implementation, which only says what
# shapes, dtypes and layouts come out, and at run time calls the real one. So ``attention`` compiles with
# ``fullgraph=True`` on a GPU and on the CPU alike, and the CPU time of each call is the lean launcher's.

@torch.library.custom_op("kernelcourse::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of FlashAttention for checked inputs (see ``attention``); ``sm_scale`` given."""
    return _forward(q, k, v, causal, sm_scale)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, sm_scale):
    B, H, n_q, _ = q.shape
    o = _new_output(q)                      # laid out as q, whichever version the GPU runs
    return o, q.new_empty((B, H, n_q), dtype=torch.float32)


@torch.library.custom_op("kernelcourse::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  do: torch.Tensor, causal: bool, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from ``attention_fwd``'s inputs and outputs and the gradient ``do`` of ``o``."""
    return _backward(q, k, v, o, lse, do, causal, sm_scale)


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, lse, do, causal, sm_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape)


def _save_for_backward(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.sm_scale = causal, sm_scale
    ctx.mark_non_differentiable(lse)


def _attention_fwd_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(q, k, v, o, lse, do, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


def _no_double_backward(ctx, ddq, ddk, ddv):
    raise RuntimeError(NO_SECOND_DERIVATIVE)


attention_fwd.register_autograd(_attention_fwd_backward, setup_context=_save_for_backward)
attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)
_ATTENTION_FWD = torch.ops.kernelcourse.attention_fwd.default


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None):
    """Differentiable FlashAttention, ``softmax(q kᵀ · sm_scale) v`` (introduced in chapter 07).

    ``q`` is (B, H, N_Q, d), ``k`` and ``v`` (B, H_KV, N_K, d) with H_KV dividing H (grouped-query attention:
    query head h reads key head h // (H / H_KV); H_KV = H is ordinary multi-head attention). One floating
    dtype (float16, bfloat16 or float32), on the course's device (``kc.world().device``), ``d`` a power of
    two from 16 to 256, ``sm_scale`` > 0 (default 1/√d), ``causal`` top-left aligned. Raises
    ``ValueError`` saying what is wrong with the input, once, here.

    It runs the operator ``torch.ops.kernelcourse.attention_fwd`` (whose backward is
    ``kernelcourse::attention_bwd``): the same kernels as ``FlashAttention``, launched by the lean
    launchers, and a call ``torch.compile(fullgraph=True)`` traces without a graph break.
    """
    check_inputs(q, k, v, causal, sm_scale)
    causal, scale = bool(causal), _scale(q, sm_scale)
    if torch.compiler.is_compiling():            # traced: the operator, opaque to the compiler
        return _ATTENTION_FWD(q, k, v, causal, scale)[0]
    # Run eagerly, the operator's dispatch and autograd cost more CPU time than a short kernel takes on the
    # GPU: call the same launchers through an autograd Function, or without one when no gradient is wanted.
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, causal, scale)
    return _forward(q, k, v, causal, scale)[0]
