"""Graders for chapter 06, FlashAttention: the online softmax, tiled attention, and the kernel.

The PyTorch exercises run on CPU tensors in any world; the Triton exercise launches the learner's
kernel (in Triton's interpreter on the CPU, compiled on a GPU) on keys and values framed by NaN, so a
load past ``N_K`` shows, and outputs framed by poison. Every input set includes scores of a thousand
or more, where an ``exp`` without the running max overflows, a number of keys that is not a multiple
of the tile, and several seeds. Results are compared with a float64 truth; when one is wrong, the
grader recomputes the typical mistakes (no rescale, no tail mask, base e instead of base 2...) in
float64 and names the one that matches (the float64 attention, exact and with each bug, is in
``attention64.py``; what every grader shares, in ``harness.py``).

One section per exercise, in the chapter's order, each its cases, then its checks and messages:
06.1 combining split-KV results, 06.2 one-pass softmax statistics, 06.3 tiled attention in PyTorch,
06.4 the Triton inner loop, 06.5 which tiles the causal mask needs, 06.6 the log-sum-exp from the
kernel's base-2 state, 06.7 the causal kernel in Triton, 06.8 that kernel graded on speed.
"""
from __future__ import annotations

import math

import numpy as np

from ..world import world
from .harness import (HALF_POISON, LN2, LOG2E, NAN, POISON, Report, as_tuple, call, compare, compare_returned,
                      exact_f32, exercise, fresh_rng, guarded, tolerance_of)
from .attention64 import attention64, tiled64
from .harness import diagnose, framed, largest_made, launch, not_a_kernel, rand, reproduces, to_numpy



# ---- helpers -----------------------------------------------------------------------------------


def _check(got, truth, reference, what: str, floor: float = 64.0) -> tuple[bool, str]:
    """compare() with a float32 floor of ``floor`` rounding steps of the largest value: an online
    algorithm rounds at every rescale, so it may differ from PyTorch's direct computation by more
    than PyTorch's own error, but by nothing like a mistake."""
    return compare_returned(got, truth, reference, what, floor * float(np.finfo(np.float32).eps))


def _rand(rng, shape, scale=1.0):
    return rand(rng, shape, (scale,))


def _drawn_scale(rng, d: int) -> float:
    """A softmax scale drawn on each run, never near 1/sqrt(d): code that computes 1/sqrt(d) itself
    instead of using the scale it is given then computes something else. Larger, never smaller, so that
    scores meant to be near -1000 stay below -745, where exp underflows even in float64."""
    return float(rng.uniform(1.25, 1.6)) / math.sqrt(d)


def _own_scale_hint(name: str, given: float, usual: str) -> str:
    return (f"this matches {name} = {usual}, where the grader passed {name} = {given:.4g}: use the {name} "
            "argument, not a scale of your own (the grader draws it on every run)")


def _head_hint(got, truth, reference, rtol_floor: float, strides: str) -> str | None:
    """When head 0 is right and a later head is not: the heads were taken as packed back to back."""
    right = [compare(got[h:h + 1], truth[h:h + 1], reference[h:h + 1], what="", rtol_floor=rtol_floor)[0]
             for h in range(len(got))]
    if len(got) < 2 or not right[0] or all(right):
        return None
    bad = right.index(False)
    return (f"head 0 is right and head {bad} is not: head h starts h * stride elements in ({strides}), and the "
            "heads need not lie back to back (here each is followed by rows that are not its own)")


# ---- 06.1 combining split-KV partial results -----------------------------------------------------


def _split_case(rng, rows, d, sizes, spread, empty_split=None):
    """Rows of scores split into chunks of keys; each chunk's normalised output and log-sum-exp.

    ``spread`` sets how far apart the chunks' scores sit (hundreds: exp(lse) overflows float32).
    Chunk ``empty_split`` of row 0 has every key masked: its lse is -inf and its output 0.
    """
    n = sum(sizes)
    offsets = np.repeat(rng.uniform(-spread, spread, size=(rows, len(sizes))), sizes, axis=1)
    s = _rand(rng, (rows, n), 3.0) + offsets
    if empty_split is not None:
        lo = sum(sizes[:empty_split])
        s[0, lo:lo + sizes[empty_split]] = -np.inf
    v = _rand(rng, (n, d))
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    truth_o = (p @ v) / p.sum(axis=1, keepdims=True)
    truth_lse = (m + np.log(p.sum(axis=1, keepdims=True)))[:, 0]
    outs, lses, lo = [], [], 0
    for size in sizes:
        sc = s[:, lo:lo + size]
        mc = sc.max(axis=1, keepdims=True)
        fin = np.isfinite(mc)
        pc = np.exp(sc - np.where(fin, mc, 0.0))
        lc = pc.sum(axis=1, keepdims=True)
        outs.append(np.where(fin, (pc @ v[lo:lo + size]) / np.where(lc > 0, lc, 1.0), 0.0))
        lses.append(np.where(fin, mc + np.log(np.where(lc > 0, lc, 1.0)), -np.inf)[:, 0])
        lo += size
    return np.stack(outs), np.stack(lses), truth_o, truth_lse


def _combine_mistakes(outs, lses):
    """(hint, o, lse) of typical wrong ways to combine the splits, in float64."""
    finite = np.where(np.isfinite(lses), lses, -np.inf)
    m = finite.max(axis=0)
    w = np.exp(finite - m)
    good_lse = m + np.log(w.sum(axis=0))
    with np.errstate(all="ignore"):  # in float32, as the learner's code runs: exp(lse) overflows past 88
        raw = np.exp(lses.astype(np.float32))
        naive_o = ((raw[..., None] * outs.astype(np.float32)).sum(axis=0) / raw.sum(axis=0)[:, None]).astype(np.float64)
    return [
        ("each split's output must be weighted by its share of the softmax's sum, exp(lse_s - lse): a plain "
         "average treats every split alike", outs.mean(axis=0), None),
        ("the weights exp(lse_s - max) are not yet shares: divide by their sum, Σ_s exp(lse_s - max)",
         (w[..., None] * outs).sum(axis=0), None),
        ("exp(lse_s) overflows (or underflows) float32 when the lse are in the hundreds: subtract the largest lse "
         "first, exp(lse_s - max_s lse_s)", naive_o, np.log(raw.sum(axis=0)).astype(np.float64)),
        ("the combined lse is log Σ_s exp(lse_s), not the largest lse", None, m),
        ("the combined lse is log Σ_s exp(lse_s): the max goes back in, m + log Σ_s exp(lse_s - m)", None,
         np.log(w.sum(axis=0))),
        ("the combined lse is log Σ_s exp(lse_s), not a sum of logs", None, finite.sum(axis=0)),
        ("the combined lse is log Σ_s exp(lse_s), computed with the max: m + log Σ exp(lse_s - m)",
         None, m + w.sum(axis=0)),
    ], good_lse


