"""Attention: the references, the online-softmax helpers and the FlashAttention forward kernel
(introduced in chapter 06).

Everything takes and returns tensors shaped ``(B, H, N, d)`` (batch, heads, sequence, head dim):
queries ``q`` of shape ``(B, H, N_Q, d)``, keys and values ``k``, ``v`` of shape ``(B, H, N_K, d)``,
with ``N_Q`` and ``N_K`` free to differ. The kernels also take keys and values with fewer heads,
``(B, H_KV, N_K, d)`` with H_KV dividing H (grouped-query attention: query head h reads key head
h // (H / H_KV)); the references take them with repeated heads (``k.repeat_interleave(H // H_KV, 1)``).

- ``attention_ref``: the spec, ``softmax(q kᵀ · sm_scale) v`` in plain PyTorch, computed in float32
  (float64 stays float64), with the log-sum-exp of each row if asked for;
- ``softmax_state``, ``online_softmax_merge``, ``online_softmax``: the online softmax, as partial
  states ``(m, l, acc)`` (running max, running sum of exponentials, unnormalised output) that merge;
- ``tiled_attention_ref``: attention tile by tile in plain PyTorch with the online softmax, the
  algorithm of the kernel, without ever holding more than a tile of scores;
- ``flash_attention``: the Triton forward kernel, returning the output and the log-sum-exp that a
  backward pass needs; the chapter builds it in four versions, ``flash_attention_v1_kernel`` to
  ``flash_attention_v4_kernel`` (the final one), and ``flash_attention(..., version=N)`` runs any of them;
- ``causal_key_range``: the keys a causal query tile computes without a mask, with one, or skips, shared by
  the kernels, the lesson and the graders.
- ``check_inputs`` and the lean launcher ``_forward``: what the differentiable ``attention`` of chapter 07
  (``kernelcourse.attention_backward.attention``) checks, and runs.

**Causal masks are top-left aligned**, as in ``torch.nn.functional.scaled_dot_product_attention(...,
is_causal=True)``: query ``i`` sees keys ``j <= i``, counting both from the start of their sequences.
With ``N_Q > N_K`` the queries past ``N_K`` see every key; with ``N_Q < N_K`` the keys past ``N_Q`` are
never seen. Every row sees at least key 0, so no row of the softmax is empty. (Bottom-right alignment,
``j <= i + N_K - N_Q``, is what decoding with a KV cache wants: the last query is the newest token and
sees every cached key. It is not what SDPA's flag does; with ``N_Q = N_K`` the two agree.)

The log-sum-exp ``lse[b, h, i] = log Σ_j exp(s_ij)`` of the scaled scores ``s = q kᵀ · sm_scale`` is
in natural-log units, float32, shape ``(B, H, N_Q)``: ``softmax(s)_ij = exp(s_ij - lse_i)``.

Import this module after ``kc.setup()``: Triton reads the interpreter switch when a kernel is defined.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import direct, specialization
from .world import device_capability, gpu_properties, world

__all__ = ["attention_ref", "causal_mask", "softmax_state", "online_softmax_merge", "online_softmax",
           "tiled_attention_ref", "flash_attention", "flash_attention_kernel", "attention_flops",
           "tuned_config", "FWD_CONFIGS", "LOG2E", "VERSIONS", "FINAL", "causal_key_range", "check_inputs"]

# Constants that kernels read are constexprs (Triton reads no other globals); on the host, ``LOG2E.value``.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x · log2(e))
LN2 = tl.constexpr(0.6931471805599453)    # ln(2): log(x) = log2(x) · ln(2)


# ---- the spec ----------------------------------------------------------------------------------


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """(n_q, n_k) booleans, True where query i may see key j: j <= i (top-left aligned, as SDPA)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def _scale(q: torch.Tensor, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None, return_lse: bool = False,
                  compute_dtype: torch.dtype | None = None):
    """``softmax(q kᵀ · sm_scale) v``, the plain PyTorch spec; ``sm_scale`` defaults to ``1/√d``.

    Computes in ``compute_dtype``: float32 by default (float64 inputs stay float64), or the inputs' own
    dtype to get what a naive half-precision implementation gives. Returns the output in ``q.dtype``,
    and with ``return_lse`` also the float32 log-sum-exp of each row, ``(B, H, N_Q)``.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    s = (qc @ kc.transpose(-2, -1)) * _scale(q, sm_scale)         # (B, H, N_Q, N_K)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(s.float() if compute_dtype == torch.float16 else s, dim=-1)
    o = (torch.softmax(s, dim=-1) @ vc).to(q.dtype)
    return (o, lse.float() if lse.dtype != torch.float64 else lse) if return_lse else o


def attention_flops(B: int, H: int, n_q: int, n_k: int, d: int, causal: bool = False) -> float:
    """FLOPs of an attention forward: two matmuls of 2·N_Q·N_K·d each per head; half with a causal
    mask (the convention of FlashAttention's and Triton's benchmarks, exact for N_Q = N_K → ∞)."""
    flops = 4.0 * B * H * n_q * n_k * d
    return flops / 2 if causal else flops


# ---- the online softmax ------------------------------------------------------------------------


def softmax_state(scores: torch.Tensor, v: torch.Tensor | None = None):
    """The partial state ``(m, l, acc)`` of one block of scores ``(..., n)``.

    ``m`` is the max over the block, ``l = Σ exp(scores - m)``, ``acc = exp(scores - m) @ v`` (None
    without ``v``). A row whose scores are all ``-inf`` (masked) gives the empty state
    ``(-inf, 0, 0)``.
    """
    m = scores.amax(dim=-1)
    p = torch.exp(scores - _finite(m)[..., None])
    return m, p.sum(dim=-1), (p @ v if v is not None else None)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf (an empty state) replaced by 0, so that exp(x - m) never computes -inf - (-inf)."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def online_softmax_merge(a, b):
    """Merge two partial states ``(m, l, acc)`` of disjoint blocks of the same rows into one.

    Each state was computed against its own max; both are rescaled to the larger one,
    ``m = max(m_a, m_b)``, by factors ``exp(m_a - m) <= 1`` and ``exp(m_b - m) <= 1``. The merge is
    associative and commutative, so blocks can be processed in any order and grouping. ``acc`` may be
    None in both. The output of attention is ``acc / l`` and its log-sum-exp ``m + log(l)``.
    """
    m_a, l_a, acc_a = a
    m_b, l_b, acc_b = b
    m = torch.maximum(m_a, m_b)
    alpha = torch.exp(m_a - _finite(m))  # exp(-inf) = 0: an empty state contributes nothing
    beta = torch.exp(m_b - _finite(m))
    l = alpha * l_a + beta * l_b
    acc = None if acc_a is None else alpha[..., None] * acc_a + beta[..., None] * acc_b
    return m, l, acc


def online_softmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Softmax over the last dimension, reading ``x`` in blocks of ``block`` columns: one pass for
    the max and the sum (merging block states), one to normalise."""
    state = None
    for start in range(0, x.shape[-1], block):
        s = softmax_state(x[..., start:start + block])
        state = s if state is None else online_softmax_merge(state, s)
    m, l, _ = state
    return torch.exp(x - m[..., None]) / l[..., None]


