"""Chapter 07's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted. Kernels run in Triton's interpreter on the CPU.

The speed check of 07.5 runs only on a GPU, timed in the grader against SDPA's backward. A naive
kernel it is meant to fail: one that forms the products with broadcasting and ``tl.sum`` instead of
``tl.dot`` (``tl.sum(k[:, None, :] * q[None, :, :], 2)``), which keeps the tensor cores idle. The
tests hold one, ``dkdv_kernel("tl_sum")``: correct on the CPU, failing that check on a GPU."""
import math

import pytest
import torch

import kernelcourse as kc
from tests.helpers import grade, memorised


def copied_answers(correct):
    """A correct function that records its answers, keyed by the bytes of its tensor arguments, and a copy
    that answers from that record only (a question it has not seen gets the first answer recorded): what a
    learner who pasted one run's outputs submits. The tests that use it grade in this process
    (KC_GRADE_IN_PROCESS=1), so the record is shared."""
    book = {}

    def key(args):
        return tuple(a.detach().cpu().numpy().tobytes() if isinstance(a, torch.Tensor) else a for a in args)

    def recording(*args):
        book[key(args)] = correct(*args)
        return book[key(args)]

    def copied(*args):
        return book.get(key(args), next(iter(book.values())))

    return recording, copied


def draws_fresh_values(monkeypatch, exercise, name, recording, copied):
    """``copied`` answers the run ``recording`` saw, and fails the next one: the grader draws its values."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade(exercise, **{name: recording})[0]
    same = grade(exercise, **{name: copied})
    assert same[0], same[1]  # the same run's cases: the copy answers them
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    passed, text = grade(exercise, **{name: copied})
    assert not passed, text
    assert "KC_GRADE_SEED=22 draws these cases again" in text, text

# ---- 07.1 dS from P and dP -------------------------------------------------------------------------


def sb_ok(p, dp):
    return p * (dp - (p * dp).sum(dim=-1, keepdim=True))


def sb_jacobian(p, dp):  # the whole Jacobian of each row, diag(p) - p pᵀ, in float64: correct, if wasteful
    p64, dp64 = p.double(), dp.double()
    jac = torch.diag_embed(p64) - p64[:, :, None] * p64[:, None, :]
    return (jac @ dp64[:, :, None])[:, :, 0].float()


@pytest.mark.parametrize("fn", [sb_ok, sb_jacobian])
def test_07_1_accepts_correct(fn):
    passed, text = grade("07.1", softmax_backward=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda p, dp: p * dp, "backward of an elementwise exp"),
    (lambda p, dp: p * (dp - dp.sum(dim=-1, keepdim=True)), "not of dP alone"),
    (lambda p, dp: dp - (p * dp).sum(dim=-1, keepdim=True), "multiply by P"),
    (lambda p, dp: p * (1 - p) * dp, "the diagonal alone"),
    (lambda p, dp: None, "forget `return`"),
])
def test_07_1_rejects_wrong(fn, hint):
    passed, text = grade("07.1", softmax_backward=fn)
    assert not passed
    assert hint in text, text


def test_07_1_draws_its_values_on_every_run(monkeypatch):
    draws_fresh_values(monkeypatch, "07.1", "softmax_backward", *copied_answers(sb_ok))


# ---- 07.2 D -----------------------------------------------------------------------------------------


def d_probs_ok(p, dp):
    return (p * dp).sum(dim=-1)


def d_ok(o, do):
    return (do * o).sum(dim=-1)


def d_einsum(o, do):  # another correct way: the diagonal of dO Oᵀ without the rest
    return torch.einsum("ic,ic->i", do.double(), o.double())


@pytest.mark.parametrize("fn", [d_ok, d_einsum])
def test_07_2_accepts_correct(fn):
    passed, text = grade("07.2", delta_from_probs=d_probs_ok, delta=fn)
    assert passed, text


@pytest.mark.parametrize("probs, fn, hint", [
    (lambda p, dp: dp.sum(dim=-1), d_ok, "multiply by P before summing"),
    (d_probs_ok, lambda o, do: do.sum(-1) * o.sum(-1), "not a product of sums"),
    (d_probs_ok, lambda o, do: do @ o.T, "the diagonal of dO Oᵀ"),
    (d_probs_ok, lambda o, do: torch.diag(do @ o.T), "which needs no N_Q × N_Q intermediate"),
])
def test_07_2_rejects_wrong(probs, fn, hint):
    passed, text = grade("07.2", delta_from_probs=probs, delta=fn)
    assert not passed
    assert hint in text, text


def test_07_2_draws_its_values_on_every_run(monkeypatch):
    """Both functions' answers copied from one run answer nothing on the next (N_Q of the last case is drawn too)."""
    (rec_p, copy_p), (rec_d, copy_d) = copied_answers(d_probs_ok), copied_answers(d_ok)
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    monkeypatch.setenv("KC_GRADE_SEED", "21")
    assert grade("07.2", delta_from_probs=rec_p, delta=rec_d)[0]
    same = grade("07.2", delta_from_probs=copy_p, delta=copy_d)
    assert same[0], same[1]
    monkeypatch.setenv("KC_GRADE_SEED", "22")
    for probs, fn in ((copy_p, d_ok), (d_probs_ok, copy_d)):
        passed, text = grade("07.2", delta_from_probs=probs, delta=fn)
        assert not passed and "KC_GRADE_SEED=22 draws these cases again" in text, text