@exercise("06.1", "combine split-KV partial results", names=("combine_splits",), time_limit_s=60)
def grade_combine(report: Report, combine_splits):
    import torch

    # (rows, d, chunk sizes, spread of the chunks' scores, a chunk of row 0 with every key masked)
    cases = [(3, 4, (5, 7), 0.5, None), (4, 8, (16, 1, 9), 300.0, None), (5, 16, (32, 32, 32, 5), 800.0, None),
             (3, 8, (10, 10, 10), 200.0, 1), (3, 8, (6, 10, 10), 100.0, 0), (2, 4, (1,), 1.0, None)]
    base = int(fresh_rng(report).integers(1 << 30))  # values drawn fresh on every run
    for i, (rows, d, sizes, spread, empty) in enumerate(cases):
        for seed in (0, 1):
            rng = np.random.default_rng(base + 10 * i + seed)
            outs, lses, truth_o, truth_lse = _split_case(rng, rows, d, sizes, spread, empty)
            o32, l32 = torch.tensor(outs, dtype=torch.float32), torch.tensor(lses, dtype=torch.float32)
            largest = np.max(np.abs(lses[np.isfinite(lses)]))
            what = f"{len(sizes)} split{'s' if len(sizes) > 1 else ''} of {rows} rows (lse up to {largest:.0f})"
            if empty is not None:
                what += ", the first split empty (lse = -inf)" if empty == 0 else ", one split empty (lse = -inf)"
            what += f", seed {seed}"
            got = call(report, what, combine_splits, o32.clone(), l32.clone())
            got = as_tuple(report, f"combine_splits ({what})", got, 2)
            if got is None:
                return
            # PyTorch's own float32 way, for the tolerance: weights from softmax over the lse
            wts = torch.softmax(l32, dim=0)
            ref_o = to_numpy((wts[..., None] * o32).sum(dim=0)).astype(np.float64)
            ref_lse = to_numpy(torch.logsumexp(l32, dim=0)).astype(np.float64)
            mistakes, _ = _combine_mistakes(exact_f32(outs), exact_f32(lses))
            nan_hint = ("an empty split (lse = -inf) must get weight exp(-inf - m) = 0; if every exponent is "
                        "huge, subtract the largest lse first")
            if empty == 0:
                nan_hint = ("the first split is empty (lse = -inf): a running max started at -inf is still -inf "
                            "there, and exp(-inf - (-inf)) is NaN; an empty split must get weight 0 (take the max "
                            "over every split first, or skip a split whose lse is -inf)")

            def only_the_empty_row(x) -> bool:  # NaN or Inf on row 0, the row with the empty split, alone
                with np.errstate(invalid="ignore"):
                    bad = ~np.isfinite(np.asarray(to_numpy(x), dtype=np.float64).reshape(rows, -1)).all(axis=1)
                return empty is not None and bad[0] and not bad[1:].any()

            ok, line = _check(got[1], truth_lse, ref_lse, what=f"lse, {what}")
            if not ok:
                hint = nan_hint if "NaN or Inf" in line and only_the_empty_row(got[1]) else \
                    diagnose(got[1], [(h, l) for h, _, l in mistakes], truth=truth_lse)
                return report.fail(line, hint)
            ok, line = _check(got[0], truth_o, ref_o, what=f"output, {what}")
            if not ok:
                hint = nan_hint if "NaN or Inf" in line and only_the_empty_row(got[0]) else \
                    diagnose(got[0], [(h, o) for h, o, _ in mistakes], truth=truth_o)
                if hint is None and "NaN or Inf" in line:
                    hint = nan_hint
                return report.fail(line, hint)
            report.ok(f"{what}: output and lse match")


# ---- 06.2 one-pass softmax statistics ------------------------------------------------------------


class _Stream:
    """The blocks of one row, as an iterator that can be walked once (like a row streaming past)."""

    def __init__(self, blocks):
        self._blocks = list(blocks)
        self.walked = False

    def __iter__(self):
        if self.walked:
            raise RuntimeError("the blocks can be read only once: compute m and l in a single pass")
        self.walked = True
        return iter(self._blocks)


def _stream_rows(rng):
    """(description, list of float32 blocks) of rows that make the usual mistakes show."""
    rows = []
    x = _rand(rng, 40)
    rows.append(("40 values near 0, blocks of 8", [x[i:i + 8] for i in range(0, 40, 8)]))
    x = np.sort(_rand(rng, 50, 3.0)) + np.linspace(0, 120, 50)
    rows.append(("a row rising to ~120 (the max grows every block), blocks of 7",
                 [x[i:i + 7] for i in range(0, 50, 7)]))
    x = -np.sort(-_rand(rng, 45, 3.0)) + np.linspace(800, 780, 45)
    rows.append(("a row falling from ~800, blocks of 10", [x[i:i + 10] for i in range(0, 45, 10)]))
    x = _rand(rng, 64, 400.0)
    sizes = [1, 13, 2, 31, 17]
    rows.append(("values of ±1000, blocks of 1, 13, 2, 31, 17", np.split(x, np.cumsum(sizes)[:-1])))
    x = -np.abs(_rand(rng, 30, 10.0)) - 1000.0
    rows.append(("every value below -1000, blocks of 6", [x[i:i + 6] for i in range(0, 30, 6)]))
    x = _rand(rng, 9)
    rows.append(("one block of 9", [x]))
    return rows


def _stats_mistakes(blocks):
    """(hint, m, l) of typical wrong one-pass algorithms, in float64."""
    xs = [b.astype(np.float64) for b in blocks]
    allx = np.concatenate(xs)
    m_all = allx.max()
    out = []
    # no rescale: l += Σ exp(x - m_new), the old l left as it was
    m, l_no, l_inv = -np.inf, 0.0, 0.0
    for x in xs:
        m_new = max(m, x.max())
        l_no = l_no + np.exp(x - m_new).sum()
        l_inv = (l_inv * np.exp(m_new - m) if np.isfinite(m) else 0.0) + np.exp(x - m_new).sum()
        m = m_new
    out.append(("when the max grows, what was summed against the old max is too large by exp(m_new - m_old): "
                "rescale the running sum, l = l * exp(m_old - m_new) + Σ exp(x - m_new)", m_all, l_no))
    out.append(("the rescale factor is exp(m_old - m_new), at most 1: the old terms shrink when the max grows",
                m_all, l_inv))
    out.append(("subtract the running max before exp: exp(x) overflows float32 above 88, and underflows to 0 "
                 "below -103", m_all, np.exp(allx).sum()))
    out.append(("l is the sum over the whole row, of exp(x - m) with the row's max m",
                m_all, np.exp(xs[-1] - m_all).sum()))
    first = xs[0].max()
    out.append(("m is the max over every block, not the first block's", first, np.exp(allx - first).sum()))
    out.append(("return (m, l) with l = Σ exp(x - m), not the log of it", m_all, np.log(np.exp(allx - m_all).sum())))
    if m_all < 0:  # a running max started at 0: on a row below 0 it stays 0, and every exp(x - 0) underflows
        out.insert(0, ("start the running max at -inf, not 0: on a row whose values are all below 0 it stays 0, "
                       "and exp(x - 0) underflows", 0.0, np.exp(allx).sum()))
    return out


F32_MAX = float(np.finfo(np.float32).max)  # a sum beyond it is inf in float32, as the learner's is


@exercise("06.2", "one-pass softmax statistics", names=("online_softmax_stats",), time_limit_s=60)
def grade_online_stats(report: Report, online_softmax_stats):
    import torch

    base = int(fresh_rng(report).integers(1 << 30))  # values drawn fresh on every run
    for seed in (0, 1, 2):
        rng = np.random.default_rng(base + seed)
        for what, blocks in _stream_rows(rng):
            blocks = [np.asarray(b, dtype=np.float32) for b in blocks]
            what = f"{what}, seed {seed}"
            stream = _Stream([torch.from_numpy(b.copy()) for b in blocks])
            got = call(report, what, largest_made, online_softmax_stats, stream)
            got, numel, shape = got
            longest, row = max(b.size for b in blocks), sum(b.size for b in blocks)
            if numel > longest and numel >= row:
                return report.fail(f"{what}: a tensor of shape {shape} was made, as large as the whole row of {row} "
                                   "values: keep only the running max and sum, one block at a time")
            got = as_tuple(report, f"online_softmax_stats ({what})", got, 2)
            if got is None:
                return
            x64 = np.concatenate(blocks).astype(np.float64)
            m_true = x64.max()
            l_true = np.exp(x64 - m_true).sum()
            x32 = torch.from_numpy(np.concatenate(blocks))
            l_ref = float(torch.exp(x32 - x32.max()).sum())
            try:
                m_got, l_got = float(to_numpy(got[0]).reshape(-1)[0]), float(to_numpy(got[1]).reshape(-1)[0])
            except (TypeError, ValueError, IndexError):
                return report.fail(f"{what}: returned {got!r}: return two numbers (m, l)")
            mistakes = _stats_mistakes(blocks)
            hint = next((h for h, m, l in mistakes if math.isclose(m_got, m, rel_tol=1e-5, abs_tol=1e-5)
                         and (math.isclose(l_got, l, rel_tol=1e-4) or (math.isinf(l_got) and l > F32_MAX)
                              or (l == 0 and l_got == 0))), None)
            if not math.isclose(m_got, m_true, rel_tol=0, abs_tol=1e-4 * max(1.0, abs(m_true))):
                return report.fail(f"{what}: m = {m_got:.6g}, expected the row's max {m_true:.6g}",
                             hint or "m is the largest value seen: m = max(m, block.max()) after each block")
            tol = tolerance_of(l_true, l_ref, 64 * float(np.finfo(np.float32).eps))
            if not (math.isfinite(l_got) and abs(l_got - l_true) <= tol):
                return report.fail(f"{what}: l = {l_got:.6g}, expected {l_true:.6g}",
                             hint or "l = Σ exp(x - m) over the whole row, with the running sum rescaled "
                                     "whenever m grows")
            report.ok(f"{what}: m = {m_true:.6g}, l = {l_true:.6g}")


