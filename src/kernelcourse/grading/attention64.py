"""Attention of one head in float64, exactly and with the typical bugs, forward (chapter 06) and
backward (chapter 07): the graders' truth, and the wrong results a learner's mistakes give, which
``harness.diagnose`` compares a wrong answer with to name the mistake.
"""
from __future__ import annotations

import numpy as np


def attention64(q, k, v, scale, causal=False, keep=None, fill=-np.inf):
    """Float64 attention of one head: q (R, d), k and v (N, d) -> (o (R, d), lse (R,)).

    ``causal`` keeps key j for query i when j <= i (top-left); ``keep`` is any (R, N) boolean mask
    instead, and ``fill`` what the masked scores become (a wrong answer may use 0). A row with no key
    left gives NaN, as 0 / 0 does in a learner's code.
    """
    s = (q @ k.T) * scale
    if causal:
        keep = np.tril(np.ones(s.shape, dtype=bool))
    if keep is not None:
        s = np.where(keep, s, fill)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return (p @ v) / l, (m + np.log(l))[:, 0]


def tiled64(q, k, v, scale, block_n, bug=None):
    """Tiled attention of one head in float64, the way a kernel does it, optionally with a typical
    bug: "no_rescale_acc", "no_rescale_l", "no_rescale", "inverted_rescale", "tail_as_zero" (keys
    past N padded with zeros and not masked), "no_normalise", "last_tile_missing", "max_from_zero" (the
    running max started at 0, not -inf). Returns (o, lse)."""
    n, d = k.shape
    rows = q.shape[0]
    m = np.zeros(rows) if bug == "max_from_zero" else np.full(rows, -np.inf)
    l = np.zeros(rows)
    acc = np.zeros((rows, v.shape[1]))
    if bug == "tail_as_zero" and n % block_n:
        pad = block_n - n % block_n
        k = np.concatenate([k, np.zeros((pad, d))])
        v = np.concatenate([v, np.zeros((pad, v.shape[1]))])
        n = k.shape[0]
    stop = (n // block_n) * block_n if bug == "last_tile_missing" else n
    for n0 in range(0, stop, block_n):
        s = (q @ k[n0:n0 + block_n].T) * scale
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)
        if bug == "inverted_rescale":
            alpha = np.where(np.isfinite(m), np.exp(m_new - m), 0.0)
        p = np.exp(s - m_new[:, None])
        a_l = 1.0 if bug in ("no_rescale_l", "no_rescale") else alpha
        a_acc = 1.0 if bug in ("no_rescale_acc", "no_rescale") else alpha
        l = a_l * l + p.sum(axis=1)
        acc = (a_acc * acc.T).T + p @ v[n0:n0 + block_n]
        m = m_new
    o = acc if bug == "no_normalise" else acc / l[:, None]
    return o, m + np.log(l)


def causal_from_zero(q, k, v, scale):
    """Causal attention whose running max starts at 0: rows whose scores are all far below 0 give NaN."""
    o, lse = attention64(q, k, v, scale, causal=True)
    s = np.where(np.tril(np.ones((q.shape[0], k.shape[0]), dtype=bool)), q @ k.T * scale, -np.inf)
    dead = np.exp(s).sum(axis=1) == 0  # exp(s - 0) underflows for every key of the row
    o, lse = o.copy(), lse.copy()
    o[dead], lse[dead] = np.nan, -np.inf
    return o, lse


def grads64(q, k, v, do, scale, causal=False, bug=None):
    """Float64 gradients of one head, q (R, d), k and v (N, d), do (R, d) -> (dq, dk, dv, extras),
    optionally with a typical bug: "no_delta" (dS = P ∘ dP), "delta_from_dp" (D = rowsum(dP)),
    "no_p" (dS = dP - D), "no_scale" (dQ, dK without sm_scale), "scale_twice", "fill_zero" (masked
    scores set to 0, not -inf), "no_mask" (causal ignored)."""
    s = (q @ k.T) * scale
    if causal and bug != "no_mask":
        keep = np.tril(np.ones(s.shape, dtype=bool))
        s = np.where(keep, s, 0.0 if bug == "fill_zero" else -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    p = p / l
    o = p @ v
    dv = p.T @ do
    dp = do @ v.T
    delta = dp.sum(axis=1) if bug == "delta_from_dp" else (do * o).sum(axis=1)
    if bug == "no_delta":
        ds = p * dp
    elif bug == "no_p":
        ds = dp - delta[:, None]
    else:
        ds = p * (dp - delta[:, None])
    c = {"no_scale": 1.0, "scale_twice": scale * scale}.get(bug, scale)
    dq, dk = ds @ k * c, ds.T @ q * c
    return dq, dk, dv, {"o": o, "lse": (m + np.log(l))[:, 0], "p": p, "dp": dp, "delta": (do * o).sum(axis=1)}


def unmasked_grads64(q, k, v, do, scale):
    """The gradients a backward computes when it forgets the causal mask of a causal forward: P = exp(S - lse)
    with the causal lse and D, but over every key."""
    *_, x = grads64(q, k, v, do, scale, causal=True)
    p = np.exp(q @ k.T * scale - x["lse"][:, None])
    ds = p * (do @ v.T - x["delta"][:, None])
    return ds @ k * scale, ds.T @ q * scale, p.T @ do