# ---- 07.3 the backward of one head ----------------------------------------------------------------


def backward_ok(q, k, v, do, causal=False, bug=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal and bug != "no_mask":
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), 0.0 if bug == "fill_zero" else float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = p @ v
    dp = do @ v.T
    d = dp.sum(-1, keepdim=True) if bug == "delta_from_dp" else (do * o).sum(-1, keepdim=True)
    ds = p * dp if bug == "no_delta" else p * (dp - d)
    c = 1.0 if bug == "no_scale" else scale
    return ds @ k * c, ds.T @ q * c, p.T @ do


def backward_autograd(q, k, v, do, causal=False):  # autograd in float64: correct
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].T / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(s, -1) @ leaves[2]).backward(do.double())
    return tuple(t.grad for t in leaves)


@pytest.mark.parametrize("fn", [backward_ok, backward_autograd])
def test_07_3_accepts_correct(fn):
    passed, text = grade("07.3", attention_backward=fn)
    assert passed, text


@pytest.mark.parametrize("bug, hint", [
    ("no_delta", "subtract D"),
    ("delta_from_dp", "not the row sum of dP"),
    ("no_scale", "the scale is missing"),
    ("fill_zero", "must be -inf"),
    ("no_mask", "mask S before the softmax"),
])
def test_07_3_rejects_wrong(bug, hint):
    passed, text = grade("07.3", attention_backward=lambda q, k, v, do, causal=False: backward_ok(q, k, v, do, causal, bug))
    assert not passed
    assert hint in text, text