# ---- 06.3 tiled attention in PyTorch -------------------------------------------------------------


def _worst_of(truth_o, truth_lse, scores, v):
    """PyTorch's float32 output and lse, from whichever of the given score tensors errs most."""
    import torch

    worst = None
    for s in scores:
        o = to_numpy(torch.softmax(s, dim=-1) @ v).astype(np.float64)
        lse = to_numpy(torch.logsumexp(s, dim=-1)).astype(np.float64)
        err = (np.max(np.abs(o - truth_o)), np.max(np.abs(lse - truth_lse)))
        if worst is None:
            worst = [o, lse, err]
        else:
            if err[0] > worst[2][0]:
                worst[0] = o
            if err[1] > worst[2][1]:
                worst[1] = lse
            worst[2] = (max(err[0], worst[2][0]), max(err[1], worst[2][1]))
    return worst[0], worst[1]


def _causal_from_zero32(q, k, v, scale):
    """causal_from_zero as float32 computes it: there exp(s - 0) is 0 below about -104 (in float64 only
    below -745), so a row whose scores are all below that gives 0 / 0 = NaN."""
    o, lse = attention64(q, k, v, scale, causal=True)
    s = np.where(np.tril(np.ones((q.shape[0], k.shape[0]), dtype=bool)), q @ k.T * scale, -np.inf)
    with np.errstate(under="ignore", over="ignore"):
        dead = (np.exp(s.astype(np.float32)) == 0).all(axis=1)
    o, lse = o.copy(), lse.copy()
    o[dead], lse[dead] = np.nan, -np.inf
    return o, lse


BELOW = -1000.0  # a logit scale below 0: every score of every row near this value, far below 0


def _attention_inputs(rng, n_q, n_k, d, logit_scale):
    """q, k, v in float64 (exactly float32 values) with scores around ±logit_scale; with a negative
    ``logit_scale``, scores around ±1 shifted to about ``logit_scale``, so that every score a row sees is
    far below 0 (a running max started at 0 instead of -inf makes every exp underflow there: 0 / 0)."""
    q = _rand(rng, (n_q, d)) * math.sqrt(abs(logit_scale) if logit_scale > 0 else 1.0)
    k = _rand(rng, (n_k, d)) * math.sqrt(abs(logit_scale) if logit_scale > 0 else 1.0)
    if logit_scale < 0:  # column 0 adds logit_scale to every scaled score: q0 · k0 / sqrt(d) = logit_scale
        q[:, 0] = math.sqrt(-logit_scale) * d ** 0.25
        k[:, 0] = -math.sqrt(-logit_scale) * d ** 0.25
    v = _rand(rng, (n_k, d))
    return exact_f32(q), exact_f32(k), exact_f32(v)


@exercise("06.3", "tiled attention in PyTorch", names=("tiled_attention",), time_limit_s=90)
def grade_tiled_attention(report: Report, tiled_attention):
    import torch

    # (N_Q, N_K, d, block_n, logit scale, causal): a tail tile, one tile, one query, scores of ±1000;
    # then causal, with N_Q below, equal to and above N_K (row 0 sees key 0 alone)
    cases = [(16, 64, 8, 16, 1.0, False), (20, 70, 16, 16, 1.0, False), (1, 37, 8, 8, 1.0, False),
             (24, 100, 16, 32, 300.0, False), (33, 45, 32, 64, 1.0, False), (40, 129, 8, 32, 30.0, False),
             (20, 70, 16, 16, 1.0, True), (48, 48, 8, 16, 1.0, True), (40, 29, 8, 16, 1.0, True),
             (24, 100, 16, 32, 300.0, True), (12, 40, 16, 16, BELOW, False), (12, 40, 16, 16, BELOW, True)]
    rng = fresh_rng(report)  # values drawn fresh on every run
    for i, (n_q, n_k, d, bn, ls, causal) in enumerate(cases):
        for seed in (0, 1):
            q, k, v = _attention_inputs(rng, n_q, n_k, d, ls)
            scale = 1.0 / math.sqrt(d)
            truth_o, truth_lse = attention64(q, k, v, scale, causal)
            what = (f"N_Q={n_q}, N_K={n_k}, d={d}, block_n={bn}{', causal' if causal else ''}"
                    f"{', large logits' if ls > 10 else ''}{', every score near -1000' if ls < 0 else ''}, "
                    f"seed {seed}")
            tq, tk, tv = (torch.tensor(a, dtype=torch.float32) for a in (q, k, v))
            got = call(report, what, largest_made, tiled_attention, tq, tk, tv, bn, causal)
            got, numel, shape = got
            got = as_tuple(report, f"tiled_attention ({what})", got, 2)
            if got is None:
                return
            # PyTorch's float32 error, for the tolerance: the worse of scaling the scores or the queries
            keep = torch.ones(n_q, n_k, dtype=torch.bool).tril() if causal else torch.ones(n_q, n_k, dtype=torch.bool)
            ref_o, ref_lse = _worst_of(truth_o, truth_lse, [((tq @ tk.T) * scale).masked_fill(~keep, -math.inf),
                                                            ((tq * scale) @ tk.T).masked_fill(~keep, -math.inf)], tv)
            bugs = [("when the max grows, rescale acc too: acc = acc * exp(m_old - m_new) + p @ v_tile",
                     "no_rescale_acc"),
                    ("when the max grows, rescale l too: l = l * exp(m_old - m_new) + p.sum(-1)", "no_rescale_l"),
                    ("when the max grows, rescale l and acc by exp(m_old - m_new), computed before m is updated",
                     "no_rescale"),
                    ("the rescale factor is exp(m_old - m_new) <= 1, not exp(m_new - m_old)", "inverted_rescale"),
                    ("the last tile of keys is partial (N_K is not a multiple of block_n): loop over "
                     "range(0, N_K, block_n)", "last_tile_missing"),
                    ("divide acc by l at the end: o = acc / l", "no_normalise"),
                    ("start the running max at -inf, not 0: when every score of a row is far below 0, "
                     "exp(s - 0) underflows to 0 and o = 0 / 0", "max_from_zero")]
            if causal:
                rows, cols = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
                masks = [("query i sees key i too: mask the keys j > i, not j >= i (row 0 sees key 0 alone)",
                          dict(keep=cols < rows)),
                         ("the mask here is top-left, as SDPA's is_causal: query i sees keys j <= i, counted from the "
                          "start of both sequences", dict(keep=cols <= rows + (n_k - n_q))),
                         ("masked scores must be -inf, so that exp gives 0; a score of 0 still counts",
                          dict(causal=True, fill=0.0)),
                         ("with causal=True, query i sees only the keys j <= i: mask the others", dict())]
                mistakes = [(h, attention64(q, k, v, scale, **kw)) for h, kw in masks]
                mistakes.append((bugs[-1][0], tiled64(q, k, v, scale, bn, "max_from_zero")) if not causal else
                                (bugs[-1][0], _causal_from_zero32(q, k, v, scale)))
            else:
                mistakes = [(h, tiled64(q, k, v, scale, bn, bug)) for h, bug in bugs]
            ok, line = _check(got[0], truth_o, ref_o, what=f"output, {what}", floor=256)
            if not ok:
                hint = diagnose(got[0], [(h, o) for h, (o, _) in mistakes], truth=truth_o)
                if hint is None and "NaN or Inf" in line:
                    hint = ("exp overflows float32 above 88: subtract the running max, p = exp(s - m_new[:, None]), "
                            "and start m at -inf, not 0")
                elif hint is None and reproduces(got[0], attention64(q, k, v, 1.0)[0], truth_o) is not None:
                    hint = "scale the scores by 1/sqrt(d) before the softmax"
                return report.fail(line, hint)
            ok, line = _check(got[1], truth_lse, ref_lse, what=f"lse, {what}", floor=256)
            if not ok:
                scores = q @ k.T * scale
                m = np.where(np.tril(np.ones(scores.shape, dtype=bool)), scores, -np.inf).max(axis=1) if causal \
                    else scores.max(axis=1)
                lse_mistakes = [("lse = m + log(l), with the natural log", m + np.log2(np.exp(truth_lse - m))),
                                ("lse = m + log(l): add the final running max back", truth_lse - m),
                                ("lse = m + log(l), not m + l", m + np.exp(truth_lse - m)),
                                ("lse = m + log(l), not the max alone", m)]
                return report.fail(line, diagnose(got[1], lse_mistakes, truth=truth_lse))
            allowed = max(n_q * bn, n_q * d, n_k * d, n_k)
            if n_q * n_k > allowed and numel >= n_q * n_k:
                return report.fail(f"{what}: a tensor of shape {shape} was made: that is the whole score matrix "
                                   f"(N_Q x N_K = {n_q} x {n_k}); work one tile of block_n keys at a time")
            report.ok(f"{what}: output and lse match, largest tensor made {shape}")


