"""Chapter 06's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted. Kernels run in Triton's interpreter on the CPU."""
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernelcourse as kc
from tests.helpers import grade, memorised


def address_case(kernel, hint):
    """A wrong kernel that only the interpreter's address check names (skipped on a GPU)."""
    return pytest.param(kernel, hint, marks=pytest.mark.skipif(
        kc.world().gpu, reason="the address check runs in Triton's interpreter; on a GPU this kernel touches memory "
                               "outside its tensors (compute-sanitizer names it) and may take the process down"))


def copied_run(monkeypatch, exercise, name, correct, key, others=None, walk=lambda *args: args):
    """Grade a correct function that records its answers (keyed by ``key`` of its arguments) on one run, then
    a table of them, answering every question it has not seen with one of its answers, on the same run's
    cases (it passes) and on another run's (it must fail): what a learner who copied a run's output submits.
    ``walk`` turns the arguments into what ``key`` and ``correct`` take (a stream that can be read once)."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    others, table = others or {}, {}

    def recording(*args):
        args = walk(*args)
        table[key(*args)] = correct(*args)
        return table[key(*args)]

    def copied(*args):
        return table.get(key(*walk(*args)), next(iter(table.values())))

    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade(exercise, **{name: recording}, **others)[0]
    same = grade(exercise, **{name: copied}, **others)
    assert same[0], same[1]  # the same run's cases: the copy answers them
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    return grade(exercise, **{name: copied}, **others)


# ---- 06.1 combine split-KV partial results -------------------------------------------------------


def combine_ok(outs, lses):
    w = torch.softmax(lses, dim=0)                      # exp(lse_s - logsumexp) in one call
    return (w[..., None] * outs).sum(dim=0), torch.logsumexp(lses, dim=0)


def combine_ok_pairwise(outs, lses):  # merge the splits one after another, in float64
    o, lse = outs[0].double(), lses[0].double()
    for o_s, l_s in zip(outs[1:].double(), lses[1:].double()):
        new = torch.logaddexp(lse, l_s)
        o = torch.exp(lse - new)[:, None] * o + torch.exp(l_s - new)[:, None] * o_s
        lse = new
    return o, lse


def combine_mean(outs, lses):
    return outs.mean(dim=0), torch.logsumexp(lses, dim=0)


def combine_unnormalised(outs, lses):
    m = lses.max(dim=0).values
    w = torch.exp(lses - m)
    return (w[..., None] * outs).sum(dim=0), m + torch.log(w.sum(dim=0))


def combine_naive_exp(outs, lses):
    w = torch.exp(lses)
    return (w[..., None] * outs).sum(dim=0) / w.sum(dim=0)[:, None], torch.log(w.sum(dim=0))


def combine_max_lse(outs, lses):
    return combine_ok(outs, lses)[0], lses.max(dim=0).values


def combine_forgot_max(outs, lses):
    m = lses.max(dim=0).values
    w = torch.exp(lses - m)
    return (w[..., None] * outs).sum(dim=0) / w.sum(dim=0)[:, None], torch.log(w.sum(dim=0))


def combine_running(outs, lses, guard=False):
    """The splits folded in one at a time, as a kernel folds its tiles: a running max, sum and output."""
    m, l = torch.full(lses.shape[1:], float("-inf")), torch.zeros(lses.shape[1:])
    acc = torch.zeros(outs.shape[1:])
    for o_s, lse_s in zip(outs, lses):
        m_new = torch.maximum(m, lse_s)
        if guard:  # while every split so far is empty, the max is -inf: subtract 0 instead
            m_new = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha, w = torch.exp(m - m_new), torch.exp(lse_s - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l = l * alpha + w
        m = torch.maximum(m, lse_s)
    return acc / l[:, None], m + torch.log(l)


@pytest.mark.parametrize("fn", [combine_ok, combine_ok_pairwise, lambda outs, lses: combine_running(outs, lses, True)])
def test_06_1_accepts_correct(fn):
    passed, text = grade("06.1", combine_splits=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (combine_mean, "a plain average treats every split alike"),
    (combine_unnormalised, "divide by their sum"),
    (combine_naive_exp, "subtract the largest lse first"),
    (combine_max_lse, "not the largest lse"),
    (combine_forgot_max, "the max goes back in"),
    (lambda outs, lses: None, "forget `return`"),
    # exp(-inf - (-inf)) when the first split is empty: NaN in that row
    (combine_running, "the first split is empty (lse = -inf): a running max started at -inf is still -inf there"),
])
def test_06_1_rejects_wrong(fn, hint):
    passed, text = grade("06.1", combine_splits=fn)
    assert not passed
    assert hint in text, text


def test_06_1_draws_its_values_on_every_run(monkeypatch):
    passed, text = copied_run(monkeypatch, "06.1", "combine_splits", combine_ok,
                              lambda outs, lses: lses.numpy().tobytes())
    assert not passed and "KC_GRADE_SEED=22" in text, text


# ---- 06.2 one-pass softmax statistics -------------------------------------------------------------


def stats_ok(blocks):
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for x in blocks:
        m_new = torch.maximum(m, x.max())
        l = l * torch.exp(m - m_new) + torch.exp(x - m_new).sum()
        m = m_new
    return m, l


def stats_ok_logaddexp(blocks):  # a running log-sum-exp in float64, converted at the end
    lse, m = -math.inf, -math.inf
    for x in blocks:
        x = x.double()
        lse = float(torch.logaddexp(torch.tensor(lse, dtype=torch.float64), torch.logsumexp(x, 0)))
        m = max(m, float(x.max()))
    return m, math.exp(lse - m)


def stats_no_rescale(blocks):
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for x in blocks:
        m = torch.maximum(m, x.max())
        l = l + torch.exp(x - m).sum()
    return m, l


def stats_no_max(blocks):
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for x in blocks:
        m = torch.maximum(m, x.max())
        l = l + torch.exp(x).sum()
    return m, l


def stats_inverted(blocks):
    m, l = torch.tensor(float("-inf")), torch.tensor(0.0)
    for x in blocks:
        m_new = torch.maximum(m, x.max())
        factor = torch.exp(m_new - m) if torch.isfinite(m) else torch.tensor(0.0)
        l = l * factor + torch.exp(x - m_new).sum()
        m = m_new
    return m, l


def stats_first_max(blocks):
    m, l = None, torch.tensor(0.0)
    for x in blocks:
        m = x.max() if m is None else m
        l = l + torch.exp(x - m).sum()
    return m, l


def stats_two_passes(blocks):
    xs = list(blocks)
    m = max(float(x.max()) for x in blocks)  # walks the blocks a second time
    return m, sum(float(torch.exp(x - m).sum()) for x in xs)


def stats_max_from_zero(blocks):  # the running max started at 0: a row below 0 underflows
    m, l = torch.tensor(0.0), torch.tensor(0.0)
    for x in blocks:
        m_new = torch.maximum(m, x.max())
        l = l * torch.exp(m - m_new) + torch.exp(x - m_new).sum()
        m = m_new
    return m, l


def stats_whole_row(blocks):  # one pass over the blocks, but the whole row held at once
    x = torch.cat(list(blocks))
    return x.max(), torch.exp(x - x.max()).sum()


@pytest.mark.parametrize("fn", [stats_ok, stats_ok_logaddexp])
def test_06_2_accepts_correct(fn):
    passed, text = grade("06.2", online_softmax_stats=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (stats_no_rescale, "rescale the running sum"),
    (stats_no_max, "subtract the running max before exp"),
    (stats_inverted, "exp(m_old - m_new), at most 1"),
    (stats_first_max, "not the first block's"),
    (stats_two_passes, "only once"),
    (stats_max_from_zero, "start the running max at -inf, not 0: on a row whose values are all below 0"),
    (stats_whole_row, "as large as the whole row of 40 values: keep only the running max and sum"),
])
def test_06_2_rejects_wrong(fn, hint):
    passed, text = grade("06.2", online_softmax_stats=fn)
    assert not passed
    assert hint in text, text


def test_06_2_draws_its_values_on_every_run(monkeypatch):
    """The rows' values are drawn on every run: (m, l) copied from one run answer nothing on the next."""
    passed, text = copied_run(monkeypatch, "06.2", "online_softmax_stats", stats_ok,
                              lambda blocks: b"".join(x.numpy().tobytes() for x in blocks),
                              walk=lambda stream: (list(stream),))
    assert not passed and "KC_GRADE_SEED=22" in text, text