def backward_strict(q, k, v, do, causal=False):
    """The causal mask one off: triu(diagonal=0) masks the diagonal too, so query i sees only keys j < i (and
    query 0 sees none)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(diagonal=0), float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = do @ v.T
    ds = p * (dp - (do * (p @ v)).sum(-1, keepdim=True))
    return ds @ k * scale, ds.T @ q * scale, p.T @ do


def backward_bottom_right(q, k, v, do, causal=False):
    """The causal mask aligned to the bottom-right corner (key j seen by query i when j <= i + N_K - N_Q): the
    same as the course's when N_Q = N_K, not otherwise."""
    n_q, n_k = q.shape[0], k.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.T * scale
    if causal:
        later = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + (n_k - n_q)
        s = s.masked_fill(later, float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = do @ v.T
    ds = p * (dp - (do * (p @ v)).sum(-1, keepdim=True))
    return ds @ k * scale, ds.T @ q * scale, p.T @ do


@pytest.mark.parametrize("fn, hint", [
    (backward_strict, "each query sees its own key"),
    (backward_bottom_right, "from the top-left corner"),
])
def test_07_3_rejects_a_misplaced_diagonal(fn, hint):
    passed, text = grade("07.3", attention_backward=fn)
    assert not passed
    assert hint in text, text


def test_07_3_draws_its_values_on_every_run(monkeypatch):
    recording, copied = copied_answers(backward_ok)
    draws_fresh_values(monkeypatch, "07.3", "attention_backward", recording, copied)


# ---- 07.4 the tiled backward ----------------------------------------------------------------------


def tiled_ok(q, k, v, o, lse, do, block_m, block_n, causal=False, whole_rows=False):
    scale = 1.0 / math.sqrt(q.shape[-1])
    d = (do * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for m0 in range(0, q.shape[0], block_m):           # query tiles outside, key tiles inside: also correct
        rows = torch.arange(m0, min(m0 + block_m, q.shape[0]))
        for n0 in range(0, k.shape[0], block_n):
            cols = torch.arange(n0, min(n0 + block_n, k.shape[0]))
            p = torch.exp(q[rows] @ k[cols].T * scale - lse[rows, None])
            if causal:
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dv[cols] += p.T @ do[rows]
            ds = p * (do[rows] @ v[cols].T - d[rows, None])
            dq[rows] += ds @ k[cols] * scale
            dk[cols] += ds.T @ q[rows] * scale
    return dq, dk, dv


def tiled_whole(q, k, v, o, lse, do, block_m, block_n, causal=False):  # correct, but holds N_Q x N_K
    return backward_ok(q, k, v, do, causal)


def tiled_no_delta(q, k, v, o, lse, do, block_m, block_n, causal=False):
    return tiled_ok(q, k, v, torch.zeros_like(o), lse, do, block_m, block_n, causal)


def tiled_tile_max(q, k, v, o, lse, do, block_m, block_n, causal=False):
    # P from each tile's own softmax instead of the saved lse
    fake = []
    for m0 in range(0, q.shape[0], block_m):
        s = q[m0:m0 + block_m] @ k[:block_n].T / math.sqrt(q.shape[-1])
        fake.append(torch.logsumexp(s, -1))
    return tiled_ok(q, k, v, o, torch.cat(fake), do, block_m, block_n, causal)


def test_07_4_accepts_correct():
    passed, text = grade("07.4", tiled_attention_backward=tiled_ok)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (tiled_whole, "as large as the whole N_Q × N_K"),
    (tiled_no_delta, "subtract D"),
    (lambda q, k, v, o, lse, do, bm, bn, causal=False: tiled_ok(q, k, v, o, lse, do, bm, bn, False), "set P to 0"),
    (lambda q, k, v, o, lse, do, bm, bn, causal=False: (None, None), "return a tuple of 3"),
])
def test_07_4_rejects_wrong(fn, hint):
    passed, text = grade("07.4", tiled_attention_backward=fn)
    assert not passed
    assert hint in text, text


def test_07_4_rejects_a_tile_lse():
    passed, text = grade("07.4", tiled_attention_backward=tiled_tile_max)
    assert not passed
    assert "a tile's own max or sum is not the row's" in text, text


def tiled_mistake(q, k, v, o, lse, do, block_m, block_n, causal=False, mistake=None):
    """tiled_ok, key tiles outside, with one typical slip: "drop_key_tail" (range(0, N_K - block_n + 1, block_n):
    the last, shorter key tile never runs), "drop_query_tail" (the same for the queries), "strict" (the causal
    mask also hides the diagonal, key j == query i)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[0], k.shape[0]
    d = (do * o).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for n0 in range(0, n_k - block_n + 1 if mistake == "drop_key_tail" else n_k, block_n):
        cols = torch.arange(n0, min(n0 + block_n, n_k))
        for m0 in range(0, n_q - block_m + 1 if mistake == "drop_query_tail" else n_q, block_m):
            rows = torch.arange(m0, min(m0 + block_m, n_q))
            p = torch.exp(q[rows] @ k[cols].T * scale - lse[rows, None])
            if causal:
                hidden = cols[None, :] >= rows[:, None] if mistake == "strict" else cols[None, :] > rows[:, None]
                p = p.masked_fill(hidden, 0.0)
            dv[cols] += p.T @ do[rows]
            ds = p * (do[rows] @ v[cols].T - d[rows, None])
            dq[rows] += ds @ k[cols] * scale
            dk[cols] += ds.T @ q[rows] * scale
    return dq, dk, dv


@pytest.mark.parametrize("mistake, hint", [
    ("drop_key_tail", "the last key tile is shorter"),
    ("drop_query_tail", "the last query tile is shorter"),
    ("strict", "each query sees its own key"),
])
def test_07_4_rejects_a_boundary_slip(mistake, hint):
    passed, text = grade("07.4", tiled_attention_backward=lambda q, k, v, o, lse, do, bm, bn, causal=False:
                         tiled_mistake(q, k, v, o, lse, do, bm, bn, causal, mistake))
    assert not passed
    assert hint in text, text


def test_07_4_accepts_key_tiles_outside():
    passed, text = grade("07.4", tiled_attention_backward=tiled_mistake)
    assert passed, text


def test_07_4_draws_its_values_on_every_run(monkeypatch):
    draws_fresh_values(monkeypatch, "07.4", "tiled_attention_backward", *copied_answers(tiled_ok))


# ---- 07.5 the dK/dV kernel --------------------------------------------------------------------------


DKDV_TEMPLATE = """
import triton
import triton.language as tl


