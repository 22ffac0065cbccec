"""Graders for chapter 07, the FlashAttention backward: dS from P, the row sums D, the backward of
one head, a tiled backward, the dK/dV kernel's inner loop, the query tiles a key tile needs under a
causal mask, and the autograd Function.

The PyTorch exercises run on CPU tensors in any world; the Triton exercise launches the learner's
kernel (in Triton's interpreter on the CPU, compiled on a GPU) on inputs framed by NaN, so a load past
``N_Q`` shows, and outputs framed by poison. Results are compared with float64 gradients, with a
tolerance of twice PyTorch's own error at the same precision (and a floor of a few rounding steps).
When a result is wrong, the grader recomputes the typical mistakes in float64 (D left out, D summed
from dP alone, P left out of dS, the scale forgotten, the lse in the wrong base...) and names the
one that matches. On a GPU the dK/dV kernel is also timed against PyTorch's SDPA backward.
"""
from __future__ import annotations

import math

import numpy as np

from ..world import world
from . import POISON, Report, as_tuple, compare, exercise, fresh_rng, guarded, speed_vs_peer
from .harness import largest_made, not_a_kernel, to_numpy  # shared by the Triton graders
from .attention64 import grads64, unmasked_grads64
from .harness import HALF_POISON, LOG2E, NAN, compare_returned, diagnose, exact_f32, explain, framed, rand, reproduces


# ---- helpers: the harness's, under the names this module's graders use -------------------------


def _exact32(x) -> np.ndarray:
    return exact_f32(x)


def _rand(rng, shape, scale=1.0) -> np.ndarray:
    return exact_f32(rand(rng, shape, (scale,)))


def _check(got, truth, reference, what: str, floor: float) -> tuple[bool, str]:
    return compare_returned(got, truth, reference, what, floor)


def _matches(got, wrong, truth) -> bool:
    """Does ``got`` reproduce the mistake ``wrong``? (the harness's one diagnosis rule)"""
    return reproduces(got, wrong, truth) is not None


def _diagnose(got, mistakes, truth) -> str | None:
    """The first listed mistake that ``got`` reproduces: 07's lists put the likelier of two mistakes that
    can give nearly the same result first."""
    return diagnose(got, mistakes, truth=truth, first=True)


def _fail(report: Report, line: str, hint: str | None) -> None:
    report.fail(line, hint)


def _torch_grads(q, k, v, do, scale, causal, dtype=None, device="cpu"):
    """PyTorch's gradients of one head at the inputs' precision: autograd through the naive attention."""
    import torch

    dt = dtype or torch.float32
    tq, tk, tv = (torch.tensor(a, dtype=dt, device=device, requires_grad=True) for a in (q, k, v))
    s = (tq @ tk.T) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape, dtype=torch.bool, device=device).tril(), float("-inf"))
    (torch.softmax(s, dim=-1) @ tv).backward(torch.tensor(do, dtype=dt, device=device))
    return [to_numpy(t.grad.float()).astype(np.float64) for t in (tq, tk, tv)]


def _floor(q, k, scale, dtype_eps):
    """The smallest relative tolerance: 64 rounding steps, or in float32 the rounding of the exponent
    s - lse that a backward recomputing P makes, about eps · max|s| (1e-4 for scores of ±1000)."""
    s_max = float(np.max(np.abs(q @ k.T))) * scale
    return max(64 * dtype_eps, 4 * dtype_eps * max(16.0, s_max))




def _head(rng, n_q, n_k, d, logit_scale):
    """q, k, v, do of one head (float64 holding float32 values), scores of about ±3·logit_scale."""
    q = _exact32(_rand(rng, (n_q, d)) * math.sqrt(logit_scale))
    k = _exact32(_rand(rng, (n_k, d)) * math.sqrt(logit_scale))
    return q, k, _rand(rng, (n_k, d)), _rand(rng, (n_q, d))


# ---- 07.1 dS from P and dP ------------------------------------------------------------------------


@exercise("07.1", "the softmax's backward: dS from P and dP", names=("softmax_backward",), time_limit_s=60)
def grade_softmax_backward(report: Report, softmax_backward):
    import torch

    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    for i, (rows, n, spread) in enumerate([(4, 7, 1.0), (6, 33, 10.0), (3, 100, 300.0), (1, 1, 1.0), (5, 64, 3.0)]):
        s = _rand(rng, (rows, n), spread)
        p = _exact32(np.exp(s - s.max(axis=1, keepdims=True)) / np.exp(s - s.max(axis=1, keepdims=True)).sum(1, keepdims=True))
        dp = _rand(rng, (rows, n), 2.0)
        truth = p * (dp - (p * dp).sum(axis=1, keepdims=True))
        tp, tdp = torch.tensor(p, dtype=torch.float32), torch.tensor(dp, dtype=torch.float32)
        ref = to_numpy(tp * (tdp - (tp * tdp).sum(dim=1, keepdim=True))).astype(np.float64)
        what = f"{rows} rows of {n} probabilities" + (" (scores of ±1000: most are 0)" if spread > 100 else "")
        before = report.failures
        got = guarded(report, what, softmax_backward, tp.clone(), tdp.clone())
        if report.failures > before:
            return
        if got is None:
            return report.fail("softmax_backward returned None: did you forget `return`?")
        # dS = P ∘ (dP − D) cancels where P is one-hot: a few rounding steps of the terms P ∘ dP that cancel
        terms = float(np.max(np.abs(p * dp))) / max(float(np.max(np.abs(truth))), 1e-300)
        ok, line = _check(got, truth, ref, what, floor=8 * 1.2e-7 * max(1.0, terms))
        if not ok:
            mistakes = [
                ("softmax couples each row: dS = P ∘ (dP − D), with D = rowsum(P ∘ dP) subtracted from every dP of "
                 "the row; P ∘ dP alone is the backward of an elementwise exp", p * dp),
                ("D is the row sum of P ∘ dP, not of dP alone", p * (dp - dp.sum(axis=1, keepdims=True))),
                ("D is the row sum of P ∘ dP, not the mean of dP", p * (dp - dp.mean(axis=1, keepdims=True))),
                ("multiply by P: dS = P ∘ (dP − D)", dp - (p * dp).sum(axis=1, keepdims=True)),
                ("D sums over each row (dim=-1, keepdim=True), one number per row", p * (dp - (p * dp).sum(axis=0, keepdims=True))),
                ("the Jacobian of softmax is diag(P) − P Pᵀ: the diagonal alone, P(1 − P) ∘ dP, leaves out how each "
                 "probability moves when the others do", p * (1 - p) * dp),
            ]
            return _fail(report, line, _diagnose(got, mistakes, truth))
        report.ok(line)