# ---- 06.3 tiled attention in PyTorch ---------------------------------------------------------------


def tiled_ok(q, k, v, block_n, causal=False):
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full((q.shape[0],), float("-inf"))
    l = torch.zeros(q.shape[0])
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for n0 in range(0, k.shape[0], block_n):
        s = (q @ k[n0:n0 + block_n].T) * scale
        if causal:
            keys = torch.arange(n0, n0 + s.shape[1])
            s = s.masked_fill(keys[None, :] > torch.arange(q.shape[0])[:, None], float("-inf"))
        m_new = torch.maximum(m, s.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v[n0:n0 + block_n]
        m = m_new
    return acc / l[:, None], m + torch.log(l)


def tiled_ok_normalised_merges(q, k, v, block_n, causal=False):  # a normalised output and its lse per tile
    qs = q / math.sqrt(q.shape[-1])
    o, lse = None, None
    last = q.shape[0] - 1
    for n0 in range(0, min(k.shape[0], last + 1) if causal else k.shape[0], block_n):  # no query sees later keys
        s = qs @ k[n0:n0 + block_n].T
        if causal:
            s = s + torch.where(torch.arange(n0, n0 + s.shape[1])[None, :] <= torch.arange(q.shape[0])[:, None],
                                0.0, float("-inf"))
        lse_t = torch.logsumexp(s, dim=1)
        o_t = torch.softmax(s, dim=1) @ v[n0:n0 + block_n]
        o_t = torch.where(torch.isneginf(lse_t)[:, None], 0.0, o_t)   # a row with every key masked: nothing
        if o is None:
            o, lse = o_t, lse_t
            continue
        new = torch.logaddexp(lse, lse_t)
        o = torch.exp(lse - new)[:, None] * o + torch.exp(lse_t - new)[:, None] * o_t
        lse = new
    return o, lse


def tiled_whole_matrix(q, k, v, block_n, causal=False):
    s = (q @ k.T) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=1) @ v, torch.logsumexp(s, dim=1)