@triton.jit
def kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, sm_scale,
           stride_qh, stride_kh, stride_lh, N_Q, N_K,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0)
    off_h = tl.program_id(1)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv = off_h * stride_kh + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + kv, mask=offs_n[:, None] < N_K, other=0.0)
    v = tl.load(v_ptr + kv, mask=offs_n[:, None] < N_K, other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start_m in range(0, N_Q, STEP):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m < N_Q
        qd = HEAD_Q + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + qd, MASK_ROWS)
        do = tl.load(do_ptr + qd, MASK_ROWS)
        lse = tl.load(lse_ptr + HEAD_L + offs_m, mask=rows, other=0.0)
        delta = tl.load(delta_ptr + HEAD_L + offs_m, mask=rows, other=0.0)
BODY
    tl.store(dk_ptr + kv, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=offs_n[:, None] < N_K)
    tl.store(dv_ptr + kv, dv.to(dv_ptr.dtype.element_ty), mask=offs_n[:, None] < N_K)
"""

TRANSPOSED = """
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :] * LSE_FACTOR)
        dv += tl.dot(p_t.to(q.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) DELTA)
        dk += tl.dot(ds_t.to(q.dtype), q)
"""
BODIES = {
    "ok": TRANSPOSED.replace("LSE_FACTOR", "1.4426950408889634").replace("DELTA", "- delta[None, :]"),
    # another correct way: the untransposed tile in base e, transposed for the updates
    "rows": """
        p = tl.exp(tl.dot(q, tl.trans(k)) * sm_scale - lse[:, None])
        p = tl.where(rows[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dv += tl.dot(tl.trans(p).to(q.dtype), do)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q)
""",
    "lse_base_e": TRANSPOSED.replace("LSE_FACTOR", "1.0").replace("DELTA", "- delta[None, :]"),
    "no_delta": TRANSPOSED.replace("LSE_FACTOR", "1.4426950408889634").replace("DELTA", ""),
    "no_mask": TRANSPOSED.replace("LSE_FACTOR", "1.4426950408889634").replace("DELTA", "- delta[None, :]"),
    # sm_scale written in, as 1/sqrt(HEAD_DIM), instead of the argument's qk_scale
    "own_scale": TRANSPOSED.replace("LSE_FACTOR", "1.4426950408889634").replace("DELTA", "- delta[None, :]")
                           .replace("* qk_scale", "* (1.4426950408889634 / HEAD_DIM ** 0.5)"),
    # correct but wasteful: each product broadcast to a BLOCK_N x BLOCK_M x HEAD_DIM block and reduced with
    # tl.sum, in float32, where tl.dot would use the tensor cores. On a GPU the block (64 x 32 x 64 floats at the
    # timed launch: 1024 registers a thread) spills to local memory and every multiply-add is a scalar one
    "tl_sum": """
        qf, dof = q.to(tl.float32), do.to(tl.float32)
        s_t = tl.sum(k.to(tl.float32)[:, None, :] * qf[None, :, :], 2)
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
        dv += tl.sum(p_t[:, :, None] * dof[None, :, :], 1)
        dp_t = tl.sum(v.to(tl.float32)[:, None, :] * dof[None, :, :], 2)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.sum(ds_t[:, :, None] * qf[None, :, :], 1)
""",
}
# the kernel's slips outside the loop body's arithmetic: (placeholder, what the correct kernel has there, the slip)
SLIPS = {
    "step_16": ("STEP", "BLOCK_M", "16"),                           # the loop written for 16-row query tiles
    "heads_packed": ("HEAD_Q", "off_h * stride_qh", "off_h * N_Q * HEAD_DIM"),  # heads taken as N_Q rows apart
    "lse_packed": ("HEAD_L", "off_h * stride_lh", "off_h * N_Q"),  # lse and delta rows taken as N_Q apart
}


def dkdv_kernel(variant, tmp_path):
    """The exercise's kernel with its loop body written one of several ways, from a module file
    (Triton reads a kernel's source)."""
    import importlib.util

    src = DKDV_TEMPLATE.replace("BODY", BODIES.get(variant, BODIES["ok"]).strip("\n"))
    for name, (placeholder, right, slip) in SLIPS.items():
        src = src.replace(placeholder, slip if variant == name else right)
    src = src.replace("MASK_ROWS", "" if variant == "no_mask" else "mask=rows[:, None], other=0.0")
    path = tmp_path / f"dkdv_{variant}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"dkdv_{variant}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


@pytest.mark.parametrize("variant", ["ok", "rows"])
def test_07_5_accepts_correct(variant, tmp_path):
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel(variant, tmp_path))
    assert passed, text
    if not kc.world().gpu:
        assert "speed needs a GPU (not graded here)" in text


@pytest.mark.parametrize("variant, hint", [
    ("lse_base_e", "convert it to base 2"),
    ("no_delta", "subtract D"),
])
def test_07_5_rejects_wrong(variant, hint, tmp_path):
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel(variant, tmp_path))
    assert not passed
    assert hint in text, text