# ---- 07.2 D, from P and dP or from O and dO ---------------------------------------------------


@exercise("07.2", "D = rowsum(P ∘ dP) = rowsum(dO ∘ O)", names=("delta_from_probs", "delta"), time_limit_s=60)
def grade_delta(report: Report, delta_from_probs, delta):
    import torch

    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    # the last case has many more queries than head dims: an N_Q × N_Q intermediate there is far larger than
    # any input, and the grader records the shape of every tensor delta() makes
    for i, (n_q, n_k, d, ls) in enumerate([(5, 9, 4, 1.0), (16, 40, 16, 10.0), (7, 3, 8, 300.0), (1, 20, 8, 1.0),
                                           (int(rng.integers(200, 320)), 24, 8, 1.0)]):
        q, k, v, do = _head(rng, n_q, n_k, d, ls)
        *_, x = grads64(q, k, v, do, 1 / math.sqrt(d))
        p, dp, o = _exact32(x["p"]), _exact32(x["dp"]), _exact32(x["o"])
        what = f"N_Q={n_q}, N_K={n_k}, d={d}" + (", scores of ±1000" if ls > 100 else "")
        t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        # from P and dP
        truth = (p * dp).sum(axis=1)
        before = report.failures
        got = guarded(report, f"delta_from_probs, {what}", delta_from_probs, t(p), t(dp))
        if report.failures > before:
            return
        ref = to_numpy((t(p) * t(dp)).sum(dim=1)).astype(np.float64)
        ok, line = _check(got, truth, ref, f"delta_from_probs, {what}", floor=16 * 1.2e-7)
        if not ok:
            mistakes = [("D = rowsum(P ∘ dP): multiply by P before summing", dp.sum(axis=1)),
                        ("D has one value per query row: sum over the keys, dim=-1", (p * dp).sum(axis=0)
                         if n_q == n_k else None),
                        ("D = Σ_j P_ij dP_ij, a sum of products, not a product of sums", p.sum(1) * dp.sum(1))]
            return _fail(report, line, _diagnose(got, mistakes, truth))
        # from O and dO: the same numbers, without P
        truth = (do * o).sum(axis=1)
        made = guarded(report, f"delta, {what}", largest_made, delta, t(o), t(do))
        if report.failures > before:
            return
        got, numel, shape = made
        if got is not None and tuple(np.shape(to_numpy(got))) == (n_q, n_q):
            return report.fail(f"delta, {what}: returned a ({n_q}, {n_q}) matrix: D is one number per row, "
                               "rowsum(dO ∘ O), the diagonal of dO Oᵀ without computing the rest")
        if n_q > d and numel >= n_q * n_q:
            return report.fail(f"delta, {what}: a tensor of shape {shape} was made, as large as the N_Q × N_Q "
                               "product dO Oᵀ: D is only its diagonal, rowsum(dO ∘ O), which needs no N_Q × N_Q "
                               "intermediate (torch.diag(do @ o.T) computes all of it to keep N_Q numbers)")
        ref = to_numpy((t(o) * t(do)).sum(dim=1)).astype(np.float64)
        ok, line = _check(got, truth, ref, f"delta, {what}", floor=16 * 1.2e-7)
        if not ok:
            mistakes = [("D has one value per query row: sum over the head dim, dim=-1", (do * o).sum(axis=0)
                         if n_q == d else None),
                        ("D = Σ_c dO_ic O_ic, a sum of products, not a product of sums", do.sum(1) * o.sum(1))]
            return _fail(report, line, _diagnose(got, mistakes, truth))
        report.ok(f"{what}: both give D (max error {float(np.max(np.abs(to_numpy(got) - truth))):.1g})")


# ---- 07.3 the backward of one head, on whole matrices ---------------------------------------


_BUG_HINTS = [
    ("no_delta", "dS = P ∘ (dP − D): subtract D = rowsum(dO ∘ O) from each row of dP"),
    ("delta_from_dp", "D is rowsum(dO ∘ O) (or rowsum(P ∘ dP)), not the row sum of dP"),
    ("no_p", "dS = P ∘ (dP − D): multiply by P"),
    ("no_scale", "S = sm_scale · QKᵀ, so dQ = sm_scale · dS K and dK = sm_scale · dSᵀ Q: the scale is missing"),
    ("scale_twice", "sm_scale appears once in dQ = sm_scale · dS K (and in dK): it is applied twice"),
]
_MASK_HINTS = [
    ("fill_zero", "masked scores must be -inf, so that P is 0 there; a score of 0 still gets probability"),
    ("no_mask", "with causal=True query i sees only keys j <= i: mask S before the softmax"),
]
# causal masks with the diagonal in the wrong place: which keys (j) each query (i) keeps
_DIAGONAL_HINTS = [
    (lambda i, j, n_q, n_k: j < i,
     "query i sees key j when j <= i: each query sees its own key, so the mask hides j > i only (tril(), or "
     "triu(diagonal=1) for the masked part), not the diagonal too"),
    (lambda i, j, n_q, n_k: j <= i + (n_k - n_q),
     "with causal=True query i sees keys j <= i counted from the top-left corner, whatever N_Q and N_K are "
     "(query 0 sees key 0); a mask aligned to the bottom-right corner, j <= i + N_K − N_Q, is another convention"),
]