def _variant(no_acc=False, no_l=False, last_tile=True, no_max=False, lse_plain=False, mask=None,
             max_from_zero=False):
    def fn(q, k, v, block_n, causal=False):
        scale = 1.0 / math.sqrt(q.shape[-1])
        m = torch.full((q.shape[0],), 0.0 if no_max or max_from_zero else float("-inf"))
        l = torch.zeros(q.shape[0])
        acc = torch.zeros(q.shape[0], v.shape[-1])
        stop = k.shape[0] if last_tile else (k.shape[0] // block_n) * block_n
        for n0 in range(0, stop, block_n):
            s = (q @ k[n0:n0 + block_n].T) * scale
            if causal and mask is not None:  # the causal mask, right ("ok") or in one of the usual wrong ways
                i, j = torch.arange(q.shape[0])[:, None], torch.arange(n0, n0 + s.shape[1])[None, :]
                if mask == "zero":
                    s = torch.where(j <= i, s, torch.zeros_like(s))
                else:
                    keep = {"strict": j < i, "bottom_right": j <= i + k.shape[0] - q.shape[0], "ok": j <= i}[mask]
                    s = s.masked_fill(~keep, float("-inf"))
            m_new = m if no_max else torch.maximum(m, s.max(dim=1).values)
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            l = (1.0 if no_l else alpha) * l + p.sum(dim=1)
            acc = (1.0 if no_acc else alpha[:, None]) * acc + p @ v[n0:n0 + block_n]
            m = m_new
        return acc / l[:, None], m + (l if lse_plain else torch.log(l))
    return fn


@pytest.mark.parametrize("fn", [tiled_ok, tiled_ok_normalised_merges, _variant(mask="ok")])
def test_06_3_accepts_correct(fn):
    passed, text = grade("06.3", tiled_attention=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (tiled_whole_matrix, "that is the whole score matrix"),
    (_variant(no_acc=True), "rescale acc too"),
    (_variant(no_l=True), "rescale l too"),
    (_variant(no_acc=True, no_l=True), "computed before m is updated"),
    (_variant(last_tile=False), "the last tile of keys is partial"),
    (_variant(no_max=True), "subtract the running max"),
    (_variant(max_from_zero=True, mask="ok"), "start the running max at -inf, not 0: when every score of a row is far below 0"),
    (_variant(lse_plain=True), "not m + l"),
    (_variant(mask="strict"), "not j >= i"),
    (_variant(mask="bottom_right"), "counted from the start of both sequences"),
    (_variant(mask="zero"), "a score of 0 still counts"),
    (_variant(), "query i sees only the keys j <= i"),
])
def test_06_3_rejects_wrong(fn, hint):
    passed, text = grade("06.3", tiled_attention=fn)
    assert not passed
    assert hint in text, text


# ---- 06.4 the Triton inner loop --------------------------------------------------------------------
# One kernel with switches for the typical mistakes, so that each wrong version differs in one place.