@pytest.mark.parametrize("variant, hint", [
    ("own_scale", "drawn on every run), not by 1/√HEAD_DIM"),        # class 4: sm_scale never varied before
    ("step_16", "the query tiles are BLOCK_M rows each (here BLOCK_M=32)"),  # class 1: a tile size written in
    ("heads_packed", "head h of q and do starts at h * stride_qh"),     # class 2: heads taken as N_Q rows apart
    ("lse_packed", "of lse and delta at h * stride_lh"),                # class 2: lse rows taken as N_Q long
])
def test_07_5_rejects_what_a_single_launch_hides(variant, hint, tmp_path):
    """Slips that one launch shape cannot show: the grader draws sm_scale, launches BLOCK_M = 16 and 32, and pads
    the heads of q, do, lse and delta (their strides are larger than N_Q rows)."""
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel(variant, tmp_path))
    assert not passed
    assert hint in text, text


def test_07_5_rejects_unmasked_rows(tmp_path):
    if kc.world().gpu:
        pytest.skip("an unmasked load past the data may crash a GPU process; the interpreter reads the NaN frame")
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel("no_mask", tmp_path))
    assert not passed
    assert "mask=offs_m < N_Q" in text or "NaN" in text or "outside every tensor the kernel was given" in text, text


def test_07_5_tl_sum_is_correct(tmp_path):
    """The products as broadcast-multiply and tl.sum instead of tl.dot: right numbers (speed not graded here)."""
    if kc.world().gpu:
        pytest.skip("on a GPU the same kernel is graded on speed too: test_07_5_tl_sum_fails_the_speed_check")
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel("tl_sum", tmp_path))
    assert passed, text
    assert "dk and dv match" in text and "speed needs a GPU (not graded here)" in text, text


def test_07_5_tl_sum_compiles_to_scalar_products_on_hopper(tmp_path, monkeypatch):
    """What the speed line's hint reads: compiled for an H100 (on any machine), the tl.sum kernel holds
    thousands of scalar FMAs beside the few wgmma Triton made of some of its sums; the correct one, a
    handful beside its tl.dot."""
    from kernelcourse import targets
    from tests.test_targets import skip_on_a_gpu

    skip_on_a_gpu()  # on a GPU the speed test below reads the same counts off the kernel it ran
    monkeypatch.syspath_prepend(str(tmp_path))  # in the CPU world the kernels compile in child processes
    meta = dict(constexprs=dict(HEAD_DIM=64, BLOCK_M=32, BLOCK_N=64), num_warps=4, num_stages=2,
                types={"sm_scale": "fp32", "lse_ptr": "*fp32", "delta_ptr": "*fp32"})
    wasteful, ok = targets.lowerings([dict(kernel=dkdv_kernel(v, tmp_path), cc=90, **meta) for v in ("tl_sum", "ok")])
    assert targets.scalar_products(wasteful.counts) and wasteful.counts["fma"] >= 1024, wasteful.counts
    assert not targets.scalar_products(ok.counts) and ok.unit in ("wgmma", "mma"), ok.counts  # mma: DISABLE_MMA_V3