# ---- 06.4 the Triton inner loop ------------------------------------------------------------------


@exercise("06.4", "the FlashAttention inner loop in Triton", names=("attention_fwd_kernel",), time_limit_s=180)
def grade_inner_loop(report: Report, attention_fwd_kernel):
    import torch

    if (msg := not_a_kernel(attention_fwd_kernel, "attention_fwd_kernel")):
        return report.fail(msg)
    gpu = world().gpu
    # (heads, N_Q, N_K, d, BLOCK_M, BLOCK_N, dtype, logit scale, seed)
    cases = [(2, 20, 64, 16, 16, 16, "fp32", 1.0, 0),     # N_K a multiple of the tile
             (2, 37, 50, 16, 16, 16, "fp32", 1.0, 1),     # a partial last tile
             (1, 24, 64, 32, 16, 32, "fp32", 300.0, 2),   # scores of ±1000
             (3, 45, 77, 32, 32, 32, "fp32", 30.0, 3),
             (2, 33, 100, 64, 32, 32, "fp16", 1.0, 4),
             (1, 16, 9, 16, 16, 16, "fp32", 1.0, 5),      # fewer keys than one tile
             (1, 16, 40, 16, 16, 16, "fp32", BELOW, 9),   # every score far below 0
             (1, 100, 40, 16, 32, 16, "fp32", 1.0, 10)]   # more query tiles of 32 than tiles of 16 would cover
    if gpu:  # tl.dot on float32 is TF32 on a GPU: grade in half precision there, with larger sizes
        cases = [(h, nq, nk, d, bm, bn, "fp16", ls, s) for h, nq, nk, d, bm, bn, _, ls, s in cases]
        cases += [(4, 300, 1000, 64, 64, 64, "fp16", 30.0, 6), (2, 129, 257, 128, 64, 32, "fp16", 1.0, 7)]
        if world().has_bf16:  # not torch.cuda.is_bf16_supported: True on a T4 (emulated)
            cases.append((2, 100, 300, 64, 64, 64, "bf16", 30.0, 8))
    base = int(fresh_rng(report).integers(1 << 30))  # values drawn fresh on every run
    for heads, n_q, n_k, d, bm, bn, dtype, ls, seed in cases:
        rng = np.random.default_rng(base + seed)
        q = np.stack([_attention_inputs(rng, n_q, n_k, d, ls)[0] for _ in range(heads)])
        k = np.stack([_attention_inputs(rng, n_q, n_k, d, ls)[1] for _ in range(heads)])
        v = np.stack([_rand(rng, (n_k, d)) for _ in range(heads)])
        poison = POISON if dtype == "fp32" else HALF_POISON
        q_full, tq = framed(q, dtype, NAN, pad_rows=bm)
        k_full, tk = framed(k, dtype, NAN, pad_rows=bn)
        v_full, tv = framed(v, dtype, NAN, pad_rows=bn)
        o_full, to = framed(np.zeros((heads, n_q, d)), dtype, poison, pad_rows=bm)
        to.fill_(poison)
        scale = _drawn_scale(rng, d)  # a softmax scale of the run's own: a kernel must use qk_scale
        grid = (-(-n_q // bm), heads)
        what = (f"{heads} head{'s' if heads > 1 else ''}, N_Q={n_q}, N_K={n_k}, d={d}, BLOCK_M={bm}, "
                f"BLOCK_N={bn}, {dtype}{', large logits' if ls > 10 else ''}"
                f"{', every score near -1000' if ls < 0 else ''}")
        if not launch(report, what, attention_fwd_kernel, grid, tq, tk, tv, to, scale * LOG2E,
                       tq.stride(0), tk.stride(0), tv.stride(0), to.stride(0), n_q, n_k,
                       HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn):
            return
        got = to_numpy(to.float() if dtype != "fp32" else to)
        qs, ks, vs = (to_numpy(t.float()).astype(np.float64) for t in (tq, tk, tv))
        truth = np.stack([attention64(qs[h], ks[h], vs[h], scale)[0] for h in range(heads)])
        ref = to_numpy((torch.softmax((tq @ tk.transpose(-2, -1)) * scale, dim=-1) @ tv).float()).astype(np.float64)
        tail, large = n_k % bn != 0, ls > 10
        unwritten = got == np.float32(poison)
        if unwritten.all():
            return report.fail(f"{what}: no output was written: is the loop body still a stub?")
        bad = ~np.isfinite(got)
        if bad.all() and not tail and not large:
            return report.fail(f"{what}: every output is NaN: o = acc / l is 0 / 0 when the loop body does not "
                               "update acc and l (is it still a stub?)")
        eps = float(np.finfo(np.float32 if dtype == "fp32" else np.float16).eps)
        ok, line = compare(got, truth, ref, what=what, rtol_floor=(256 if dtype == "fp32" else 4) * eps)
        if ok:
            report.ok(line)
            continue
        hint = _head_hint(got, truth, ref, (256 if dtype == "fp32" else 4) * eps,
                          "q_ptr + h * stride_qh, k_ptr + h * stride_kh, v_ptr + h * stride_vh, o_ptr + h * stride_oh")
        if hint is None and "never written" in line:
            hint = (f"program start_m handles the BLOCK_M queries from start_m * BLOCK_M: use the BLOCK_M the launch "
                    f"passes (here {bm}: the grader varies it), not a number of your own")
        if hint is not None:
            return report.fail(line, hint)
        per_head = lambda bug: np.stack([tiled64(qs[h], ks[h], vs[h], scale, bn, bug)[0] for h in range(heads)])  # noqa: E731
        all_heads = lambda sc: np.stack([attention64(qs[h], ks[h], vs[h], sc)[0] for h in range(heads)])  # noqa: E731
        mistakes = [
            ("keys past N_K were loaded as 0 and scored 0, so they took a share of the softmax: set their scores "
             "to -inf, s = tl.where(keys[None, :] < N_K, s, float('-inf'))",
             per_head("tail_as_zero") if tail else None),
            ("when the max grows, rescale acc too: acc = acc * alpha[:, None] + tl.dot(p, v), with "
             "alpha = exp2(m_i - m_new)", per_head("no_rescale_acc")),
            ("when the max grows, rescale l too: l_i = l_i * alpha + tl.sum(p, 1)", per_head("no_rescale_l")),
            ("rescale l and acc by alpha = exp2(m_i - m_new), computed before m_i is replaced",
             per_head("no_rescale")),
            ("the rescale factor is exp2(m_i - m_new) <= 1, not exp2(m_new - m_i)", per_head("inverted_rescale")),
            ("qk_scale already holds log2(e): use tl.math.exp2 (exp2(s · log2 e) = exp(s)), or tl.exp with "
             "qk_scale / log2(e)", all_heads(scale * LOG2E)),
            ("multiply the scores by qk_scale", all_heads(LOG2E)),
            ("the loop must cover the last, partial tile too", per_head("last_tile_missing") if tail else None),
            ("start m_i at -inf, not 0: when every score of a row is far below 0, exp2(s - 0) underflows to 0 "
             "and acc / l_i is 0 / 0", per_head("max_from_zero") if ls < 0 else None),
            (_own_scale_hint("qk_scale", scale * LOG2E, "log2(e)/sqrt(HEAD_DIM)"), all_heads(1.0 / math.sqrt(d))),
        ]
        hint = diagnose(got, mistakes, truth=truth)
        if hint is None and bad.any() and tail:
            hint = ("load k and v with mask=keys[:, None] < N_K and other=0.0: past N_K lies memory that is not this "
                    "head's (here NaN), and even with its score at -inf, p = 0 times a NaN value is NaN in p @ v")
        elif hint is None and bad.any():
            hint = ("subtract the running max before exp2, p = exp2(s - m_new[:, None]) with m_new = "
                    "max(m_i, max of the tile's scores): scores in the hundreds overflow")
        return report.fail(line, hint)


# ---- 06.5 the causal mask, tile by tile ----------------------------------------------------------

KINDS = ("full", "masked", "skipped")


def causal_tile_truth(q0: int, k0: int, block_m: int, block_n: int) -> str:
    """Queries q0 .. q0+block_m-1 against keys k0 .. k0+block_n-1, query i seeing keys j <= i."""
    if k0 + block_n - 1 <= q0:
        return "full"      # the last key is seen by the first query, so by every query
    if k0 > q0 + block_m - 1:
        return "skipped"   # the first key comes after the last query
    return "masked"


def key_range_truth(start_m: int, block_m: int, block_n: int, n_k: int) -> tuple[int, int]:
    """(n_full, n_end) of query tile start_m: the chapter's kernels compute it with this same helper."""
    from ..attention import causal_key_range

    return causal_key_range.fn(start_m * block_m, n_k, block_m, block_n)


def _tile_cases(rng):
    cases = [(0, 0, 4, 4), (8, 5, 4, 4), (8, 4, 4, 4), (8, 11, 4, 4), (8, 12, 4, 4), (8, 9, 4, 4),
             (64, 0, 64, 64), (64, 64, 64, 64), (64, 128, 64, 64), (128, 64, 128, 64), (128, 192, 128, 64),
             (128, 256, 128, 64), (0, 0, 1, 1), (3, 3, 1, 1), (3, 4, 1, 1), (10, 0, 3, 11), (10, 1, 3, 11)]
    for _ in range(60):
        bm, bn = int(rng.choice([1, 2, 3, 16, 32, 64, 128])), int(rng.choice([1, 5, 16, 32, 64, 128]))
        q0 = int(rng.integers(0, 400))
        k0 = int(q0 + rng.integers(-2 * bn - 2, bm + 3))
        cases.append((q0, max(0, k0), bm, bn))
    return cases


def _range_cases(rng):
    out = []
    for bm, bn in ((64, 64), (128, 64), (64, 128), (32, 16), (3, 4), (5, 2), (16, 1), (48, 32)):
        for n_k in (1, 7, bn, 3 * bn, 3 * bn + 5, 200, 1000):
            for start_m in range(0, 9):
                out.append((start_m, bm, bn, n_k))
    for _ in range(60):  # and tiles and sizes drawn on every run, so that a table of answers cannot pass
        bm, bn, n_k = int(rng.integers(1, 160)), int(rng.integers(1, 160)), int(rng.integers(1, 3000))
        out.append((int(rng.integers(0, n_k // bm + 3)), bm, bn, n_k))
    return out


def _tiles(lo: int, hi: int, bn: int) -> list[int]:
    return list(range(lo, hi, bn))


@exercise("06.5", "causal masking: which tiles", names=("causal_tile", "key_range"), time_limit_s=60)
def grade_causal(report: Report, causal_tile, key_range):
    rng = fresh_rng(report)  # tiles and sizes drawn fresh on every run
    wrong_hints = [
        (lambda q0, k0, bm, bn: "skipped" if k0 >= q0 + bm - 1 else causal_tile_truth(q0, k0, bm, bn),
         "key q0 + block_m - 1 is seen by the last query: j <= i includes the diagonal, so a tile is skipped only "
         "when its first key comes after the last query, k0 > q0 + block_m - 1"),
        (lambda q0, k0, bm, bn: "full" if k0 + bn - 1 < q0 else
         causal_tile_truth(q0, k0, bm, bn).replace("full", "masked"),
         "a tile whose last key is q0 needs no mask: the first query sees keys j <= q0, so it is full when "
         "k0 + block_n - 1 <= q0"),
        (lambda q0, k0, bm, bn: {"full": "skipped", "skipped": "full"}.get(causal_tile_truth(q0, k0, bm, bn), "masked"),
         "query i sees keys j <= i: the keys *before* the queries are the full tiles, the ones after are skipped"),
        (lambda q0, k0, bm, bn: "full" if k0 + bn <= q0 else ("skipped" if k0 >= q0 + bm else "masked"),
         "a tile is full when its last key k0 + block_n - 1 is <= q0 (not <), and skipped when its first key is "
         "after the last query, k0 > q0 + block_m - 1"),
    ]
    cases = _tile_cases(rng)
    for q0, k0, bm, bn in cases:
        asked = f"causal_tile({q0}, {k0}, {bm}, {bn})"
        got = call(report, asked, causal_tile, q0, k0, bm, bn)
        want = causal_tile_truth(q0, k0, bm, bn)
        if got == want:
            continue
        if got not in KINDS:
            return report.fail(f"{asked} returned {got!r}: return one of 'full', 'masked', 'skipped'")
        hint = None
        for fn, h in wrong_hints:
            if all(str(guarded(report, "", causal_tile, *c)) == fn(*c) for c in cases[:40]):
                hint = h
                break
        return report.fail(f"{asked} returned {got!r}, expected {want!r} (queries {q0}..{q0 + bm - 1}, keys "
                             f"{k0}..{k0 + bn - 1})", hint or "query i sees key j when j <= i: compare the tile's "
                                                                "first and last key with its first and last query")
    report.ok(f"causal_tile: all {len(cases)} tiles classified (full, masked, skipped)")

    range_hints = [
        (lambda s, bm, bn, nk: (key_range_truth(s, bm, bn, nk)[0], nk),
         "with a causal mask the keys after the tile's last query are never needed: stop at min(q0 + block_m, n_k), "
         "which skips every tile above the diagonal"),
        (lambda s, bm, bn, nk: (key_range_truth(s, bm, bn, nk)[0], min(s * bm + bm - 1, nk)),
         "the tile's last query, q0 + block_m - 1, sees its own key: the range ends at q0 + block_m (exclusive)"),
        (lambda s, bm, bn, nk: (min(s * bm // bn * bn, nk // bn * bn), key_range_truth(s, bm, bn, nk)[1]),
         "a tile whose last key is q0 is still full: n_full = (q0 + 1) // block_n * block_n"),
        (lambda s, bm, bn, nk: ((s * bm + 1) // bn * bn, key_range_truth(s, bm, bn, nk)[1]),
         "tiles that reach past n_k need the mask too (the last, partial one): n_full is at most "
         "(n_k // block_n) * block_n"),
        (lambda s, bm, bn, nk: (0, key_range_truth(s, bm, bn, nk)[1]),
         "tiles entirely below the diagonal need no mask: n_full is the start of the first tile that crosses it"),
    ]
    cases = _range_cases(rng)
    for start_m, bm, bn, n_k in cases:
        asked = f"key_range({start_m}, {bm}, {bn}, {n_k})"
        got = call(report, asked, key_range, start_m, bm, bn, n_k)
        got = as_tuple(report, asked, got, 2)
        if got is None:
            return
        try:
            n_full, n_end = int(got[0]), int(got[1])
        except (TypeError, ValueError):
            return report.fail(f"{asked} returned {got!r}: return two ints (n_full, n_end)")
        want = key_range_truth(start_m, bm, bn, n_k)
        # what a kernel does with them: unmasked tiles from 0 to n_full, masked tiles from n_full to n_end
        if (_tiles(0, n_full, bn), _tiles(n_full, n_end, bn)) == (_tiles(0, want[0], bn), _tiles(want[0], want[1], bn)):
            continue
        hint = None
        for fn, h in range_hints:
            w = fn(start_m, bm, bn, n_k)
            if (_tiles(0, w[0], bn), _tiles(w[0], w[1], bn)) == (_tiles(0, n_full, bn), _tiles(n_full, n_end, bn)):
                hint = h
                break
        if hint is None and n_full % bn:
            hint = "n_full is where the masked tiles start: a multiple of block_n"
        q0 = start_m * bm
        return report.fail(f"{asked} returned ({n_full}, {n_end}), expected {want} (queries {q0}..{q0 + bm - 1})",
                     hint or "n_full: the end of the whole tiles whose last key is <= q0; "
                             "n_end: min(q0 + block_m, n_k)")
    report.ok(f"key_range: all {len(cases)} query tiles get the right unmasked, masked and skipped tiles")


# ---- 06.6 the log-sum-exp from the kernel's base-2 state ----------------------------------------


def _state_rows(rng):
    """Rows of scaled scores s: small, ±1000, all below -1000, one score; with the kernel's base-2
    state (m2, l2) computed from them in float64 and rounded to float32."""
    rows = [_rand(rng, 30), _rand(rng, 30, 400.0), -np.abs(_rand(rng, 30, 10.0)) - 1000.0,
            _rand(rng, 1) * 50, _rand(rng, 30, 3.0) + 700.0]
    n = max(len(r) for r in rows)
    s = np.full((len(rows), n), -np.inf)
    for i, r in enumerate(rows):
        s[i, :len(r)] = r
    s2 = s * LOG2E
    m2 = s2.max(axis=1)
    l2 = np.exp2(s2 - m2[:, None]).sum(axis=1)
    return s, exact_f32(m2), exact_f32(l2)


@exercise("06.6", "the log-sum-exp, for the backward pass", names=("lse_from_state", "probs_from_lse"),
          time_limit_s=60)
def grade_lse(report: Report, lse_from_state, probs_from_lse):
    import torch

    base = int(fresh_rng(report).integers(1 << 30))  # values drawn fresh on every run
    for seed in (0, 1, 2):
        rng = np.random.default_rng(base + seed)
        s, m2, l2 = _state_rows(rng)
        truth = m2 * LN2 + np.log(l2)   # exactly what the float32 state encodes, in float64
        what = f"{len(m2)} rows (scores from -1000 to 1000), seed {seed}"
        got = call(report, f"lse_from_state, {what}", lse_from_state,
                      torch.tensor(m2, dtype=torch.float32), torch.tensor(l2, dtype=torch.float32))
        if got is None:
            return report.fail("lse_from_state returned None: did you forget `return`?")
        tm, tl_ = torch.tensor(m2, dtype=torch.float32), torch.tensor(l2, dtype=torch.float32)
        ref = to_numpy(tm * LN2 + torch.log(tl_)).astype(np.float64)
        ok, line = _check(got, truth, ref, what=f"lse_from_state, {what}", floor=8)
        if not ok:
            mistakes = [("the state is in base 2: lse = (m2 + log2(l2)) · ln 2; you returned m2 + log2(l2), "
                         "the base-2 log-sum-exp", m2 + np.log2(l2)),
                        ("m2 is in base-2 units too: multiply it by ln 2 (lse = m2 · ln 2 + ln l2)", m2 + np.log(l2)),
                        ("l2 sums powers of 2: ln l2 = log2(l2) · ln 2, or use torch.log(l2) directly",
                         m2 * LN2 + np.log2(l2)),
                        ("add the max back: lse = (m2 + log2(l2)) · ln 2", np.log(l2)),
                        ("divide by log2(e), or multiply by ln 2: lse = (m2 + log2 l2) · ln 2, not · log2(e)",
                         (m2 + np.log2(l2)) * LOG2E),
                        ("take the log of l2: lse = (m2 + log2(l2)) · ln 2", (m2 + l2) * LN2)]
            return report.fail(line, diagnose(got, mistakes, truth=truth))
        report.ok(line)

    # probs_from_lse: recompute one tile of P from q, k and the saved lse, as the backward pass does
    for i, (n_q, n_k, d, ls) in enumerate([(8, 16, 8, 1.0), (5, 33, 16, 300.0), (2, 7, 4, 1.0)]):
        rng = np.random.default_rng(base + 50 + i)
        q, k, _ = _attention_inputs(rng, n_q, n_k, d, ls)
        scale = _drawn_scale(rng, d)  # drawn: P must use the sm_scale it is given
        s = q @ k.T * scale
        lse = s.max(axis=1) + np.log(np.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1))
        # Every other row gets an lse a little off the true one (as saved from slightly different scores):
        # P must come from the lse given, so a softmax computed afresh from the scores does not match there.
        lse32 = exact_f32(lse + np.where(np.arange(n_q) % 2 == 1, rng.uniform(0.1, 0.7, n_q), 0.0))
        truth = np.exp(s - lse32[:, None])
        tq, tk = torch.tensor(q, dtype=torch.float32), torch.tensor(k, dtype=torch.float32)
        what = f"probs_from_lse, N_Q={n_q}, N_K={n_k}, d={d}" + (", large logits" if ls > 10 else "")
        got = call(report, what, probs_from_lse, tq, tk, torch.tensor(lse32, dtype=torch.float32), scale)
        if got is None:
            return report.fail(f"{what}: returned None: did you forget `return`?")
        ref = to_numpy(torch.exp(tq @ tk.T * scale - torch.tensor(lse32, dtype=torch.float32)[:, None]))
        ref = ref.astype(np.float64)
        ok, line = _check(got, truth, ref, what=what)
        if not ok:
            mistakes = [("scale the scores first: P = exp(q kᵀ · sm_scale - lse)", np.exp(q @ k.T - lse32[:, None])),
                        (_own_scale_hint("sm_scale", scale, "1/sqrt(d)"),
                         np.exp(q @ k.T / math.sqrt(d) - lse32[:, None])),
                        ("lse is a natural log: P = exp(s - lse), not exp2", np.exp2(s - lse32[:, None])),
                        ("subtract each row's own lse: lse[:, None], one per query row", np.exp(s - lse32[None, :n_k])
                         if n_k <= n_q else None),
                        ("P = exp(s - lse) with the lse given: no max and no sum of your own (the grader gives some "
                         "rows an lse that is not theirs, and a softmax computed afresh misses it)",
                         np.exp(s - s.max(axis=1, keepdims=True)) / np.exp(s - s.max(axis=1, keepdims=True)).sum(
                             axis=1, keepdims=True)),
                        ("P = exp(s - lse): no further normalisation, no max (lse already holds both)",
                         np.exp(s - s.max(axis=1, keepdims=True)))]
            return report.fail(line, diagnose(got, mistakes, truth=truth))
        report.ok(line)


# ---- 06.7 the causal part of the kernel, in Triton ------------------------------------------------


def _causal_inputs(heads, n_q, n_k, d, bm, bn, dtype, logit_scale, seed):
    """q, k, v on the device framed by NaN (so a load past the end shows), o framed by poison; and the
    softmax scale, drawn (a kernel must use the qk_scale it is given)."""
    rng = np.random.default_rng(6700 + seed)
    qkv = [_attention_inputs(rng, n_q, n_k, d, logit_scale) for _ in range(heads)]
    _, tq = framed(np.stack([x[0] for x in qkv]), dtype, NAN, pad_rows=bm)
    _, tk = framed(np.stack([x[1] for x in qkv]), dtype, NAN, pad_rows=bn)
    _, tv = framed(np.stack([x[2] for x in qkv]), dtype, NAN, pad_rows=bn)
    _, to = framed(np.zeros((heads, n_q, d)), dtype, NAN, pad_rows=bm)
    to.fill_(POISON if dtype == "fp32" else HALF_POISON)
    return tq, tk, tv, to, _drawn_scale(rng, d)


def _launch_causal(report, what, kernel, tq, tk, tv, to, bm, bn, scale, **meta) -> bool:
    heads, n_q, d = tq.shape
    return launch(report, what, kernel, (-(-n_q // bm), heads), tq, tk, tv, to, scale * LOG2E,
                  tq.stride(0), tk.stride(0), n_q, tk.shape[1], HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, **meta)


def _grade_causal_case(report: Report, kernel, case) -> bool:
    """Launch the learner's causal kernel on one case and compare with float64; record one line."""
    import torch

    heads, n_q, n_k, d, bm, bn, dtype, ls, seed = case
    tq, tk, tv, to, scale = _causal_inputs(*case)
    what = (f"{heads} head{'s' if heads > 1 else ''}, N_Q={n_q}, N_K={n_k}, d={d}, BLOCK_M={bm}, BLOCK_N={bn}, "
            f"{dtype}{', large logits' if ls > 10 else ''}")
    if not _launch_causal(report, what, kernel, tq, tk, tv, to, bm, bn, scale):
        return False
    poison = np.float32(POISON if dtype == "fp32" else HALF_POISON)
    got = to_numpy(to.float() if dtype != "fp32" else to)
    qs, ks, vs = (to_numpy(t.float()).astype(np.float64) for t in (tq, tk, tv))
    truth = np.stack([attention64(qs[h], ks[h], vs[h], scale, causal=True)[0] for h in range(heads)])
    keep = np.tril(np.ones((n_q, n_k), dtype=bool))
    ref = to_numpy((torch.softmax((tq @ tk.transpose(-2, -1) * scale).masked_fill(
        ~torch.from_numpy(keep).to(tq.device), float("-inf")), dim=-1) @ tv).float()).astype(np.float64)
    if (got == poison).all():
        report.fail(f"{what}: no output was written: is the causal part still a stub?")
        return False
    if np.isnan(got).all():
        report.fail(f"{what}: every output is NaN: o = acc / l_i is 0 / 0 when no key tile is folded into the state "
                    "(is the causal part still a stub?)")
        return False
    eps = float(np.finfo(np.float32 if dtype == "fp32" else np.float16).eps)
    ok, line = compare(got, truth, ref, what=what, rtol_floor=(256 if dtype == "fp32" else 4) * eps)
    if ok:
        report.ok(line)
        return True
    hint = _head_hint(got, truth, ref, (256 if dtype == "fp32" else 4) * eps,
                      "q_ptr + h * stride_qh and o_ptr + h * stride_qh, k_ptr + h * stride_kh and v_ptr + h * stride_kh")
    if hint is None and "never written" in line:
        hint = (f"program start_m handles the BLOCK_M queries from q0 = start_m * BLOCK_M: use the BLOCK_M the launch "
                f"passes (here {bm}: the grader varies it), not a number of your own")
    if hint is not None:
        report.fail(line, hint)
        return False
    rows, cols = np.arange(n_q)[:, None], np.arange(n_k)[None, :]

    def masked(keep_mask):
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.stack([attention64(qs[h], ks[h], vs[h], scale, keep=keep_mask)[0] for h in range(heads)])

    q_tiles = rows // bm * bm                                   # the first query of each row's tile
    from ..attention import causal_key_range

    n_full_of_row = np.array([causal_key_range.fn(int(q0), n_k, bm, bn)[0] for q0 in q_tiles[:, 0]])[:, None]
    n_end_of_row = np.minimum(q_tiles + bm, n_k)
    loaded = n_full_of_row + -(-(n_end_of_row - n_full_of_row) // bn) * bn   # the masked tiles end on a tile boundary
    bottom_right = ("the mask is top-left, as SDPA's is_causal: query i sees keys j <= i, not j <= i + N_K - N_Q "
                    "(bottom-right, the KV-cache convention)" if n_q != n_k else None)
    past = int(loaded.max()) - n_k   # keys past N_K in the last masked tile: loaded as 0, scored 0 if not dropped
    if past > 0:
        zeros, cols_x = np.zeros((past, d)), np.arange(n_k + past)[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            scored_zero = np.stack([attention64(qs[h], np.vstack([ks[h], zeros]), np.vstack([vs[h], zeros]), scale,
                                                keep=(cols_x < loaded) & (cols_x <= rows))[0] for h in range(heads)])
    mistakes = [
        ("keys past N_K were loaded as 0 and scored 0, so they took a share of the softmax (the rows past N_K see "
         "them): mask their scores too, keep = (keys[None, :] < N_K) & (keys[None, :] <= offs_m[:, None])",
         scored_zero if past > 0 else None),
        (_own_scale_hint("qk_scale", scale * LOG2E, "log2(e)/sqrt(HEAD_DIM)"),
         np.stack([attention64(qs[h], ks[h], vs[h], 1.0 / math.sqrt(d), causal=True)[0] for h in range(heads)])),
        (bottom_right, masked((cols < n_full_of_row) | ((cols < loaded) & (cols <= rows + n_k - n_q)))),
        ("the tiles that cross the diagonal need the causal mask too: keep = keys[None, :] <= offs_m[:, None]",
         masked(np.broadcast_to(cols < loaded, (n_q, n_k)))),
        ("query i sees key i itself: the mask is keys <= offs_m (j <= i), not j < i", masked(cols < rows)),
        (bottom_right, masked(cols <= rows + n_k - n_q)),
        ("every query of the tile must see the keys up to itself: the masked tiles run up to "
         "min(q0 + BLOCK_M, N_K), not to q0", masked((cols <= rows) & (cols < np.maximum(q_tiles, 1)))),
        ("after the whole tiles, loop over the masked ones, from n_full to n_end = min(q0 + BLOCK_M, N_K): "
         "the tiles that cross the diagonal were not computed", masked(cols < n_full_of_row)),
    ]
    hint = diagnose(got, [(h, w) for h, w in mistakes if h is not None], truth=truth)
    if hint is None and not np.isfinite(got).all() and n_k % bn:
        hint = ("load the masked tiles' k and v with mask=keys[:, None] < N_K and other=0.0 and drop keys past N_K "
                "from the softmax: past N_K lies memory that is not this head's (here NaN)")
    elif hint is None and not np.isfinite(got).all():
        hint = ("a row whose scores are all -inf gives NaN: every query sees key 0, so the first tile must always "
                "be computed, and masked scores are -inf only where j > i")
    report.fail(line, hint)
    return False


def _causal_cases(gpu: bool) -> list[tuple]:
    """(heads, N_Q, N_K, d, BLOCK_M, BLOCK_N, dtype, logit scale, seed) for the causal kernel."""
    cases = [(2, 64, 64, 16, 16, 16, "fp32", 1.0, 0),      # whole tiles
             (2, 45, 45, 32, 16, 16, "fp32", 1.0, 1),      # partial tiles
             (1, 40, 77, 16, 16, 32, "fp32", 30.0, 2),     # N_Q < N_K, BLOCK_N > BLOCK_M
             (1, 77, 40, 16, 32, 16, "fp32", 30.0, 3),     # N_Q > N_K: rows past N_K see every key
             (1, 48, 48, 32, 16, 16, "fp32", 300.0, 4),    # scores of ±1000
             (2, 50, 50, 16, 32, 32, "fp16", 1.0, 5)]
    if gpu:  # tl.dot on float32 is TF32 on a GPU: half precision there, and larger sizes
        cases = [(h, nq, nk, d, bm, bn, "fp16", ls, s) for h, nq, nk, d, bm, bn, _, ls, s in cases]
        cases += [(4, 1000, 1000, 64, 64, 64, "fp16", 30.0, 6), (2, 300, 1000, 128, 64, 32, "fp16", 1.0, 7),
                  (2, 1000, 300, 64, 128, 64, "fp16", 1.0, 8)]
    return cases


@exercise("06.7", "the causal part of the kernel, in Triton", names=("causal_attention_kernel",), time_limit_s=180)
def grade_causal_kernel(report: Report, causal_attention_kernel):
    if (msg := not_a_kernel(causal_attention_kernel, "causal_attention_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    # the statement's boundaries: a last query tile that holds one query (it starts at the last query), and
    # N_K not a multiple of BLOCK_N, also below N_Q, where the keys past N_K are not above the diagonal (with
    # scores near 0, where a key scored 0 takes a visible share); values and the softmax scale drawn fresh
    half = "fp16" if world().gpu else "fp32"  # tl.dot on float32 is TF32 on a GPU
    cases = _causal_cases(world().gpu) + [(1, 49, 49, 16, 16, 16, half, 1.0, 0), (1, 33, 53, 16, 32, 16, half, 3.0, 0),
                                          (1, 45, 27, 16, 16, 16, half, 1.0, 0)]  # rows past N_K see a partial tile
    for case in cases:
        case = (*case[:-1], int(rng.integers(1 << 30)))
        if not _grade_causal_case(report, causal_attention_kernel, case):
            return


# ---- 06.8 the causal kernel, graded on speed -------------------------------------------------------

# The speed check: (heads, N, d) in float16, tiles and launch options given to both kernels. On a GPU,
# the learner's kernel must run at least SPEEDUP_VS_V1 times as fast as the chapter's version 1, which
# computes every key tile and masks each of them, on the same tiles. Skipping the tiles above the
# diagonal halves the work (at N = 4096 with 64 x 64 tiles, 2,080 of 4,096 tiles are computed), and
# leaving the mask off the tiles below it saves more; a kernel that computes every tile gets about 1x.
SPEED_SHAPE = (16, 4096, 64)
SPEED_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}   # fits a T4's 64 KB
SPEEDUP_VS_V1 = 1.3
CAUSAL_SHAPE = (64, 4096, 64)  # the causal run against the full one: 4,096 programs (see below)
CAUSAL_VS_FULL = 0.75  # the causal run's time over the same kernel's time with every key visible (see below)


@exercise("06.8", "the causal kernel, graded on speed", names=("causal_attention_kernel",), time_limit_s=240)
def grade_causal_speed(report: Report, causal_attention_kernel):
    import torch

    from ..attention import flash_attention_v1_kernel
    from . import speed_vs_peer

    if (msg := not_a_kernel(causal_attention_kernel, "causal_attention_kernel")):
        return report.fail(msg)
    gpu = world().gpu
    # correct first, on one case (a wrong kernel can be fast)
    if not _grade_causal_case(report, causal_attention_kernel, _causal_cases(gpu)[1 if not gpu else -3]):
        return
    if not gpu:
        return speed_vs_peer(report, "the causal kernel", None, None, "the chapter's version 1", SPEEDUP_VS_V1)
    heads, n, d = SPEED_SHAPE
    g = torch.Generator(device="cuda").manual_seed(68)
    q, k, v = (torch.randn(heads, n, d, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
    o, o1 = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(heads, n, device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    meta = dict(HEAD_DIM=d, **SPEED_TILES)
    grid = (n // SPEED_TILES["BLOCK_M"], heads)

    def learner():
        causal_attention_kernel[grid](q, k, v, o, scale * LOG2E, q.stride(0), k.stride(0), n, n, **meta)

    def version_1():  # the chapter's v1 kernel: every key tile computed, every tile masked
        flash_attention_v1_kernel[grid](q, k, v, o1, lse, scale, n, n, CAUSAL=True, **meta)

    try:
        learner()
        version_1()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the learner's kernel at the timed size
        return report.fail(f"the causal kernel at (heads, N, d) = {SPEED_SHAPE}: {type(exc).__name__}: {exc}"[:300])
    err = (o.float() - o1.float()).abs().max().item()
    if not err < 2e-2:
        return report.fail(f"the causal kernel at (heads, N, d) = {SPEED_SHAPE}: differs from version 1 by {err:.3g}")
    ok = speed_vs_peer(report, f"the causal kernel at (heads, N, d) = {SPEED_SHAPE}, fp16", learner, version_1,
                       "the chapter's version 1 (every tile computed and masked)", SPEEDUP_VS_V1)
    if ok is False:
        report.fail("skip the key tiles past min(q0 + BLOCK_M, N_K), which no query of the tile sees, and leave the "
                    "mask off the whole tiles below the diagonal: a kernel that computes every tile runs at about "
                    "the speed of version 1")
    # Against the same kernel with every key visible, timed now: launched on 2N queries and N keys, queries
    # N .. 2N - 1 see every key (no tile skipped, none masked), so that run's time minus the causal run's is
    # the kernel's non-causal time on N queries. Skipping the upper triangle computes 2,080 of 4,096 tiles
    # (0.51x of the work), but a causal launch's programs differ in length and the longest (the last query
    # tiles) start last: with SPEED_SHAPE's 1,024 programs an H100 then waits on a few of them, and a kernel
    # that skips every tile it should measured 0.86x with wgmma and 0.76x with mma.sync. CAUSAL_SHAPE's 64
    # heads make 4,096 programs, over which that tail spreads thin (a list-scheduling model puts a skipping
    # kernel near 0.6x, for 2 to 4 programs per SM); CAUSAL_VS_FULL = 0.75 leaves room for the masked diagonal
    # tiles and timing noise, while a kernel that computes every tile under a mask takes about 1x (and
    # version 1's speed, which a faster inner loop can beat by 1.3x without skipping anything, does not enter).
    from .speed import _median_ms

    heads, n, d = CAUSAL_SHAPE
    cq, ck, cv = (torch.randn(heads, n, d, device="cuda", generator=g, dtype=torch.float16) for _ in range(3))
    co, cq2 = torch.empty_like(cq), torch.cat([cq, cq], dim=1)
    co2 = torch.empty_like(cq2)

    def learner_causal():
        causal_attention_kernel[(n // SPEED_TILES["BLOCK_M"], heads)](
            cq, ck, cv, co, scale * LOG2E, cq.stride(0), ck.stride(0), n, n, **meta)

    def learner_full():
        causal_attention_kernel[(2 * n // SPEED_TILES["BLOCK_M"], heads)](
            cq2, ck, cv, co2, scale * LOG2E, cq2.stride(0), ck.stride(0), 2 * n, n, **meta)

    what = f"the causal kernel at (heads, N, d) = {CAUSAL_SHAPE}, against its own run with every key visible"
    causal_ms, both_ms = _median_ms(report, what, learner_causal), _median_ms(report, what, learner_full)
    if causal_ms is None or both_ms is None:
        return
    full_ms = both_ms - causal_ms
    if full_ms <= 0:
        return report.fail(f"{what}: {both_ms:.3f} ms for 2N queries, {causal_ms:.3f} ms for the causal N: a "
                           "measurement error (the run with more work was not slower); run the grader again")
    ratio = causal_ms / full_ms
    report.expect(ratio <= CAUSAL_VS_FULL,
                  f"{what}: causal {causal_ms:.3f} ms, every key {full_ms:.3f} ms: {ratio:.2f}x "
                  f"(needs at most {CAUSAL_VS_FULL:g}x)",
                  f"{what}: causal {causal_ms:.3f} ms, every key {full_ms:.3f} ms: {ratio:.2f}x, needs at most "
                  f"{CAUSAL_VS_FULL:g}x: a causal run does about half the work; the key tiles past the diagonal "
                  "must not be computed at all (masking them still costs their matmuls): loop over the keys "
                  "up to min(q0 + BLOCK_M, N_K) only")