@triton.jit
def _inner(q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, stride_qh, stride_kh, stride_vh, stride_oh, N_Q, N_K,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_SCORES: tl.constexpr,
           MASK_LOADS: tl.constexpr, RESCALE_ACC: tl.constexpr, EXP2: tl.constexpr, SUB_MAX: tl.constexpr,
           MAX_FROM_ZERO: tl.constexpr, FIXED_BM: tl.constexpr, PACKED_HEADS: tl.constexpr, OWN_SCALE: tl.constexpr):
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    if FIXED_BM:  # the lesson's 16 query rows a program written in for the program's first row
        offs_m = start_m * 16 + tl.arange(0, BLOCK_M)
    else:
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if PACKED_HEADS:  # heads taken as packed back to back, N rows of HEAD_DIM each, instead of the strides
        stride_qh = N_Q * HEAD_DIM
        stride_kh = N_K * HEAD_DIM
        stride_vh = N_K * HEAD_DIM
        stride_oh = N_Q * HEAD_DIM
    if OWN_SCALE:  # log2(e) / sqrt(d) computed here instead of the qk_scale passed in
        qk_scale = 1.4426950408889634 / tl.sqrt(tl.full([], HEAD_DIM, tl.float32))
    q = tl.load(q_ptr + off_h * stride_qh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < N_Q, other=0.0)
    k_head = k_ptr + off_h * stride_kh
    v_head = v_ptr + off_h * stride_vh
    if MAX_FROM_ZERO:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        keys = start_n + offs_n
        inside = keys < N_K
        if MASK_LOADS:
            k = tl.load(k_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)
        else:
            k = tl.load(k_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_head + keys[:, None] * HEAD_DIM + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASK_SCORES:
            s = tl.where(inside[None, :], s, float("-inf"))
        if SUB_MAX:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        else:
            m_new = tl.zeros([BLOCK_M], dtype=tl.float32)
        if EXP2:
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
        else:
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
        if not SUB_MAX:
            alpha = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        if RESCALE_ACC:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + off_h * stride_oh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < N_Q)


class Variant:
    """_inner with its switches fixed: launched as kernel[grid](...) like the learner's kernel."""

    def __init__(self, **switches):
        self.switches = dict(MASK_SCORES=True, MASK_LOADS=True, RESCALE_ACC=True, EXP2=True, SUB_MAX=True,
                             MAX_FROM_ZERO=False, FIXED_BM=False, PACKED_HEADS=False, OWN_SCALE=False)
        self.switches.update(switches)
        self.fn = _inner.fn

    def __getitem__(self, grid):
        return lambda *args, **meta: _inner[grid](*args, **meta, **self.switches)

    def __call__(self, *args, **kwargs):
        raise TypeError("launch it as kernel[grid](...)")


@triton.jit
def inner_ok_natural_exp(q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, stride_qh, stride_kh, stride_vh, stride_oh, N_Q, N_K,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # base e with the scale undone, K loaded already transposed, the max taken after scaling
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + off_h * stride_qh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < N_Q, other=0.0)
    k_head = k_ptr + off_h * stride_kh
    v_head = v_ptr + off_h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, N_K, BLOCK_N):
        keys = start_n + offs_n
        kt = tl.load(k_head + offs_d[:, None] + keys[None, :] * HEAD_DIM, mask=keys[None, :] < N_K, other=0.0)
        s = tl.dot(q, kt) * (qk_scale * 0.6931471805599453)
        s = s + tl.where(keys[None, :] < N_K, 0.0, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=keys[:, None] < N_K, other=0.0)
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + off_h * stride_oh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < N_Q)


def inner_plain_python(*args, **kwargs):
    pass


@pytest.mark.parametrize("kernel", [Variant(), inner_ok_natural_exp])
def test_06_4_accepts_correct(kernel):
    passed, text = grade("06.4", attention_fwd_kernel=kernel)
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (Variant(MASK_SCORES=False), "set their scores to -inf"),
    address_case(Variant(MASK_LOADS=False), "past the end of `v_ptr`, outside every tensor the kernel was given (it has no mask)"),
    (Variant(RESCALE_ACC=False), "rescale acc too"),
    (Variant(EXP2=False), "qk_scale already holds log2(e)"),
    (Variant(SUB_MAX=False), "subtract the running max before exp2"),
    (Variant(MAX_FROM_ZERO=True), "start m_i at -inf, not 0: when every score of a row is far below 0"),
    (inner_plain_python, "@triton.jit"),
])
def test_06_4_rejects_wrong(kernel, hint):
    passed, text = grade("06.4", attention_fwd_kernel=kernel)
    assert not passed
    assert hint in text, text