SPEED_LINE = "your dK/dV kernel at (B·H, N, d) = (64, 4096, 64), fp16"


def test_07_5_tl_sum_fails_the_speed_check(tmp_path):
    """Right numbers, products as a multiply and tl.sum: Triton makes tensor-core code of some, scalar
    multiply-adds of the rest, on a block that spills (0.00x SDPA on an H200). It passes every correctness
    check and fails the speed check, whose line names the kernel, its ratio, 0.6x and tl.dot; the course's
    kernel (tl.dot) passes it in the same process."""
    if not kc.world().gpu:
        pytest.skip("speed is graded only on a GPU (the interpreter's times say nothing about one)")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("below compute capability 8.0 tl.dot is FMA too: the peer is the course's kernel on CUDA cores, "
                    "and a tl.sum kernel is no longer the wasteful one")
    from kernelcourse.world import pre_hopper_emulation

    if pre_hopper_emulation():  # minutes of a spilling kernel, for a line test_07_5_accepts_correct shows already
        pytest.skip("under DISABLE_MMA_V3 on a Hopper GPU a shortfall against SDPA is not graded: "
                    "test_07_5_accepts_correct sees that line")
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel("tl_sum", tmp_path))
    assert not passed, text
    failing = [line for line in text.splitlines() if line.startswith("✘")]
    assert len(failing) == 1 and SPEED_LINE in failing[0] and "needs at least 0.6x" in failing[0], text
    assert "write each block product with tl.dot" in failing[0], text  # the peer stays SDPA, and why
    passed, text = grade("07.5", attention_dkdv_kernel=dkdv_kernel("ok", tmp_path))
    assert passed and SPEED_LINE in text, text  # timed, and not failed


def test_07_5_rejects_a_plain_function():
    passed, text = grade("07.5", attention_dkdv_kernel=lambda *a: None)
    assert not passed and "@triton.jit" in text, text


# ---- 07.6 query tiles of a key tile ----------------------------------------------------------------


def qr_ok(start_n, block_m, block_n):  # the range the course's dK/dV kernel computes, on the host
    from kernelcourse.attention import causal_query_range

    return causal_query_range.fn(start_n * block_n, block_m, block_n)


def qr_loop(start_n, block_m, block_n):  # another correct way: walk the tiles and classify each
    k0, k1 = start_n * block_n, start_n * block_n + block_n - 1
    m = 0
    while m + block_m - 1 < k0:         # the tile's last query is before the first key: skipped
        m += block_m
    start = m
    while m < k1:                       # the tile's first query is before the last key: masked
        m += block_m
    return start, m


def test_the_kernels_query_range_agrees_with_walking_the_tiles():
    """The grader's truth is the kernel's own helper: check it against the tiles classified one by one."""
    for bm in (1, 2, 3, 16, 32, 48, 64, 128):
        for bn in (1, 2, 5, 16, 32, 64, 128):
            for start_n in range(0, 40):
                assert qr_ok(start_n, bm, bn) == qr_loop(start_n, bm, bn), (start_n, bm, bn)


@pytest.mark.parametrize("fn", [qr_ok, qr_loop])
def test_07_6_accepts_correct(fn):
    passed, text = grade("07.6", query_range=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda s, bm, bn: (0, qr_ok(s, bm, bn)[1]), "see none of its keys"),
    (lambda s, bm, bn: (qr_ok(s, bm, bn)[0], -(-(s * bn + bn) // bm) * bm), "already sees every key"),
    (lambda s, bm, bn: (qr_ok(s, bm, bn)[0], qr_ok(s, bm, bn)[0] + bm), "crosses the diagonal in several query tiles"),
    (lambda s, bm, bn: None, "forget `return`"),
])
def test_07_6_rejects_wrong(fn, hint):
    passed, text = grade("07.6", query_range=fn)
    assert not passed
    assert hint in text, text


def test_07_6_draws_its_tile_sizes_on_every_run(monkeypatch):
    """A table of one run's answers misses the tile sizes the next run draws."""
    recording, table = memorised(qr_ok, default=(0, 0))
    draws_fresh_values(monkeypatch, "07.6", "query_range", recording, table)


# ---- 07.7 the autograd Function -----------------------------------------------------------------------

from kernelcourse.attention import flash_attention  # noqa: E402
from kernelcourse.attention_backward import flash_attention_backward  # noqa: E402


class FnOk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*flash_attention_backward(q, k, v, o, lse, do, causal=ctx.causal), None)