def _keeps(n_q, n_k, rule):
    return rule(np.arange(n_q)[:, None], np.arange(n_k)[None, :], n_q, n_k)


def _grads_keeping(q, k, v, do, scale, keep):
    """Float64 gradients of one head whose softmax sees the keys ``keep`` marks; a row that sees none gives NaN,
    as PyTorch's softmax of a row of -inf does."""
    s = np.where(keep, q @ k.T * scale, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    ds = p * (do @ v.T - (do * (p @ v)).sum(axis=1, keepdims=True))
    return ds @ k * scale, ds.T @ q * scale, p.T @ do


def _grads_mistakes(q, k, v, do, scale, causal, which: int):
    bugs = _BUG_HINTS + (_MASK_HINTS if causal else [])
    found = [(hint, grads64(q, k, v, do, scale, causal, bug)[which]) for bug, hint in bugs]
    if causal:
        found += [(hint, _grads_keeping(q, k, v, do, scale, _keeps(len(q), len(k), rule))[which])
                  for rule, hint in _DIAGONAL_HINTS]
    return found


def _check_grads(report, got, q, k, v, do, scale, causal, what, floor, ref=None) -> bool:
    names = ("dq", "dk", "dv")
    truth = grads64(q, k, v, do, scale, causal)[:3]
    ref = ref or _torch_grads(q, k, v, do, scale, causal)
    # dS = P ∘ (dP − D) cancels where a row of P is one-hot (scores of ±1000), and so does every float32
    # backward: allow a few rounding steps of the terms that cancel, |dP| · |K| · sm_scale (for dK, summed
    # over the queries that see a key)
    p, dp = grads64(q, k, v, do, scale, causal)[3]["p"], np.abs(do) @ np.abs(v).T
    cancel = [16 * 1.2e-7 * float(np.max(dp)) * float(np.max(np.abs(k))) * scale,
              16 * 1.2e-7 * float(np.max(dp)) * float(np.max(np.abs(q))) * scale * float(np.max(p.sum(axis=0))), 0.0]
    for i, name in enumerate(names):
        rel = cancel[i] / max(float(np.max(np.abs(truth[i]))), 1e-300) if truth[i].size else 0.0
        ok, line = _check(got[i], truth[i], ref[i], f"{name}, {what}", max(floor, rel))
        if not ok:
            hint = _diagnose(got[i], _grads_mistakes(q, k, v, do, scale, causal, i), truth[i])
            if hint is None and name == "dv" and _matches(got[i], grads64(q, k, v, do, scale, causal)[3]["p"].T @ do * scale, truth[i]):
                hint = "dV = Pᵀ dO: no sm_scale in it (V is not scaled in the forward)"
            _fail(report, line, hint)
            return False
    return True


@exercise("07.3", "the backward of one head", names=("attention_backward",), time_limit_s=60)
def grade_attention_backward(report: Report, attention_backward):
    import torch

    cases = [(8, 8, 4, False, 1.0), (13, 29, 16, False, 3.0), (29, 13, 8, False, 1.0), (16, 40, 16, False, 300.0),
             (20, 20, 8, True, 1.0), (12, 30, 16, True, 3.0), (30, 12, 8, True, 1.0), (1, 9, 4, False, 1.0)]
    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    for i, (n_q, n_k, d, causal, ls) in enumerate(cases):
        q, k, v, do = _head(rng, n_q, n_k, d, ls)
        scale = 1 / math.sqrt(d)
        what = f"N_Q={n_q}, N_K={n_k}, d={d}{', causal' if causal else ''}{', scores of ±1000' if ls > 100 else ''}"
        t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        before = report.failures
        got = guarded(report, what, attention_backward, t(q), t(k), t(v), t(do), causal)
        if report.failures > before:
            return
        got = as_tuple(report, f"attention_backward ({what})", got, 3)
        if got is None:
            return
        if not _check_grads(report, got, q, k, v, do, scale, causal, what, _floor(q, k, scale, 1.2e-7)):
            return
        report.ok(f"{what}: dq, dk, dv match")


# ---- 07.4 a tiled backward in PyTorch ------------------------------------------------------------


@exercise("07.4", "a tiled backward in PyTorch", names=("tiled_attention_backward",), time_limit_s=90)
def grade_tiled_backward(report: Report, tiled_attention_backward):
    import torch

    # (N_Q, N_K, d, block_m, block_n, causal, logit scale): ragged tails, N_Q ≠ N_K, scores of ±1000
    cases = [(32, 32, 8, 16, 16, False, 1.0), (37, 70, 16, 16, 32, False, 3.0), (70, 37, 8, 32, 16, False, 1.0),
             (40, 50, 16, 16, 16, False, 300.0), (48, 48, 8, 16, 16, True, 1.0), (45, 70, 8, 16, 32, True, 3.0),
             (70, 45, 16, 32, 16, True, 1.0), (1, 23, 8, 16, 8, False, 1.0)]
    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    for i, (n_q, n_k, d, bm, bn, causal, ls) in enumerate(cases):
        q, k, v, do = _head(rng, n_q, n_k, d, ls)
        scale = 1 / math.sqrt(d)
        *_, x = grads64(q, k, v, do, scale, causal)
        o, lse = _exact32(x["o"]), _exact32(x["lse"])
        what = (f"N_Q={n_q}, N_K={n_k}, d={d}, block_m={bm}, block_n={bn}{', causal' if causal else ''}"
                f"{', scores of ±1000' if ls > 100 else ''}")
        t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        before = report.failures
        got = guarded(report, what, largest_made, tiled_attention_backward, t(q), t(k), t(v), t(o), t(lse), t(do),
                      bm, bn, causal)
        if report.failures > before:
            return
        got, numel, shape = got
        got = as_tuple(report, f"tiled_attention_backward ({what})", got, 3)
        if got is None:
            return
        truth = grads64(q, k, v, do, scale, causal)[:3]
        # a tile's P from exp(S - lse) in float32, against P from the exact softmax: no further normalisation
        s = q @ k.T * scale
        p_nolse = np.exp(s - s.max(axis=1, keepdims=True)) if not causal else None
        if p_nolse is not None:
            def lse_of(block):
                mb = block.max(axis=1, keepdims=True)
                return mb + np.log(np.exp(block - mb).sum(axis=1, keepdims=True))

            own = np.concatenate([np.exp(s[:, j:j + bn] - lse_of(s[:, j:j + bn])) for j in range(0, n_k, bn)], axis=1)
            tile_lse = [p_nolse.T @ do,                         # exp(S - max), not divided by the row sum
                        own.T @ do,                             # each key tile normalised by its own sum
                        np.exp(s - lse_of(s[:, :bn])).T @ do]   # the lse of the first key tile only
            if any(_matches(got[2], dv_wrong, truth[2]) for dv_wrong in tile_lse):
                return report.fail(f"dv, {what}: P = exp(S − lse) with the saved lse, which holds the max and the "
                                   "row sum: a tile's own max or sum is not the row's")
        if causal:  # P = exp(S - lse) left unmasked: the lse leaves the masked keys out, exp(S - lse) does not
            unmasked = unmasked_grads64(q, k, v, do, scale)
            if any(_matches(g, u, t) for g, u, t in zip(got, unmasked, truth)):
                return report.fail(f"{what}: the gradients include keys after their query: with causal=True, set P to "
                                   "0 where key j > query i (the lse leaves those keys out, but exp(S − lse) does not)")
        # the last, shorter tile left out (range(0, N - block + 1, block)), or the diagonal in the wrong place
        seen = np.tril(np.ones((n_q, n_k), dtype=bool)) if causal else np.ones((n_q, n_k), dtype=bool)
        i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
        k_tail, q_tail = j < n_k - n_k % bn, i < n_q - n_q % bm
        tails = (f"the last key tile is shorter (N_K={n_k} is no multiple of block_n={bn}) and its keys got no "
                 f"gradient", f"the last query tile is shorter (N_Q={n_q} is no multiple of block_m={bm}) and its "
                 f"queries got no gradient")
        slips = [(seen & k_tail, tails[0]), (seen & q_tail, tails[1]), (seen & k_tail & q_tail, " and ".join(tails))]
        slips = [(keep, hint + ": loop with range(0, N, block); a slice [n0:n0 + block] stops at N by itself")
                 for keep, hint in slips if not keep.all() and (keep != seen).any()]
        if causal:
            slips += [(_keeps(n_q, n_k, rule), hint) for rule, hint in _DIAGONAL_HINTS]
        for keep, hint in slips:
            p_slip = np.where(keep, np.exp(q @ k.T * scale - x["lse"][:, None]), 0.0)
            ds_slip = p_slip * (do @ v.T - x["delta"][:, None])
            wrong = (ds_slip @ k * scale, ds_slip.T @ q * scale, p_slip.T @ do)
            if any(_matches(g, w, t) for g, w, t in zip(got, wrong, truth)):
                return report.fail(f"{what}: {hint}")
        # the tolerance's reference: the same recomputation, P = exp(S − lse) from the float32 lse, done by
        # PyTorch in float32 (scores of ±1000 cost it about eps · max|s|, more than the naive softmax's error)
        tq, tk, tv, tdo, tl = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v, do, lse))
        p32 = torch.exp(tq @ tk.T * scale - tl[:, None])
        if causal:
            p32 = p32.masked_fill(~torch.ones_like(p32, dtype=torch.bool).tril(), 0.0)
        ds32 = p32 * (tdo @ tv.T - (tdo * torch.tensor(o, dtype=torch.float32)).sum(-1, keepdim=True))
        ref = [to_numpy(r).astype(np.float64) for r in (ds32 @ tk * scale, ds32.T @ tq * scale, p32.T @ tdo)]
        ref = [r if np.max(np.abs(r - t)) > np.max(np.abs(n - t)) else n
               for r, n, t in zip(ref, _torch_grads(q, k, v, do, scale, causal), truth)]
        if not _check_grads(report, got, q, k, v, do, scale, causal, what, _floor(q, k, scale, 1.2e-7), ref):
            return
        if n_q * n_k > max(n_q, n_k) * max(bm, bn, d) and numel >= n_q * n_k:
            return report.fail(f"{what}: a tensor of shape {shape} was made: as large as the whole N_Q × N_K "
                               f"matrix ({n_q} × {n_k}); work on block_m × block_n tiles only")
        report.ok(f"{what}: dq, dk, dv match; largest tensor made {shape}")