def test_06_4_rejects_a_block_m_of_its_own():
    # program start_m starts at query start_m * 16, the lesson's tile: with BLOCK_M = 32, rows go missing
    passed, text = grade("06.4", attention_fwd_kernel=Variant(FIXED_BM=True))
    assert not passed and "use the BLOCK_M the launch passes (here 32: the grader varies it)" in text, text


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_attention_hint_for_a_block_m_of_its_own_in_16_bits(dtype):
    """On a GPU, 06.4 and 06.7 grade in float16 (and bfloat16): the output is poisoned with HALF_POISON and read
    with .float(). The rows a kernel of BLOCK_M 16 never wrote under a launch of 32 hold -32768 there, which must
    read as never written, so that the BLOCK_M hint is given (the CPU's float32 cases cannot show this)."""
    from kernelcourse.grading import ch06
    from kernelcourse.grading.harness import HALF_POISON

    truth = np.random.default_rng(0).standard_normal((1, 100, 16))
    out = torch.from_numpy(truth).to({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    out[:, 80:96] = HALF_POISON  # the second half of query tile 2 of 32 (queries 80-95): never written
    got = out.float().numpy()
    ok, line, hint = ch06._compare_attention(got, truth, got.astype(np.float64), "case", dtype, 32,
                                             "start_m * BLOCK_M", "q_ptr + h * stride_qh")
    assert not ok and "never written" in line, line
    assert hint and "use the BLOCK_M the launch passes (here 32: the grader varies it)" in hint, hint


def test_06_4_rejects_heads_taken_as_packed():
    # head h at h * N_Q * HEAD_DIM (h * N_K * HEAD_DIM for k and v) instead of h * stride_qh...: the grader's
    # heads are further apart
    passed, text = grade("06.4", attention_fwd_kernel=Variant(PACKED_HEADS=True))
    assert not passed and "head 0 is right and head 1 is not" in text and "k_ptr + h * stride_kh" in text, text


def test_06_4_rejects_a_scale_of_its_own():
    # qk_scale computed as log2(e) / sqrt(HEAD_DIM) in the kernel, whatever the launch passes
    passed, text = grade("06.4", attention_fwd_kernel=Variant(OWN_SCALE=True))
    assert not passed and "this matches qk_scale = log2(e)/sqrt(HEAD_DIM)" in text
    assert "use the qk_scale argument" in text, text


# ---- 06.5 the causal mask, tile by tile --------------------------------------------------------------


def tile_ok(q0, k0, bm, bn):
    if k0 + bn - 1 <= q0:
        return "full"
    return "skipped" if k0 > q0 + bm - 1 else "masked"


def tile_ok_by_counting(q0, k0, bm, bn):  # looks at every (query, key) pair
    seen = [k <= q for q in range(q0, q0 + bm) for k in range(k0, k0 + bn)]
    return "full" if all(seen) else ("skipped" if not any(seen) else "masked")


def range_ok(start_m, bm, bn, n_k):
    q0 = start_m * bm
    return min((q0 + 1) // bn * bn, n_k // bn * bn), min(q0 + bm, n_k)


def range_ok_rounded_end(start_m, bm, bn, n_k):  # n_end rounded up to a tile: the same tiles run
    n_full, n_end = range_ok(start_m, bm, bn, n_k)
    return n_full, min(-(-n_end // bn) * bn, -(-n_k // bn) * bn) if n_end > n_full else n_full


@pytest.mark.parametrize("tile, rng_fn", [(tile_ok, range_ok), (tile_ok_by_counting, range_ok_rounded_end)])
def test_06_5_accepts_correct(tile, rng_fn):
    passed, text = grade("06.5", causal_tile=tile, key_range=rng_fn)
    assert passed, text


@pytest.mark.parametrize("tile, rng_fn, hint", [
    (lambda q0, k0, bm, bn: "skipped" if k0 >= q0 + bm - 1 else tile_ok(q0, k0, bm, bn), range_ok,
     "j <= i includes the diagonal"),
    (lambda q0, k0, bm, bn: "full" if k0 + bn - 1 < q0 else tile_ok(q0, k0, bm, bn).replace("full", "masked"),
     range_ok, "a tile whose last key is q0 needs no mask"),
    (lambda q0, k0, bm, bn: {"full": "skipped", "skipped": "full"}.get(tile_ok(q0, k0, bm, bn), "masked"), range_ok,
     "the keys *before* the queries are the full tiles"),
    (lambda q0, k0, bm, bn: "masked", range_ok, "compare the tile's first and last key"),
    (tile_ok, lambda s, bm, bn, nk: (range_ok(s, bm, bn, nk)[0], nk), "skips every tile above the diagonal"),
    (tile_ok, lambda s, bm, bn, nk: (range_ok(s, bm, bn, nk)[0], min(s * bm + bm - 1, nk)), "sees its own key"),
    (tile_ok, lambda s, bm, bn, nk: (min(s * bm // bn * bn, nk // bn * bn), range_ok(s, bm, bn, nk)[1]),
     "(q0 + 1) // block_n * block_n"),
    (tile_ok, lambda s, bm, bn, nk: ((s * bm + 1) // bn * bn, range_ok(s, bm, bn, nk)[1]),
     "(n_k // block_n) * block_n"),
    (tile_ok, lambda s, bm, bn, nk: None, "forget `return`"),
])
def test_06_5_rejects_wrong(tile, rng_fn, hint):
    passed, text = grade("06.5", causal_tile=tile, key_range=rng_fn)
    assert not passed
    assert hint in text, text


@pytest.mark.parametrize("tile, rng_fn, default", [
    ("record", range_ok, "masked"),          # a table of causal_tile's answers
    (tile_ok, "record", (0, 0)),             # a table of key_range's answers
])
def test_06_5_draws_its_cases_on_every_run(tile, rng_fn, default, monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    recording, table = memorised(tile_ok if tile == "record" else range_ok, default=default)
    pick = lambda fn: fn if fn != "record" else None  # noqa: E731
    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade("06.5", causal_tile=pick(tile) or recording, key_range=pick(rng_fn) or recording)[0]
    assert grade("06.5", causal_tile=pick(tile) or table, key_range=pick(rng_fn) or table)[0]  # the same run
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    passed, text = grade("06.5", causal_tile=pick(tile) or table, key_range=pick(rng_fn) or table)
    assert not passed and "KC_GRADE_SEED=22" in text, text


# ---- 06.6 the log-sum-exp ------------------------------------------------------------------------------


def lse_ok(m2, l2):
    return (m2 + torch.log2(l2)) * math.log(2.0)


def lse_ok_natural(m2, l2):
    return m2 * math.log(2.0) + torch.log(l2)


def probs_ok(q, k, lse, sm_scale):
    return torch.exp((q @ k.T) * sm_scale - lse[:, None])


def probs_ok_base2(q, k, lse, sm_scale):  # the kernel's way: base 2 throughout
    log2e = 1 / math.log(2.0)
    return torch.exp2((q @ k.T) * (sm_scale * log2e) - lse[:, None] * log2e)


@pytest.mark.parametrize("lse_fn, probs_fn", [(lse_ok, probs_ok), (lse_ok_natural, probs_ok_base2)])
def test_06_6_accepts_correct(lse_fn, probs_fn):
    passed, text = grade("06.6", lse_from_state=lse_fn, probs_from_lse=probs_fn)
    assert passed, text


@pytest.mark.parametrize("lse_fn, probs_fn, hint", [
    (lambda m2, l2: m2 + torch.log2(l2), probs_ok, "the base-2 log-sum-exp"),
    (lambda m2, l2: m2 + torch.log(l2), probs_ok, "m2 is in base-2 units too"),
    (lambda m2, l2: torch.log(l2), probs_ok, "add the max back"),
    (lambda m2, l2: (m2 + torch.log2(l2)) / math.log(2.0), probs_ok, "not · log2(e)"),
    (lse_ok, lambda q, k, lse, sc: torch.exp(q @ k.T - lse[:, None]), "scale the scores first"),
    (lse_ok, lambda q, k, lse, sc: torch.exp2(q @ k.T * sc - lse[:, None]), "lse is a natural log"),
    (lse_ok, lambda q, k, lse, sc: None, "forget `return`"),
    # recomputing the softmax with a max and a sum of its own, instead of using the lse it was given
    (lse_ok, lambda q, k, lse, sc: torch.softmax(q @ k.T * sc, dim=-1),
     "P = exp(s - lse) with the lse given: no max and no sum of your own"),
])
def test_06_6_rejects_wrong(lse_fn, probs_fn, hint):
    passed, text = grade("06.6", lse_from_state=lse_fn, probs_from_lse=probs_fn)
    assert not passed
    assert hint in text, text


def test_06_6_rejects_a_scale_of_its_own():
    # 1/sqrt(d) from q's shape instead of the sm_scale passed in
    passed, text = grade("06.6", lse_from_state=lse_ok,
                         probs_from_lse=lambda q, k, lse, sc: torch.exp(q @ k.T / math.sqrt(q.shape[-1]) - lse[:, None]))
    assert not passed and "this matches sm_scale = 1/sqrt(d)" in text and "use the sm_scale argument" in text, text


@pytest.mark.parametrize("which", ["lse_from_state", "probs_from_lse"])
def test_06_6_draws_its_values_on_every_run(which, monkeypatch):
    if which == "lse_from_state":
        passed, text = copied_run(monkeypatch, "06.6", which, lse_ok, lambda m2, l2: m2.numpy().tobytes(),
                                  others=dict(probs_from_lse=probs_ok))
    else:
        passed, text = copied_run(monkeypatch, "06.6", which, probs_ok, lambda q, k, lse, sc: q.numpy().tobytes(),
                                  others=dict(lse_from_state=lse_ok))
    assert not passed and "KC_GRADE_SEED=22" in text and which in text, text


# ---- 06.7 / 06.8 the causal part of the kernel, and its speed ---------------------------------------
# One kernel with switches for the typical mistakes. NAIVE is the slow but correct version that 06.8's
# speed check is set against: every key tile computed and masked, as the chapter's version 1 does.

from kernelcourse.attention import causal_key_range  # noqa: E402


@triton.jit
def _fold(acc, l_i, m_i, s, v):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _causal(q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, stride_qh, stride_kh, N_Q, N_K,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NAIVE: tl.constexpr,
            CAUSAL_MASK: tl.constexpr, STRICT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, MASKED_LOOP: tl.constexpr,
            INSIDE: tl.constexpr, FIXED_BM: tl.constexpr, PACKED_HEADS: tl.constexpr, OWN_SCALE: tl.constexpr):
    start_m = tl.program_id(0)
    off_h = tl.program_id(1)
    if FIXED_BM:  # the lesson's 16 query rows a program written in for the program's first query
        q0 = start_m * 16
    else:
        q0 = start_m * BLOCK_M
    if PACKED_HEADS:  # heads taken as packed back to back, N rows of HEAD_DIM each, instead of the strides
        stride_qh = N_Q * HEAD_DIM
        stride_kh = N_K * HEAD_DIM
    if OWN_SCALE:  # log2(e) / sqrt(d) computed here instead of the qk_scale passed in
        qk_scale = 1.4426950408889634 / tl.sqrt(tl.full([], HEAD_DIM, tl.float32))
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + off_h * stride_qh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < N_Q, other=0.0)
    k_head = k_ptr + off_h * stride_kh
    v_head = v_ptr + off_h * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if NAIVE:
        n_full, n_end = 0, N_K
    else:
        n_full, n_end = causal_key_range(q0, N_K, BLOCK_M, BLOCK_N)
    for start_n in range(0, n_full, BLOCK_N):
        keys = start_n + offs_n
        k = tl.load(k_head + keys[:, None] * HEAD_DIM + offs_d[None, :])
        v = tl.load(v_head + keys[:, None] * HEAD_DIM + offs_d[None, :])
        acc, l_i, m_i = _fold(acc, l_i, m_i, tl.dot(q, tl.trans(k)) * qk_scale, v)
    if MASKED_LOOP:
        for start_n in range(n_full, n_end, BLOCK_N):
            keys = start_n + offs_n
            inside = keys < N_K
            k = tl.load(k_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_head + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=inside[:, None], other=0.0)
            if INSIDE:
                keep = inside[None, :] & (offs_m[:, None] >= 0)
            else:  # loads masked (keys past N_K read as 0), but their scores left in the softmax
                keep = offs_m[:, None] >= 0
            if CAUSAL_MASK:
                if STRICT:
                    keep = keep & (keys[None, :] < offs_m[:, None])
                elif BOTTOM_RIGHT:
                    keep = keep & (keys[None, :] <= offs_m[:, None] + N_K - N_Q)
                else:
                    keep = keep & (keys[None, :] <= offs_m[:, None])
            s = tl.where(keep, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
            acc, l_i, m_i = _fold(acc, l_i, m_i, s, v)
    tl.store(o_ptr + off_h * stride_qh + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < N_Q)


class CausalVariant(Variant):
    def __init__(self, **switches):
        self.switches = dict(NAIVE=False, CAUSAL_MASK=True, STRICT=False, BOTTOM_RIGHT=False, MASKED_LOOP=True,
                             INSIDE=True, FIXED_BM=False, PACKED_HEADS=False, OWN_SCALE=False)
        self.switches.update(switches)
        self.fn = _causal.fn

    def __getitem__(self, grid):
        return lambda *args, **meta: _causal[grid](*args, **meta, **self.switches)


@pytest.mark.parametrize("kernel", [CausalVariant(), CausalVariant(NAIVE=True)])
def test_06_7_accepts_correct(kernel):
    passed, text = grade("06.7", causal_attention_kernel=kernel)   # NAIVE is correct, only slow
    assert passed, text


@pytest.mark.parametrize("kernel, hint", [
    (CausalVariant(CAUSAL_MASK=False), "need the causal mask too"),
    (CausalVariant(STRICT=True), "not j < i"),
    (CausalVariant(BOTTOM_RIGHT=True), "bottom-right"),
    (CausalVariant(MASKED_LOOP=False), "the tiles that cross the diagonal were not computed"),
    # keys past N_K loaded as 0 but left in the softmax: rows past N_K see them (N_Q > N_K)
    (CausalVariant(INSIDE=False), "keys past N_K were loaded as 0 and scored 0"),
    (inner_plain_python, "@triton.jit"),
])
def test_06_7_rejects_wrong(kernel, hint):
    passed, text = grade("06.7", causal_attention_kernel=kernel)
    assert not passed
    assert hint in text, text


def test_06_7_rejects_a_block_m_of_its_own():
    # q0 = start_m * 16, the lesson's tile: with BLOCK_M = 32, query tiles past the first rows are never computed
    passed, text = grade("06.7", causal_attention_kernel=CausalVariant(FIXED_BM=True))
    assert not passed and "use the BLOCK_M the launch passes (here 32: the grader varies it)" in text, text


def test_06_7_rejects_heads_taken_as_packed():
    passed, text = grade("06.7", causal_attention_kernel=CausalVariant(PACKED_HEADS=True))
    assert not passed and "head 0 is right and head 1 is not" in text and "k_ptr + h * stride_kh" in text, text


def test_06_7_rejects_a_scale_of_its_own():
    passed, text = grade("06.7", causal_attention_kernel=CausalVariant(OWN_SCALE=True))
    assert not passed and "this matches qk_scale = log2(e)/sqrt(HEAD_DIM)" in text
    assert "use the qk_scale argument" in text, text


def test_06_8_speed_is_graded_only_on_a_gpu():
    passed, text = grade("06.8", causal_attention_kernel=CausalVariant())
    assert passed, text
    if kc.world().gpu:
        assert "needs 1.3x" in text and "not graded" not in text, text
    else:
        assert "not graded" in text and "speed needs a GPU" in text, text


@pytest.mark.skipif(not kc.world().gpu, reason="speed is graded on a GPU only")
def test_06_8_rejects_the_naive_kernel_on_a_gpu():
    passed, text = grade("06.8", causal_attention_kernel=CausalVariant(NAIVE=True))
    assert not passed and "computes every tile" in text, text


def test_06_8_rejects_a_wrong_kernel_before_timing():
    passed, text = grade("06.8", causal_attention_kernel=CausalVariant(STRICT=True))
    assert not passed and "not j < i" in text, text


@pytest.mark.skipif(not kc.world().gpu, reason="speed is graded on a GPU only")
def test_06_8_compares_the_causal_run_with_the_same_kernels_run_over_every_key():
    """Computing every key tile under a mask can clear 1.3x version 1 with a faster inner loop; against the same
    kernel's own run with every key visible (about 1x for it, about 0.55x for a kernel that skips), it cannot."""
    passed, text = grade("06.8", causal_attention_kernel=CausalVariant(NAIVE=True))
    assert not passed and "must not be computed at all" in text, text
    passed, text = grade("06.8", causal_attention_kernel=CausalVariant())
    assert passed and "against its own run with every key visible" in text, text


def test_06_7_probes_the_tile_that_starts_at_the_last_query():
    passed, text = grade("06.7", causal_attention_kernel=CausalVariant())
    assert passed and "N_Q=49, N_K=49, d=16, BLOCK_M=16" in text and "N_K=53" in text, text


def test_06_3_draws_its_values_on_every_run(monkeypatch, tmp_path):
    """Outputs copied from one run (keyed by their inputs) answer nothing on the next: the values are fresh. (The
    grader runs the function in a child process on the CPU: the record goes through a file.)"""
    import pickle

    book = tmp_path / "answers.pkl"

    def recording(q, k, v, block_n, causal=False):
        seen = pickle.loads(book.read_bytes()) if book.exists() else {}
        out = tiled_ok(q, k, v, block_n, causal)
        seen[(q.numpy().tobytes(), causal)] = tuple(t.numpy() for t in out)  # arrays: unpickling makes no tensors
        book.write_bytes(pickle.dumps(seen))
        return out

    def copied(q, k, v, block_n, causal=False):
        seen = pickle.loads(book.read_bytes())
        return tuple(torch.from_numpy(a) for a in seen.get((q.numpy().tobytes(), causal), next(iter(seen.values()))))

    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade("06.3", tiled_attention=recording)[0]
    same = grade("06.3", tiled_attention=copied)
    assert same[0], same[1]  # the same run's cases: the copy answers them
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    passed, text = grade("06.3", tiled_attention=copied)
    assert not passed, text