# ---- tiled attention in plain PyTorch ------------------------------------------------------------


def tiled_attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None,
                        block_m: int = 64, block_n: int = 64):
    """Attention tile by tile, with the online softmax: what the Triton kernel does, in PyTorch.

    For each tile of ``block_m`` queries, loop over tiles of ``block_n`` keys, keeping the running
    ``(m, l, acc)`` of every query row; with ``causal``, tiles entirely above the diagonal are skipped.
    No tensor larger than ``(B, H, block_m, block_n)`` of scores is ever made. Computes in float32
    (float64 stays float64); returns ``(o, lse)`` like ``flash_attention``.
    """
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = (t.to(ct) for t in (q, k, v))
    scale = _scale(q, sm_scale)
    o = torch.empty(B, H, n_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, n_q, dtype=ct, device=q.device)
    for m0 in range(0, n_q, block_m):
        q_tile = qc[:, :, m0:m0 + block_m]                               # (B, H, bm, d)
        rows = torch.arange(m0, m0 + q_tile.shape[2], device=q.device)
        m_i = torch.full(q_tile.shape[:3], float("-inf"), dtype=ct, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        # causal: keys past the tile's last query are masked for every row, so their tiles are skipped
        n_end = min(n_k, m0 + q_tile.shape[2]) if causal else n_k
        for n0 in range(0, n_end, block_n):
            s = (q_tile @ kc[:, :, n0:n0 + block_n].transpose(-2, -1)) * scale   # (B, H, bm, bn)
            if causal:
                cols = torch.arange(n0, n0 + s.shape[-1], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            alpha = torch.exp(m_i - m_new)                  # rescales what was summed against m_i
            p = torch.exp(s - m_new[..., None])
            l_i = alpha * l_i + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vc[:, :, n0:n0 + block_n]
            m_i = m_new
        o[:, :, m0:m0 + block_m] = (acc / l_i[..., None]).to(q.dtype)
        lse[:, :, m0:m0 + block_m] = m_i + torch.log(l_i)
    return o, lse if ct == torch.float64 else lse.float()


# ---- the Triton kernels, version by version ------------------------------------------------------
#
# Chapter 06 builds the forward kernel in four versions, kept side by side (same name, version suffix):
#   v1  pointer loads, every key tile computed and masked, exp              (exercise 06.4's kernel)
#   v2  exp2 with log2(e) in the scale; causal tiles above the diagonal skipped; masks only on the tiles
#       that need one; the longest causal programs first                  (pointer loads: any GPU)
#   v3  tiles read through tensor descriptors (TMA copies on Hopper)
#   v4  the inner loop software-pipelined: the next tile's q kᵀ issued before this tile's p @ v (final)
# ``flash_attention(..., version=N)`` runs any of them; by default v4, or v2 on GPUs older than Hopper,
# which have no TMA (Triton would rewrite v4's descriptor loads into pointer loads nobody tested).

VERSIONS = {1: "pointer loads, every tile masked", 2: "causal tiles skipped, masked tiles split off, exp2",
            3: "tensor descriptors (TMA)", 4: "software-pipelined loop"}
FINAL = 4


@triton.jit
def causal_key_range(q0, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(n_full, n_end)`` for the causal query tile of rows q0 .. q0 + BLOCK_M - 1 and N_K keys.

    Keys [0, n_full) form whole tiles that every query of the tile sees: no mask. Keys [n_full, n_end)
    need one (they cross the diagonal, or pass N_K). Keys from n_end on come after the tile's last query
    and are never loaded. n_full is a multiple of BLOCK_N, so the masked tiles start on a tile boundary.

    The kernels call it on scalars; on the host ``causal_key_range.fn(q0, n_k, block_m, block_n)`` is the
    same function on Python ints (Triton compiles ``min`` of two scalars to ``tl.minimum``).
    """
    n_full = min((q0 + 1) // BLOCK_N * BLOCK_N,       # tiles whose last key is <= q0, the first query
                 N_K // BLOCK_N * BLOCK_N)            # and that lie entirely before N_K
    n_end = min(q0 + BLOCK_M, N_K)                    # the last query, q0 + BLOCK_M - 1, sees keys < q0 + BLOCK_M
    return n_full, n_end


@triton.jit
def causal_query_range(k0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(m_start, m_full)`` for the causal key tile of keys k0 .. k0 + BLOCK_N - 1 (the backward's dK/dV).

    Query tiles before m_start see none of these keys (their queries come before k0): skipped. Tiles
    from m_start up to m_full cross the diagonal and need the mask. From m_full on, a tile's first query
    is at or after the tile's last key, k0 + BLOCK_N - 1, so every query sees every key. Both are
    multiples of BLOCK_M. The kernel clips m_full to the number of queries. On the host,
    ``causal_query_range.fn(k0, block_m, block_n)`` is the same function on Python ints.
    """
    m_start = k0 // BLOCK_M * BLOCK_M
    m_full = (k0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M   # the first multiple of BLOCK_M >= k0 + BLOCK_N - 1
    return m_start, m_full


@triton.jit
def causal_visible(queries, keys):
    """The causal mask, top-left aligned as SDPA's ``is_causal``: query i sees key j when j <= i. The
    kernels pass index vectors already broadcast to their tile, (queries, keys) or (keys, queries)."""
    return keys <= queries


@triton.jit
def longest_first(tile, CAUSAL: tl.constexpr):
    """This program's query tile, the grid's order reversed under a causal mask: there, the tiles near
    the end see the most keys, and starting them first keeps the GPU from waiting on a few long ones."""
    if CAUSAL:
        tile = tl.num_programs(0) - 1 - tile
    return tile


@triton.jit
def _key_range(q0, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(n_full, n_end) of any query tile: the causal range, or all keys with only the last, partial tile masked."""
    if CAUSAL:
        n_full, n_end = causal_key_range(q0, N_K, BLOCK_M, BLOCK_N)
    else:
        n_full, n_end = N_K // BLOCK_N * BLOCK_N, N_K
    return n_full, n_end


# -- v1: the kernel of exercise 06.4, with a causal mask and the log-sum-exp

@triton.jit(do_not_specialize=["N_Q", "N_K"])
def flash_attention_v1_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sm_scale, N_Q, N_K,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    # program (query tile, batch·head) of contiguous (B·H, N, d) tensors; k and v have H / KV_GROUP heads
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1).to(tl.int64)
    q_ptr += off_hz * N_Q * HEAD_DIM
    o_ptr += off_hz * N_Q * HEAD_DIM
    k_ptr += (off_hz // KV_GROUP) * N_K * HEAD_DIM                         # query head h reads key head h // KV_GROUP
    v_ptr += (off_hz // KV_GROUP) * N_K * HEAD_DIM
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < N_Q, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)              # running max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                            # running sum of exp
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                  # running p @ v
    for start_n in range(0, N_K, BLOCK_N):                                 # every key tile, causal or not
        keys = start_n + offs_n
        k = tl.load(k_ptr + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=keys[:, None] < N_K, other=0.0)
        v = tl.load(v_ptr + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=keys[:, None] < N_K, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale                              # (BLOCK_M, BLOCK_N), fp32
        keep = keys[None, :] < N_K
        if CAUSAL:
            keep = keep & causal_visible(offs_m[:, None], keys[None, :])
        s = tl.where(keep, s, float("-inf"))
        # Key 0 is in the first tile and every row sees it: from then on m_new is finite, and a row whose
        # scores in a later tile are all -inf gets p = exp(-inf) = 0 from it.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)                                        # rescales what was summed against m_i
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    tl.store(lse_ptr + off_hz * N_Q + offs_m, m_i + tl.log(l_i), mask=offs_m < N_Q)
    o = acc / l_i[:, None]
    tl.store(o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < N_Q)


# -- pieces shared by v2, v3 and v4

@triton.jit
def _probabilities(qk, m_i, qk_scale, keys, offs_m, N_K, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Raw scores q·kᵀ of one tile to (p, m_new): the running max over this tile too, and p = exp2(s2 - m_new).

    Scores are kept in base-2 units: s2 = q·k · sm_scale · log2(e), so exp(s) = exp2(s2) and the scale
    costs one multiply-add per score. MASKED tiles (the last, partial one; the causal diagonal) set the
    scores of keys past N_K, or after the query, to -inf; the others need no mask at all.
    """
    if MASKED:
        keep = keys[None, :] < N_K
        if CAUSAL:
            keep = keep & causal_visible(offs_m[:, None], keys[None, :])
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk -= m_new[:, None]
    else:
        # qk_scale > 0, so max(qk) · qk_scale = max(qk · qk_scale): the max can be taken on the raw
        # scores, and the scaling fused into the subtraction below as one multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    # Every row has seen key 0 by its first tile, so m_new is finite and -inf - m_new is -inf: p = 0.
    return tl.math.exp2(qk), m_new


@triton.jit
def _accumulate(acc, l_i, m_i, m_new, p, v):
    """Rescale the running sums from max m_i to m_new, then add this tile's p and p @ v."""
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _program_tile(CAUSAL: tl.constexpr):
    """(query tile, batch·head) of this program; causal, the longest query tiles first."""
    return longest_first(tl.program_id(0), CAUSAL=CAUSAL), tl.program_id(1)


# -- v2: exp2, causal tiles skipped, masks only where needed; pointer loads

@triton.jit
def _load_rows(ptr, rows, offs_d, n_rows, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """Rows ``rows`` of a contiguous (n_rows, HEAD_DIM) matrix at ptr; MASKED: rows past n_rows read 0."""
    ptrs = ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tiles_v2(acc, l_i, m_i, q, k_ptr, v_ptr, qk_scale, offs_m, offs_n, offs_d, lo, hi, N_K,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the key tiles lo, lo + BLOCK_N, ... < hi into the running (acc, l_i, m_i)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        qk = tl.dot(q, tl.trans(_load_rows(k_ptr, keys, offs_d, N_K, HEAD_DIM, MASKED=MASKED)))
        p, m_new = _probabilities(qk, m_i, qk_scale, keys, offs_m, N_K, MASKED=MASKED, CAUSAL=CAUSAL)
        v = _load_rows(v_ptr, keys, offs_d, N_K, HEAD_DIM, MASKED=MASKED)
        acc, l_i, m_i = _accumulate(acc, l_i, m_i, m_new, p, v)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def flash_attention_v2_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qk_scale, N_Q, N_K,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    start_m, off_hz = _program_tile(CAUSAL=CAUSAL)
    off_hz = off_hz.to(tl.int64)                      # contiguous (B·H, N, d): large offsets need 64 bits
    q_ptr += off_hz * N_Q * HEAD_DIM
    o_ptr += off_hz * N_Q * HEAD_DIM
    k_ptr += (off_hz // KV_GROUP) * N_K * HEAD_DIM    # KV_GROUP query heads share each key head
    v_ptr += (off_hz // KV_GROUP) * N_K * HEAD_DIM
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_rows(q_ptr, offs_m, offs_d, N_Q, HEAD_DIM, MASKED=True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)              # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                            # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                  # running p @ v

    # Keys [0, n_full) need no mask; [n_full, n_end) do; [n_end, N_K) are never loaded.
    n_full, n_end = _key_range(start_m * BLOCK_M, N_K, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles_v2(acc, l_i, m_i, q, k_ptr, v_ptr, qk_scale, offs_m, offs_n, offs_d,
                                     0, n_full, N_K, BLOCK_N, HEAD_DIM, MASKED=False, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles_v2(acc, l_i, m_i, q, k_ptr, v_ptr, qk_scale, offs_m, offs_n, offs_d,
                                     n_full, n_end, N_K, BLOCK_N, HEAD_DIM, MASKED=True, CAUSAL=CAUSAL)

    # epilogue: normalise once, and keep log Σ exp(s) (natural log) for the backward pass
    tl.store(lse_ptr + off_hz * N_Q + offs_m, (m_i + tl.math.log2(l_i)) * LN2, mask=offs_m < N_Q)
    o = acc / l_i[:, None]
    tl.store(o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < N_Q)


# -- v3: the same, reading tiles through tensor descriptors

@triton.jit
def _load_tile(desc, off_z, off_h, row, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows row .. row + BLOCK - 1 of head (off_z, off_h) of a (B, H, N, d) tensor, as (BLOCK, HEAD_DIM).

    Through a tensor descriptor: rows past N read as 0, so the load needs no mask. On an H100 the copy
    engine (TMA) does the address arithmetic; elsewhere, and in the interpreter, it is an ordinary load.
    """
    return desc.load([off_z, off_h, row, 0]).reshape(BLOCK, HEAD_DIM)


@triton.jit
def _attend_tiles_v3(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_h, qk_scale, offs_m, offs_n, lo, hi, N_K,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the key tiles lo, lo + BLOCK_N, ... < hi into the running (acc, l_i, m_i)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        qk = tl.dot(q, tl.trans(_load_tile(k_desc, off_z, off_h, start_n, BLOCK_N, HEAD_DIM)))
        p, m_new = _probabilities(qk, m_i, qk_scale, start_n + offs_n, offs_m, N_K, MASKED=MASKED, CAUSAL=CAUSAL)
        v = _load_tile(v_desc, off_z, off_h, start_n, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _accumulate(acc, l_i, m_i, m_new, p, v)
    return acc, l_i, m_i


# H, N_Q and N_K vary from call to call: compiling a variant for each (Triton specializes integer
# arguments by whether they are 1 or multiples of 16) would only cost compile time; nothing in the
# unmasked loop depends on them.
@triton.jit(do_not_specialize=["H", "N_Q", "N_K"])
def flash_attention_v3_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, N_Q, N_K,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    start_m, off_hz = _program_tile(CAUSAL=CAUSAL)
    off_z = off_hz // H
    off_h = off_hz % H
    off_hk = off_h // KV_GROUP                    # the key head it reads: KV_GROUP query heads share one
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_tile(q_desc, off_z, off_h, start_m * BLOCK_M, BLOCK_M, HEAD_DIM)  # rows past N_Q read 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)              # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                            # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                  # running p @ v

    n_full, n_end = _key_range(start_m * BLOCK_M, N_K, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles_v3(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_hk, qk_scale, offs_m, offs_n,
                                     0, n_full, N_K, BLOCK_N, HEAD_DIM, MASKED=False, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles_v3(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_hk, qk_scale, offs_m, offs_n,
                                     n_full, n_end, N_K, BLOCK_N, HEAD_DIM, MASKED=True, CAUSAL=CAUSAL)

    tl.store(lse_ptr + off_hz * N_Q + offs_m, (m_i + tl.math.log2(l_i)) * LN2, mask=offs_m < N_Q)
    o = (acc / l_i[:, None]).to(o_desc.dtype)
    o_desc.store([off_z, off_h, start_m * BLOCK_M, 0], o.reshape(1, 1, BLOCK_M, HEAD_DIM))  # rows past N_Q: not written


# -- v4, the final version: the inner loop software-pipelined

@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_h, qk_scale, offs_m, offs_n, lo, hi, N_K,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """The inner loop: fold the key tiles lo, lo + BLOCK_N, ... < hi into the running (acc, l_i, m_i).

    Software-pipelined by hand: each iteration takes the softmax of scores the previous one computed,
    then issues the next tile's q kᵀ, then this tile's p @ v. On an H100 a warpgroup matmul is
    asynchronous, and the p @ v is waited for only when the next q kᵀ is: the next softmax, which needs
    neither, runs on the other units meanwhile. The loop stops one tile early; the last tile's softmax
    and p @ v come after it.
    """
    if lo < hi:
        last = lo + (hi - lo - 1) // BLOCK_N * BLOCK_N                     # the start of the last tile
        qk = tl.dot(q, tl.trans(_load_tile(k_desc, off_z, off_h, lo, BLOCK_N, HEAD_DIM)))
        # Invariant at the top of each iteration: qk holds the raw scores of tile start_n, whose softmax
        # is not taken yet; (acc, l_i, m_i) hold every tile before start_n.
        for start_n in range(lo, last, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            p, m_new = _probabilities(qk, m_i, qk_scale, start_n + offs_n, offs_m, N_K, MASKED=MASKED, CAUSAL=CAUSAL)
            qk = tl.dot(q, tl.trans(_load_tile(k_desc, off_z, off_h, start_n + BLOCK_N, BLOCK_N, HEAD_DIM)))
            v = _load_tile(v_desc, off_z, off_h, start_n, BLOCK_N, HEAD_DIM)
            acc, l_i, m_i = _accumulate(acc, l_i, m_i, m_new, p, v)
        p, m_new = _probabilities(qk, m_i, qk_scale, last + offs_n, offs_m, N_K, MASKED=MASKED, CAUSAL=CAUSAL)
        v = _load_tile(v_desc, off_z, off_h, last, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _accumulate(acc, l_i, m_i, m_new, p, v)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["H", "N_Q", "N_K"])
def flash_attention_v4_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, N_Q, N_K,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr, KV_GROUP: tl.constexpr = 1):
    start_m, off_hz = _program_tile(CAUSAL=CAUSAL)
    off_z = off_hz // H
    off_h = off_hz % H
    off_hk = off_h // KV_GROUP                    # the key head it reads: KV_GROUP query heads share one
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # query rows of this tile
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_tile(q_desc, off_z, off_h, start_m * BLOCK_M, BLOCK_M, HEAD_DIM)  # rows past N_Q read 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)              # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                            # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)                  # running p @ v

    # Keys [0, n_full) need no mask; [n_full, n_end) do; [n_end, N_K) are never loaded.
    n_full, n_end = _key_range(start_m * BLOCK_M, N_K, BLOCK_M, BLOCK_N, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_hk, qk_scale, offs_m, offs_n,
                                  0, n_full, N_K, BLOCK_N, HEAD_DIM, MASKED=False, CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_desc, v_desc, off_z, off_hk, qk_scale, offs_m, offs_n,
                                  n_full, n_end, N_K, BLOCK_N, HEAD_DIM, MASKED=True, CAUSAL=CAUSAL)

    # epilogue: normalise once, and keep log Σ exp(s) = (m2 + log2 Σ exp2(s2 - m2)) · ln 2 for the backward pass
    lse = (m_i + tl.math.log2(l_i)) * LN2
    tl.store(lse_ptr + off_hz * N_Q + offs_m, lse, mask=offs_m < N_Q)
    o = (acc / l_i[:, None]).to(o_desc.dtype)
    o_desc.store([off_z, off_h, start_m * BLOCK_M, 0], o.reshape(1, 1, BLOCK_M, HEAD_DIM))  # rows past N_Q: not written


flash_attention_kernel = flash_attention_v4_kernel     # the final version
_KERNELS = {1: flash_attention_v1_kernel, 2: flash_attention_v2_kernel, 3: flash_attention_v3_kernel,
            4: flash_attention_v4_kernel}
_DESCRIPTORS = {3, 4}                                  # the versions that read tiles through tensor descriptors


# ---- tile sizes ----------------------------------------------------------------------------------
#
# Shared with the backward kernels of chapter 07 (kernelcourse.attention_backward imports them from here).


def _set_block_shapes(nargs):
    """The autotuner's pre-hook: the tensor descriptors read tiles of the config's sizes."""
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["q_desc"].block_shape = nargs["o_desc"].block_shape = [1, 1, bm, d]
    nargs["k_desc"].block_shape = nargs["v_desc"].block_shape = [1, 1, bn, d]


def _config(block_m, block_n, warps, stages, pre_hook=None):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                         pre_hook=pre_hook)


# The autotuner's candidates (BLOCK_M, BLOCK_N, warps, stages), from sweeps on an H100 and an H200. With
# d = 64, 128 x 64 tiles win, in 4 warps (one warpgroup) or 8. With d = 128, 128 x 128 tiles in 8 warps
# and 2 stages won at every sequence length (3 stages of 128-row K and V tiles no longer fit in shared
# memory), so a large GPU tries only that: timing slower candidates for 40 ms each only gives the
# autotuner's noise a chance to pick one. The smaller tiles are for GPUs with less shared memory (a T4
# has 64 KB per block) and for d = 256 (chosen by _prune).
_CANDIDATES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
               (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 1)]
FWD_CONFIGS = [_config(*c, pre_hook=_set_block_shapes) for c in _CANDIDATES]  # v3, v4: descriptors get their tiles
_POINTER_CONFIGS = [_config(*c) for c in _CANDIDATES]                          # v1, v2
# Which candidates a large GPU tries for each head dim (keys of the configs above).
_TRIED = {
    64: {(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)},
    128: {(128, 128, 8, 2)},
}
# The tiles in Triton's interpreter, forward and backward: small, so that small test sizes cross tiles.
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def _key(c: triton.Config) -> tuple:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _smem_bytes(c: triton.Config, head_dim: int, resident: str = "q", resident_tiles: int = 1,
                itemsize: int = 2) -> int:
    """Shared memory a config needs, roughly: the tiles that stay (``resident``: the query side, or the
    key side "kv") once, the K and V (or Q and dO) tiles streaming past num_stages times, and a tile of p.
    The forward keeps one query tile; the backward keeps a pair, K and V or Q and dO."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    stay, stream = (bn, bm) if resident == "kv" else (bm, bn)
    return itemsize * (head_dim * (resident_tiles * stay + 2 * c.num_stages * stream) + bm * bn)


def _smem_bytes_fma(c: triton.Config, head_dim: int, resident: str = "q", resident_tiles: int = 1) -> int:
    """``_smem_bytes`` where Triton lowers tl.dot to scalar FMA (compute capability below 8.0, a T4): no
    pipelining there, so num_stages does not count, but the dots' operands pass through shared memory as
    float32: the tiles that stay, one streaming tile and the tile of p, four bytes a value. An upper bound
    of what Triton 3.6 compiles for sm_75 (tests/test_targets.py compiles the tiles the pruners keep)."""
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    stay, stream = (bn, bm) if resident == "kv" else (bm, bn)
    return 4 * (head_dim * (resident_tiles * stay + stream) + bm * bn)


def _smem_estimate(fma: bool):
    """The shared-memory estimate for a GPU where tl.dot is FMA (``fma``) or runs on tensor cores."""
    return _smem_bytes_fma if fma else _smem_bytes


def _device_properties() -> dict:
    """Triton's properties of the current GPU (``max_shared_mem``: bytes of shared memory per block),
    asked once per GPU (``world.gpu_properties``), and ``fma_dot``: whether Triton makes scalar FMA of
    tl.dot there, which changes what a tile takes in shared memory (``_smem_estimate``)."""
    index = torch.cuda.current_device()
    return {**gpu_properties(index), "fma_dot": _capability_of(index) < (8, 0)}


@functools.cache
def _capability_of(device_index: int) -> tuple[int, int]:
    return device_capability(device_index)  # KC_MAX_CAPABILITY can make an H100 take an A100's paths


def capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of the GPU that holds ``t`` (asked once per GPU), None off a GPU."""
    return _capability_of(t.get_device()) if t.is_cuda else None


def _prune(configs, named_args, **kwargs):
    """The candidates worth timing: on a large GPU, the few chosen for this head dim; on a smaller one
    (or an unusual head dim), those whose tiles fit in its shared memory."""
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    n_q = named_args.get("N_Q", kwargs.get("N_Q"))
    props = _device_properties()
    smem, smem_of = props.get("max_shared_mem", 0) or 1 << 30, _smem_estimate(props.get("fma_dot", False))
    tried = _TRIED.get(d if d > 64 else 64)
    if smem >= 200 * 1024 and tried is not None:
        kept = [c for c in configs if _key(c) in tried]
    else:
        kept = [c for c in configs if smem_of(c, d) <= smem]
    # a 128-row tile for a 40-query sequence computes mostly padding: prefer tiles that fit
    short = [c for c in kept if c.kwargs["BLOCK_M"] <= max(n_q, 64)]
    return short or kept or [min(configs, key=lambda c: smem_of(c, d))]


# ---- autotuning, shared by the forward and backward kernels ----------------------------------------
#
# Each kernel is registered under a name ("v1" ... "v4" here, "dkdv" and "dq" in attention_backward) with
# its candidates, its pruning and its timing. Its autotuner is made on first use; it times the candidates
# once per (N_Q, N_K, HEAD_DIM, CAUSAL, dtype) and keeps the winner.

_TUNING: dict[str, tuple] = {}        # name -> (kernel, configs, prune, bench)
_tuned: dict[str, object] = {}        # name -> its autotuner
_chosen: dict[str, triton.Config] = {}  # name -> the config of its last launch on a GPU


def _tuned_kernel(name: str):
    """The autotuner of kernel ``name``, made the first time it is asked for."""
    if name not in _tuned:
        kernel, configs, prune, bench = _TUNING[name]
        _tuned[name] = triton.autotune(configs, key=["N_Q", "N_K", "HEAD_DIM", "CAUSAL"],
                                       prune_configs_by={"early_config_prune": prune}, do_bench=bench)(kernel)
    return _tuned[name]


def _launch_tuned(name: str, grid, *args, **consts) -> triton.Config:
    """Launch kernel ``name`` through its autotuner; return (and remember) the config it ran with."""
    tuner = _tuned_kernel(name)
    tuner[grid](*args, **consts)
    _chosen[name] = tuner.best_config
    return tuner.best_config


def _describe(c: triton.Config | None) -> str | None:
    if c is None:
        return None
    return f"BLOCK_M={c.kwargs['BLOCK_M']}, BLOCK_N={c.kwargs['BLOCK_N']}, {c.num_warps} warps, {c.num_stages} stages"


def tuned_config(version: int = FINAL) -> str | None:
    """The config of the last GPU launch of ``flash_attention(..., version)`` (or of ``attention``), in words."""
    return _describe(_chosen.get(f"v{version}"))


def _bench_40ms(fn, quantiles):
    # The autotuner times each candidate for ~40 ms (not Triton's default 125): enough to rank them,
    # and it runs again for every new (N_Q, N_K, HEAD_DIM, CAUSAL, dtype).
    return triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=quantiles)


_TUNING.update({f"v{n}": (kernel, FWD_CONFIGS if n in _DESCRIPTORS else _POINTER_CONFIGS, _prune, _bench_40ms)
                for n, kernel in _KERNELS.items()})


# ---- the launcher ----------------------------------------------------------------------------------


def _descriptor_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself if a tensor descriptor can read it (last stride 1, 16-byte aligned start and strides), else
    a contiguous copy."""
    size = t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1]):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _empty_in_layout_of(q: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, N, d) tensor laid out in memory as ``q``: if q's heads sit side by side within
    each row, (B, N, H, d) in memory, as a fused QKV projection leaves them, the output does too, so that
    merging the heads back into rows of the residual stream is a view instead of a copy."""
    B, H, n, d = q.shape
    if H > 1 and n > 1 and q.stride(1) < q.stride(2):
        return torch.empty((B, n, H, d), device=q.device, dtype=q.dtype).transpose(1, 2)
    return torch.empty((B, H, n, d), device=q.device, dtype=q.dtype)


def default_version(capability: tuple[int, int] | None) -> int:
    """The version ``flash_attention`` runs on a GPU of this compute capability (None: the interpreter).

    Before Hopper (9.0) GPUs have no TMA, and Triton would turn v4's tensor-descriptor loads into pointer
    loads that were never tested or tuned there: they get v2, the fastest version that loads through
    pointers.
    """
    return FINAL if capability is None or tuple(capability) >= (9, 0) else 2


def check_dtype(dtype: torch.dtype, capability: tuple[int, int] | None) -> None:
    """Raise a ValueError that says what to do for a dtype this GPU (None: the interpreter) cannot run."""
    if dtype == torch.bfloat16 and capability is not None and tuple(capability) < (8, 0):
        raise ValueError(f"bfloat16 needs a GPU of compute capability 8.0 or newer (Ampere); this one is "
                         f"{capability[0]}.{capability[1]}: use float16 (q, k, v = q.half(), k.half(), v.half())")


def flash_attention(q, k, v, causal: bool = False, sm_scale: float | None = None, config: dict | None = None,
                    version: int | None = None):
    """FlashAttention forward: ``(o, lse)`` for ``q`` (B, H, N_Q, d) and ``k``, ``v`` (B, H_KV, N_K, d).

    ``o`` has ``q``'s shape and dtype; ``lse`` is float32 (B, H, N_Q), natural log. ``d`` is a power of
    two from 16 to 256. ``causal`` masks top-left (query i sees keys j <= i, as SDPA's ``is_causal``).
    Keys and values may have fewer heads than the queries (grouped-query attention): H_KV divides H, and
    query head h reads key head h // (H / H_KV), as if each were repeated H / H_KV times.
    On a GPU the tile sizes are autotuned per (N_Q, N_K, d, causal, dtype) unless ``config`` gives them
    (keys BLOCK_M, BLOCK_N, num_warps, num_stages); in the interpreter they default to 32 x 32.
    ``version`` picks one of chapter 06's versions (``VERSIONS``); by default the final one, v4, or on a
    GPU older than Hopper v2 (see ``default_version``).
    """
    assert q.ndim == k.ndim == v.ndim == 4, "q, k, v are (B, H, N, d)"
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    assert k.shape == v.shape == (B, h_kv, n_k, d) and H % h_kv == 0, "k and v must be (B, H_KV, N_K, d), H_KV | H"
    assert q.dtype == k.dtype == v.dtype, "q, k and v must share one dtype"
    assert d in (16, 32, 64, 128, 256), f"head dim {d}: this kernel takes a power of two from 16 to 256"
    assert n_q >= 1 and n_k >= 1, "no queries, or no keys to attend to"
    check_dtype(q.dtype, capability(q))
    version = default_version(capability(q)) if version is None else version
    assert version in _KERNELS, f"version {version}: chapter 06's versions are {sorted(_KERNELS)}"
    lse = torch.empty((B, H, n_q), device=q.device, dtype=torch.float32)
    scale = _scale(q, sm_scale)
    consts = {"HEAD_DIM": d, "CAUSAL": causal, "KV_GROUP": H // h_kv}
    if version in _DESCRIPTORS:
        q, k, v = (_descriptor_ready(t) for t in (q, k, v))
        o = _empty_in_layout_of(q)
        # block shapes are placeholders until _set_block_shapes gives each descriptor its config's tile
        tensors = {name: TensorDescriptor.from_tensor(t, [1, 1, 16, d])
                   for name, t in (("q_desc", q), ("k_desc", k), ("v_desc", v), ("o_desc", o))}
        args = (*tensors.values(), lse, scale * LOG2E.value, H, n_q, n_k)
    else:
        q, k, v = (t.contiguous() for t in (q, k, v))  # (B·H, N, d) rows, as the pointer kernels index them
        o = torch.empty_like(q)
        args = (q, k, v, o, lse, scale if version == 1 else scale * LOG2E.value, n_q, n_k)
    if config is None and world().gpu:
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
        _launch_tuned(f"v{version}", grid, *args, **consts)  # each config's pre-hook sets the shapes
    else:
        cfg = {**INTERPRETER_CONFIG, **(config or {})}
        if version in _DESCRIPTORS:
            _set_block_shapes({**tensors, **cfg, "HEAD_DIM": d})
        grid = (triton.cdiv(n_q, cfg["BLOCK_M"]), B * H)
        _KERNELS[version][grid](*args, **consts, **cfg)
    return o, lse


# ---- the lean launcher -----------------------------------------------------------------------------
#
# What ``kernelcourse.attention_backward.attention`` runs. ``flash_attention`` above is written to be read,
# and pays for it at every call: it checks its input, asks which GPU it is on, builds its descriptors with
# placeholder tiles that a pre-hook reshapes, and goes through the autotuner, which rebuilds its dict of
# arguments. For a short sequence that host work takes longer than the kernel. Here everything that depends
# only on the shapes is worked out the first time a shape key is seen (that launch goes through the
# autotuner) and kept: the version, the grid, the config. A test checks the two launchers agree.

_plans: dict[tuple, tuple] = {}   # shape key -> (version, kernel, grid, keyword arguments, the tuned config)


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """The output tensor of the forward: laid out as q (``_empty_in_layout_of``), whichever version runs.
    Also what the operator's fake implementation returns, so it must not look at data, nor ask which
    version this GPU runs: torch.compile asserts the real output's strides against the fake's, and reuses
    a graph compiled on disk under another KC_MAX_CAPABILITY (its cache key has the GPU's own capability)."""
    return _empty_in_layout_of(q)


_DESCRIPTOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                        if f.default is not dataclasses.MISSING}


def _descriptor(t: torch.Tensor, rows: int, d: int) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t, [1, 1, rows, d])`` without its checks of alignment and shape, which
    ``_descriptor_ready`` (or a fresh allocation) and ``check_inputs`` already made."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESCRIPTOR_DEFAULTS, base=t, shape=t.shape, strides=t.stride(), block_shape=[1, 1, rows, d])
    return desc


def _forward(q, k, v, causal: bool, scale: float):
    """``flash_attention(q, k, v, causal, scale)`` for inputs already checked (``check_inputs``), with the
    launch of each shape worked out once: the forward of the ``kernelcourse::attention_fwd`` operator."""
    B, H, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    key = ("fwd", q.dtype, q.get_device(), B, H, h_kv, n_q, n_k, d, causal)
    plan = _plans.get(key)
    version = default_version(capability(q)) if plan is None else plan[0]
    o = _new_output(q)                            # laid out as q, as the fake says, whichever version runs
    lse = torch.empty((B, H, n_q), device=q.device, dtype=torch.float32)
    if version in _DESCRIPTORS:
        q, k, v = _descriptor_ready(q), _descriptor_ready(k), _descriptor_ready(v)
        bm, bn = (plan[3]["BLOCK_M"], plan[3]["BLOCK_N"]) if plan else (16, 16)  # first call: the pre-hook's
        rows = o                                  # a descriptor writes o in its own layout
        args = (_descriptor(q, bm, d), _descriptor(k, bn, d), _descriptor(v, bn, d), _descriptor(o, bm, d),
                lse, scale * LOG2E.value, H, n_q, n_k)
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # the pointer kernels write contiguous (B·H, N, d) rows: into o where it is laid out so, else into a
        # buffer copied into o after the launch (q then came as heads of a fused projection, copied too)
        rows = o if o.is_contiguous() else torch.empty(q.shape, device=q.device, dtype=q.dtype)
        args = (q, k, v, rows, lse, scale if version == 1 else scale * LOG2E.value, n_q, n_k)
    if plan is not None:
        # the plan fixes every integer and constexpr; the pointers' alignment is all that can still vary
        direct(plan[1], key + specialization(q, k, v), plan[2], args, plan[3])
        if plan[4] is not None:
            _chosen[f"v{version}"] = plan[4]      # what tuned_config() reports
    else:
        consts = {"HEAD_DIM": d, "CAUSAL": causal, "KV_GROUP": H // h_kv}
        if world().gpu:
            c = _launch_tuned(f"v{version}", lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H), *args,
                              **consts)
            cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        else:
            cfg = dict(INTERPRETER_CONFIG)
            if version in _DESCRIPTORS:
                _set_block_shapes({"q_desc": args[0], "k_desc": args[1], "v_desc": args[2], "o_desc": args[3],
                                   **cfg, "HEAD_DIM": d})
            _KERNELS[version][(triton.cdiv(n_q, cfg["BLOCK_M"]), B * H)](*args, **consts, **cfg)
        _plans[key] = (version, _KERNELS[version], (triton.cdiv(n_q, cfg["BLOCK_M"]), B * H), {**consts, **cfg},
                       c if world().gpu else None)
    if rows is not o:
        o.copy_(rows)
    return o, lse


# ---- the checks of the public entry -------------------------------------------------------------------


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q, k, v, causal=False, sm_scale=None) -> None:
    """Raise a ``ValueError`` that says what is wrong with the input of ``attention``, if anything.

    ``q`` (B, H, N_Q, d) and ``k``, ``v`` (B, H_KV, N_K, d) with H_KV dividing H, one floating dtype, on the
    device the course runs on (``kc.world().device``); ``d`` a power of two from 16 to 256; ``causal`` a bool
    (the only mask there is, top-left); ``sm_scale`` None or a finite number > 0.
    """
    w = world()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if len(t.shape) != 4:
            raise ValueError(f"{name} must be 4-dimensional (B, H, N, d), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}: attention takes float16, bfloat16 or float32")
        if t.is_cuda != w.gpu:
            raise ValueError(f"{name} is on {t.device}, but the kernels run on {w.device} here (kc.world().device): "
                             f"move the tensors there, e.g. {name}.to('{w.device}')")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if q.dtype == torch.bfloat16 and not w.gpu:
        raise ValueError("bfloat16 does not run in Triton's interpreter (no GPU here): use float32 or float16")
    B, H, n_q, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    h_kv = k.shape[1]
    if k.shape[0] != B or k.shape[3] != d or h_kv == 0 or H % h_kv != 0:
        raise ValueError(f"k and v must be (B, H_KV, N_K, d) with q's B={B} and d={d}, and H_KV dividing q's "
                         f"H={H} (grouped-query attention); got {tuple(k.shape)}")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head dim d={d} is not supported: use a power of two from 16 to 256")
    if n_q == 0 or k.shape[2] == 0 or B == 0 or H == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if not isinstance(causal, (bool, int)) or isinstance(causal, torch.Tensor):
        raise ValueError(f"causal must be True or False, got {type(causal).__name__}: attention supports no "
                         f"other mask than the causal one (top-left aligned, query i sees keys j <= i)")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite number or None, got {sm_scale!r}")
    if sm_scale is not None and sm_scale <= 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale!r}: the kernels take each row's maximum score "
                         f"before scaling it, which is the maximum after only for a positive scale")
    check_dtype(q.dtype, w.capability)  # the GPU q is on (a cached lookup Dynamo need not trace)