# ---- 07.5 the dK/dV kernel's inner loop ------------------------------------------------------


def _dkdv_launch(kernel, heads, n_q, n_k, d, bm, bn, tensors, scale, **meta):
    tq, tk, tv, tdo, tlse, tdelta, tdk, tdv = tensors
    grid = (-(-n_k // bn), heads)
    return kernel[grid](tq, tk, tv, tdo, tlse, tdelta, tdk, tdv, scale, tq.stride(0), tk.stride(0), tlse.stride(0),
                        n_q, n_k, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, **meta)


@exercise("07.5", "the dK/dV kernel's inner loop in Triton", names=("attention_dkdv_kernel",), time_limit_s=240)
def grade_dkdv_kernel(report: Report, attention_dkdv_kernel):
    import torch

    if (msg := not_a_kernel(attention_dkdv_kernel, "attention_dkdv_kernel")):
        return report.fail(msg)
    gpu = world().gpu
    dev = world().device
    # (heads, N_Q, N_K, d, BLOCK_M, BLOCK_N, dtype, logit scale)
    cases = [(2, 32, 32, 16, 16, 16, "fp32", 1.0), (2, 37, 50, 16, 16, 16, "fp32", 1.0),
             (1, 45, 29, 32, 16, 32, "fp32", 300.0), (2, 50, 40, 16, 32, 16, "fp16", 1.0),
             (1, 9, 20, 16, 16, 16, "fp32", 1.0)]
    if gpu:  # tl.dot on float32 is TF32 on a GPU: grade in half precision there, with larger sizes
        cases = [(h, nq, nk, d, bm, bn, "fp16", ls) for h, nq, nk, d, bm, bn, _, ls in cases]
        cases += [(4, 300, 1000, 64, 32, 64, "fp16", 30.0), (2, 1000, 257, 128, 16, 32, "fp16", 1.0)]
        if world().has_bf16:  # not torch.cuda.is_bf16_supported: True on a T4 (emulated)
            cases.append((2, 200, 300, 64, 32, 64, "bf16", 30.0))
    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    for i, (heads, n_q, n_k, d, bm, bn, dtype, ls) in enumerate(cases):
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        heads_in = [_head(rng, n_q, n_k, d, ls) for _ in range(heads)]
        # what the kernel is given, rounded to its dtype: the truth is computed from exactly these
        rnd = lambda a: to_numpy(torch.from_numpy(a).to(dt).float()).astype(np.float64)  # noqa: E731
        q, k, v, do = (np.stack([rnd(h[j]) for h in heads_in]) for j in range(4))
        # sm_scale drawn on every run, 15-50% away from 1/sqrt(d): a kernel that writes its own scale in fails
        scale = float(rng.uniform(1.15, 1.5) ** rng.choice([-1, 1])) / math.sqrt(d)
        stats = [grads64(q[h], k[h], v[h], do[h], scale)[3] for h in range(heads)]
        o = np.stack([rnd(s["o"]) for s in stats])                  # the forward's output, in the dtype
        lse = np.stack([_exact32(s["lse"]) for s in stats])
        delta = np.stack([_exact32((do[h] * o[h]).sum(axis=1)) for h in range(heads)])
        poison = POISON if dtype == "fp32" else HALF_POISON
        _, tq = framed(q, dtype, NAN, pad_rows=bm)
        _, tdo = framed(do, dtype, NAN, pad_rows=bm)
        _, tk = framed(k, dtype, NAN, pad_rows=bn)
        _, tv = framed(v, dtype, NAN, pad_rows=bn)
        _, tlse = framed(lse, "fp32", NAN, pad_cols=bm)
        _, tdelta = framed(delta, "fp32", NAN, pad_cols=bm)
        _, tdk = framed(np.zeros_like(k), dtype, poison, pad_rows=bn)
        _, tdv = framed(np.zeros_like(v), dtype, poison, pad_rows=bn)
        tdk.fill_(poison)
        tdv.fill_(poison)
        what = (f"{heads} head{'s' if heads > 1 else ''}, N_Q={n_q}, N_K={n_k}, d={d}, BLOCK_M={bm}, BLOCK_N={bn}, "
                f"{dtype}{', scores of ±1000' if ls > 100 else ''}")
        tensors = (tq, tk, tv, tdo, tlse, tdelta, tdk, tdv)
        try:
            # one stage: tiles this size fit a small GPU's shared memory (64 KB per block on a T4) unpipelined
            _dkdv_launch(attention_dkdv_kernel, heads, n_q, n_k, d, bm, bn, tensors, scale, num_stages=1)
            if gpu:
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a learner's kernel may fail to compile in any way
            return report.fail(f"{what}: {explain(exc)}")
        # the truth: the gradients of the exact attention given the (rounded) q, k, v, do, o, lse, D
        dk_t, dv_t = [], []
        for h in range(heads):
            p = np.exp(q[h] @ k[h].T * scale - lse[h][:, None])
            dv_t.append(p.T @ do[h])
            dk_t.append((p * (do[h] @ v[h].T - delta[h][:, None])).T @ q[h] * scale)
        dk_t, dv_t = np.stack(dk_t), np.stack(dv_t)
        ref = [np.stack(r) for r in zip(*[_torch_grads(q[h], k[h], v[h], do[h], scale, False, dt, dev)[1:]
                                           for h in range(heads)])]
        eps = float(torch.finfo(dt).eps)
        floor = _floor(q[0], k[0], scale, eps) if dtype == "fp32" else 4 * eps
        # the scores scaled by 1/sqrt(HEAD_DIM) (or a number written in for it), not by the argument sm_scale
        own_scale = (f"the scores are scaled by qk_scale = sm_scale · log2 e, with the sm_scale the launch passes (here "
                     f"{scale:.4g}, drawn on every run), not by 1/√HEAD_DIM or a number written in")
        p_own = [np.exp(q[h] @ k[h].T / math.sqrt(d) - lse[h][:, None]) for h in range(heads)]
        own_scale_dk = np.stack([(p_own[h] * (do[h] @ v[h].T - delta[h][:, None])).T @ q[h] * scale
                                 for h in range(heads)])
        # the query loop stepped by a tile size written in (16 or 32) while each tile holds BLOCK_M rows:
        # row i is counted once for every tile that covers it
        tiles = (f"the query tiles are BLOCK_M rows each (here BLOCK_M={bm}): step the loop by BLOCK_M; a tile size "
                 f"written as a number holds only for the launch it was written for (the grader launches several)")
        covers = [np.array([sum(s0 <= i < s0 + bm for s0 in range(0, n_q, step)) for i in range(n_q)], dtype=float)
                  for step in (16, 32) if step != bm]
        p_all = [np.exp(q[h] @ k[h].T * scale - lse[h][:, None]) for h in range(heads)]
        mistakes_of = {
            "dv": [(own_scale, np.stack([p_own[h].T @ do[h] for h in range(heads)])),
                   *[(tiles, np.stack([(p_all[h] * w[:, None]).T @ do[h] for h in range(heads)])) for w in covers],
                   ("p = exp2(s · qk_scale − lse · log2 e): the lse is a natural log, convert it to base 2",
                    np.stack([np.exp2(q[h] @ k[h].T * scale * LOG2E - lse[h][:, None]).T @ do[h] for h in range(heads)])),
                   ("qk_scale already holds log2(e): use tl.math.exp2, or tl.exp with the natural-log scale",
                    np.stack([np.exp(q[h] @ k[h].T * scale * LOG2E - lse[h][:, None] * LOG2E).T @ do[h]
                              for h in range(heads)]))],
            "dk": [(own_scale, own_scale_dk),
                   ("dSᵀ = Pᵀ ∘ (dPᵀ − D): subtract D, one value per query (a column of the transposed tile)",
                    np.stack([(np.exp(q[h] @ k[h].T * scale - lse[h][:, None]) * (do[h] @ v[h].T)).T @ q[h] * scale
                              for h in range(heads)])),
                   ("dSᵀ = Pᵀ ∘ (dPᵀ − D): multiply by Pᵀ",
                    np.stack([((do[h] @ v[h].T) - delta[h][:, None]).T @ q[h] * scale for h in range(heads)])),
                   ("the epilogue already multiplies dK by sm_scale: do not scale it in the loop too",
                    dk_t * scale)],
        }
        # as in 07.3: dSᵀ cancels where a row of P is one-hot; a few rounding steps of the terms that cancel
        cancel_dk = 16 * eps * max(float(np.max(np.abs(do[h]) @ np.abs(v[h]).T)) * float(np.max(np.abs(q[h]))) *
                                   float(np.max(np.exp(q[h] @ k[h].T * scale - lse[h][:, None]).sum(axis=0)))
                                   for h in range(heads)) * scale
        for name, got_t, truth, r in (("dv", tdv, dv_t, ref[1]), ("dk", tdk, dk_t, ref[0])):
            got = to_numpy(got_t.float() if dtype != "fp32" else got_t)
            if (got == 0).all():
                return report.fail(f"{what}: {name} is all zeros: is the loop body still a stub?")
            rel = cancel_dk / max(float(np.max(np.abs(truth))), 1e-300) if name == "dk" and dtype == "fp32" else 0.0
            ok, line = compare(got, truth, r, what=f"{name}, {what}", rtol_floor=max(floor, rel))
            if not ok:
                hint = _diagnose(got, mistakes_of[name], truth)
                if hint is None and heads > 1 and compare(got[:1], truth[:1], r[:1], what=name,
                                                          rtol_floor=max(floor, rel))[0]:
                    hint = (f"head 0 is right, the others are not: head h of q and do starts at h * stride_qh, of lse "
                            f"and delta at h * stride_lh (here the heads lie further apart than N_Q={n_q} rows: use "
                            f"the strides the launch passes)")
                if hint is None and not np.isfinite(got).all():
                    hint = ("queries past N_Q lie outside the head (here NaN): load q, do, lse and D with "
                            "mask=offs_m < N_Q (other=0.0)")
                return _fail(report, line, hint)
        report.ok(f"{what}: dk and dv match")

    # speed, on a GPU: against PyTorch's SDPA backward (which also computes dQ), timed now
    if gpu and not report.failures:
        heads, n, d = 64, 4096, 64
        g = torch.Generator(device=dev).manual_seed(75)
        q, k, v, do = (torch.randn(heads, n, d, device=dev, generator=g, dtype=torch.float16) for _ in range(4))
        lse = torch.randn(heads, n, device=dev, generator=g).abs() + 8.0
        delta = torch.randn(heads, n, device=dev, generator=g)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        tensors = (q, k, v, do, lse, delta, dk, dv)
        qs, ks, vs = (t.view(4, 16, n, d).clone().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
        dos = do.view(4, 16, n, d)
        learner = lambda: _dkdv_launch(attention_dkdv_kernel, heads, n, n, d, 32, 64, tensors,  # noqa: E731
                                       1 / math.sqrt(d), num_warps=4, num_stages=2)
        # SDPA's backward runs on tensor cores on every GPU; Triton's tl.dot only from compute capability 8.0
        # on. Where it runs on CUDA cores (a T4), the peer is the course's dK/dV kernel with the same tiles,
        # compiled here as the learner's is (kernelcourse.targets).
        from ..attention_backward import attention_bwd_dkdv_kernel
        from ..targets import speed_peer

        dk_c, dv_c = torch.empty_like(k), torch.empty_like(v)
        q4, k4, v4, do4 = (t.view(1, heads, n, d) for t in (q, k, v, do))
        strides = [s for t in (q4, k4, do4) for s in t.stride()[:3]]
        course = lambda: attention_bwd_dkdv_kernel[(n // 64, heads)](  # noqa: E731
            q4, k4, v4, do4, lse, delta, dk_c, dv_c, 1 / math.sqrt(d), heads, n, n, *strides, HEAD_DIM=d, CAUSAL=False,
            BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
        peer_name, peer, at_least, why = speed_peer(
            learner(), tensor_cores=("SDPA's whole backward",
                                     lambda: torch.autograd.grad(out, (qs, ks, vs), dos, retain_graph=True), 0.6),
            cuda_cores=("the course's dK/dV kernel with the same tiles", course, 0.6))
        what = f"your dK/dV kernel at (B·H, N, d) = ({heads}, {n}, {d}), fp16"
        # SDPA is PyTorch's own CUDA code: under gpu_check --pre-hopper on a Hopper GPU it is not held to
        # mma.sync as the learner's kernel is, and a shortfall against it is not graded (grading.speed)
        speed_vs_peer(report, what + (f" ({why})" if why and peer is course else ""), learner, peer, peer_name,
                      at_least=at_least, hint=why if why and peer is not course else None,
                      library_peer=peer is not course)
    elif not gpu:
        report.not_graded("speed of your dK/dV kernel against SDPA's backward: speed needs a GPU (not graded here)")


# ---- 07.6 which query tiles a key tile needs, causal ------------------------------------------


def query_range_truth(start_n: int, block_m: int, block_n: int) -> tuple[int, int]:
    from ..attention import causal_query_range  # the function the course's dK/dV kernel calls

    return causal_query_range.fn(start_n * block_n, block_m, block_n)


def _qtiles(m_start, m_full, bm, n_q):
    return [t for t in range(m_start, m_full, bm) if t < n_q], list(range(max(m_full, m_start), n_q, bm))


@exercise("07.6", "causal masking: which query tiles a key tile needs", names=("query_range",), time_limit_s=60)
def grade_query_range(report: Report, query_range):
    cases = []
    rng = fresh_rng(report)  # and tile sizes no statement shows, drawn fresh on every run
    drawn = [(int(rng.integers(2, 97)), int(rng.integers(2, 97))) for _ in range(3)]
    for bm, bn in ((64, 64), (128, 64), (64, 128), (32, 16), (16, 32), (3, 4), (5, 2), (1, 1), (48, 32), *drawn):
        for n_q in (1, 7, bm, 3 * bm + 5, 200, 1000):
            for start_n in range(0, 9):
                cases.append((start_n, bm, bn, n_q))
    hints = [
        (lambda s, bm, bn: (0, query_range_truth(s, bm, bn)[1]),
         "queries before the tile's first key k0 see none of its keys: start at the query tile that holds k0, "
         "(k0 // block_m) * block_m"),
        (lambda s, bm, bn: (s * bn, query_range_truth(s, bm, bn)[1]),
         "m_start is where a query tile starts, a multiple of block_m: the tile that holds k0"),
        (lambda s, bm, bn: (query_range_truth(s, bm, bn)[0], -(-(s * bn + bn) // bm) * bm),
         "a query tile whose first query is the key tile's last key, k0 + block_n - 1, already sees every key: "
         "m_full is the first multiple of block_m that is >= k0 + block_n - 1"),
        (lambda s, bm, bn: (query_range_truth(s, bm, bn)[0], query_range_truth(s, bm, bn)[0] + bm),
         "a key tile taller than a query tile crosses the diagonal in several query tiles: m_full is the first "
         "multiple of block_m at or after the tile's last key, k0 + block_n - 1"),
        (lambda s, bm, bn: (query_range_truth(s, bm, bn)[0], s * bn + bn - 1),
         "m_full is where the unmasked query tiles start: a multiple of block_m"),
        (lambda s, bm, bn: (query_range_truth(s, bm, bn)[1], query_range_truth(s, bm, bn)[0]),
         "query i sees key j when j <= i: the masked tiles come first (from the diagonal), the full ones after"),
    ]
    for start_n, bm, bn, n_q in cases:
        call = f"query_range({start_n}, {bm}, {bn})"
        before = report.failures
        got = guarded(report, call, query_range, start_n, bm, bn)
        if report.failures > before:
            return
        got = as_tuple(report, call, got, 2)
        if got is None:
            return
        try:
            m_start, m_full = int(got[0]), int(got[1])
        except (TypeError, ValueError):
            return report.fail(f"{call} returned {got!r}: return two ints (m_start, m_full)")
        want = query_range_truth(start_n, bm, bn)
        if _qtiles(m_start, m_full, bm, n_q) == _qtiles(*want, bm, n_q) and m_start % bm == 0:
            continue
        hint = next((h for fn, h in hints if (m_start, m_full) == fn(start_n, bm, bn)), None)
        k0 = start_n * bn
        return _fail(report, f"{call} returned ({m_start}, {m_full}), expected {want} (keys {k0}..{k0 + bn - 1}, "
                             f"{n_q} queries)", hint or "m_start: the query tile holding key k0; m_full: the first "
                                                        "multiple of block_m at or after k0 + block_n - 1")
    report.ok(f"query_range: all {len(cases)} key tiles get the right skipped, masked and full query tiles")


# ---- 07.7 the autograd Function --------------------------------------------------------------


# The limit holds the first use of the course's kernels, which tune themselves: on a T4, whose tl.dot is
# compiled to FMA (slow to compile), the candidate tiles' compiles alone took about 150 s on two CPU cores.
@exercise("07.7", "FlashAttention as a torch.autograd.Function", names=("FlashAttentionFn",), time_limit_s=600)
def grade_function(report: Report, FlashAttentionFn):
    import torch

    if not (isinstance(FlashAttentionFn, type) and issubclass(FlashAttentionFn, torch.autograd.Function)):
        return report.fail("FlashAttentionFn must be a class derived from torch.autograd.Function")
    gpu = world().gpu
    dev = world().device
    dt = torch.float16 if gpu else torch.float32
    # every N_Q · N_K is larger than any (N, d) tensor, so a saved P cannot hide among them
    cases = [(1, 2, 40, 50, 16, False, 1.0), (1, 1, 70, 45, 32, True, 1.0), (1, 1, 30, 45, 16, True, 1.0),
             (2, 1, 33, 33, 16, False, 300.0)]
    if gpu:
        cases += [(2, 4, 300, 1000, 64, True, 1.0), (1, 2, 1000, 257, 128, False, 30.0)]
    rng = fresh_rng(report)  # values drawn fresh on every run: a table of one run's answers passes nothing
    for i, (B, H, n_q, n_k, d, causal, ls) in enumerate(cases):
        heads = [_head(rng, n_q, n_k, d, ls) for _ in range(B * H)]
        q, k, v, do = (np.stack([h[j] for h in heads]).reshape(B, H, -1, d) for j in range(4))
        leaves = [torch.tensor(a, device=dev).to(dt).requires_grad_() for a in (q, k, v)]
        tdo = torch.tensor(do, device=dev).to(dt)
        q, k, v, do = (to_numpy(t.detach().float()).astype(np.float64) for t in (*leaves, tdo))
        what = f"(B, H, N_Q, N_K, d) = {(B, H, n_q, n_k, d)}{', causal' if causal else ''}" + \
               (", scores of ±1000" if ls > 100 else "")
        before = report.failures
        out = guarded(report, f"forward, {what}", FlashAttentionFn.apply, *leaves, causal)
        if report.failures > before:
            return
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, H, n_q, d):
            return report.fail(f"forward, {what}: returned {type(out).__name__} "
                               f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}: return o, shaped like q")
        if out.grad_fn is None:
            return report.fail(f"forward, {what}: the output has no grad_fn: call FlashAttentionFn.apply(q, k, v, causal)")
        o_truth = np.stack([grads64(q[b, h], k[b, h], v[b, h], do[b, h], 1 / math.sqrt(d), causal)[3]["o"]
                            for b in range(B) for h in range(H)]).reshape(B, H, n_q, d)
        eps = float(torch.finfo(dt).eps)
        # in float32, scores of ±1000 cost o about eps · max|s| (the exponent's rounding), in every head
        floor = max(_floor(q[b, h], k[b, h], 1 / math.sqrt(d), eps) for b in range(B) for h in range(H)) \
            if dt == torch.float32 else 8 * eps
        ok, line = compare(to_numpy(out.float()), o_truth, None, what=f"o, {what}", rtol_floor=max(64 * eps, floor))
        if not ok:
            return _fail(report, line, "the forward returns o from flash_attention(q, k, v, causal=causal)")
        # what the forward kept for the backward: saved tensors and tensors stored on ctx
        kept = list(getattr(out.grad_fn, "saved_tensors", ()))
        on_ctx = {n: t for n, t in vars(out.grad_fn).items() if isinstance(t, torch.Tensor)} \
            if hasattr(out.grad_fn, "__dict__") else {}
        kept += list(on_ctx.values())
        for name, t in on_ctx.items():
            if t is out or (t.data_ptr() == out.data_ptr() and t.numel() and t.shape == out.shape):
                return report.fail(
                    f"forward, {what}: it keeps its output on ctx (ctx.{name} = o): o holds its grad_fn, whose ctx "
                    f"holds o, a reference cycle that only the garbage collector frees, so every step's activations "
                    f"pile up; save the tensors the backward needs with ctx.save_for_backward(q, k, v, o, lse)")
            if t.requires_grad:
                return report.fail(
                    f"forward, {what}: it keeps an input on ctx (ctx.{name}): tensors the backward needs go through "
                    f"ctx.save_for_backward(...), which checks that they were not changed in place before the "
                    f"backward runs and frees them with the graph")
        for t in kept:
            if t.numel() >= B * H * n_q * n_k and t.numel() > B * H * max(n_q, n_k) * d:
                return report.fail(f"forward, {what}: it keeps a tensor of shape {tuple(t.shape)}, as large as the "
                                   f"N_Q × N_K probabilities: save q, k, v, o and the lse; the backward recomputes P")
        ok = guarded(report, f"backward, {what}", out.backward, tdo)
        if report.failures > before:
            return
        grads = [t.grad for t in leaves]
        if any(g is None for g in grads):
            return report.fail(f"backward, {what}: q, k or v got no gradient: return (dq, dk, dv, None) from backward")
        per_head = [grads64(q[b, h], k[b, h], v[b, h], do[b, h], 1 / math.sqrt(d), causal)[:3]
                    for b in range(B) for h in range(H)]
        # as in 07.3: dS = P ∘ (dP − D) cancels where a row of P is one-hot, so allow a few rounding steps of
        # the terms that cancel, |dP| · |K| · sm_scale (for dK, summed over the queries that see a key)
        sc, dp_max = 1 / math.sqrt(d), max(float(np.max(np.abs(do[b, h]) @ np.abs(v[b, h]).T))
                                           for b in range(B) for h in range(H))
        p_cols = max(float(np.max(grads64(q[b, h], k[b, h], v[b, h], do[b, h], sc, causal)[3]["p"].sum(axis=0)))
                     for b in range(B) for h in range(H))
        cancel = [16 * eps * dp_max * float(np.max(np.abs(k))) * sc,
                  16 * eps * dp_max * float(np.max(np.abs(q))) * sc * p_cols, 0.0]
        for j, name in enumerate(("dq", "dk", "dv")):
            truth = np.stack([g[j] for g in per_head]).reshape(grads[j].shape)
            ref = np.stack([_torch_grads(q[b, h], k[b, h], v[b, h], do[b, h], 1 / math.sqrt(d), causal, dt, dev)[j]
                            for b in range(B) for h in range(H)]).reshape(truth.shape)
            rel = cancel[j] / max(float(np.max(np.abs(truth))), 1e-300) if dt == torch.float32 else 0.0
            ok, line = compare(to_numpy(grads[j].float()), truth, ref, what=f"{name}, {what}",
                               rtol_floor=max(floor, rel))
            if not ok:
                hint = None
                others = [np.stack([g[m] for g in per_head]).reshape(leaves[m].shape) for m in range(3) if m != j]
                if any(o.shape == truth.shape and _matches(grads[j], o, truth) for o in others):
                    hint = "backward returns the gradients in the order of forward's inputs: (dq, dk, dv, None)"
                elif causal and _matches(grads[j], np.stack([unmasked_grads64(q[b, h], k[b, h], v[b, h], do[b, h],
                                                                              1 / math.sqrt(d))[j] for b in range(B)
                                                             for h in range(H)]).reshape(truth.shape), truth):
                    hint = "the backward must use the same causal flag as the forward: keep it on ctx"
                return _fail(report, line, hint)
        report.ok(f"{what}: o and the gradients match; the forward keeps {len(kept)} tensors, none N_Q × N_K")