class FnRecompute(torch.autograd.Function):  # saves only the inputs and reruns the forward: correct
    @staticmethod
    def forward(ctx, q, k, v, causal):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return flash_attention(q, k, v, causal=causal)[0]

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        o, lse = flash_attention(q, k, v, causal=ctx.causal)
        return (*flash_attention_backward(q, k, v, o, lse, do, causal=ctx.causal), None)


class FnSavesP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention(q, k, v, causal=causal)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
        ctx.save_for_backward(torch.softmax(s, -1), v, q, k)
        return o

    @staticmethod
    def backward(ctx, do):
        p, v, q, k = ctx.saved_tensors
        dp = do @ v.transpose(-2, -1)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        scale = 1 / math.sqrt(q.shape[-1])
        return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do, None


class FnPOnCtx(FnOk):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o = FnOk.forward(ctx, q, k, v, causal)
        ctx.p = torch.softmax(q @ k.transpose(-2, -1), -1)   # kept on ctx, not saved: still N x N
        return o


class FnSwapped(FnOk):
    @staticmethod
    def backward(ctx, do):
        dq, dk, dv, _ = FnOk.backward(ctx, do)
        return dq, dv, dk, None


class FnForgetsCausal(FnOk):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*flash_attention_backward(q, k, v, o, lse, do, causal=False), None)


class FnOOnCtx(torch.autograd.Function):  # right numbers, but o on ctx: o -> grad_fn -> ctx -> o, a cycle
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, lse)
        ctx.o, ctx.causal = o, causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, lse = ctx.saved_tensors
        return (*flash_attention_backward(q, k, v, ctx.o, lse, do, causal=ctx.causal), None)


class FnLseOnCtx(FnOk):  # also correct: the lse, made inside forward and no part of the graph, kept on ctx
    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = flash_attention(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, o)
        ctx.lse, ctx.causal = lse, causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        return (*flash_attention_backward(q, k, v, o, ctx.lse, do, causal=ctx.causal), None)


@pytest.mark.parametrize("fn", [FnOk, FnRecompute, FnLseOnCtx])
def test_07_7_accepts_correct(fn):
    passed, text = grade("07.7", FlashAttentionFn=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (FnSavesP, "as large as the N_Q × N_K probabilities"),
    (FnPOnCtx, "as large as the N_Q × N_K probabilities"),
    (FnForgetsCausal, "keep it on ctx"),
    (FnSwapped, "in the order of forward's inputs: (dq, dk, dv, None)"),
    (FnOOnCtx, "a reference cycle"),
    (lambda q, k, v, causal: None, "torch.autograd.Function"),
])
def test_07_7_rejects_wrong(fn, hint):
    passed, text = grade("07.7", FlashAttentionFn=fn)
    assert not passed
    assert hint in text, text


class FnCopied(torch.autograd.Function):
    """o and the gradients pasted from a recorded run, keyed by q's bytes (see copied_answers)."""
    book = {}

    @staticmethod
    def forward(ctx, q, k, v, causal):
        ctx.key = (q.detach().cpu().numpy().tobytes(), causal)
        return FnCopied.book.get(ctx.key, next(iter(FnCopied.book.values())))[0].clone()

    @staticmethod
    def backward(ctx, do):
        return (*FnCopied.book.get(ctx.key, next(iter(FnCopied.book.values())))[1:], None)


class FnRecording(FnOk):
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = FnOk.backward(ctx, do)[:3]
        FnCopied.book[(q.detach().cpu().numpy().tobytes(), ctx.causal)] = (o.detach().clone(), *grads)
        return (*grads, None)


def test_07_7_draws_its_values_on_every_run(monkeypatch):
    FnCopied.book.clear()
    draws_fresh_values(monkeypatch, "07.7", "FlashAttentionFn", FnRecording, FnCopied)
