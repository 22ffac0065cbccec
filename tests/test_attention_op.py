"""kernelcourse.attention_backward.attention as a PyTorch operator: grouped-query attention against the
reference with repeated key heads, the lean launchers against the launchers the lessons print, the
operators' fake and autograd implementations (``torch.library.opcheck``), ``torch.compile(fullgraph=True)``,
a second derivative that raises, inputs that need the copy fallback, head dims 128 and 256, and bfloat16
on a GPU that has it."""
import math

import pytest
import torch

import kernelcourse as kc
from kernelcourse import attention as A
from kernelcourse import attention_backward as AB

GPU = kc.world().gpu
DEVICE = kc.world().device
# float32 in the interpreter (exact products), float16 on a GPU (where float32 tl.dot is TF32)
DTYPE = torch.float16 if GPU else torch.float32


def make(B, H, h_kv, n_q, n_k, d, dtype=DTYPE, seed=0, logit_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    s = math.sqrt(logit_scale)
    q = torch.randn(B, H, n_q, d, generator=g) * s
    k = torch.randn(B, h_kv, n_k, d, generator=g) * s
    v = torch.randn(B, h_kv, n_k, d, generator=g)
    do = torch.randn(B, H, n_q, d, generator=g)
    return (t.to(DEVICE, dtype) for t in (q, k, v, do))


def repeated(t, H):
    """Key or value heads repeated for each query head that reads them, as transformers' repeat_kv."""
    return t.repeat_interleave(H // t.shape[1], dim=1)


def truth(q, k, v, do, causal=False, sm_scale=None):
    """Output and gradients in float64, from the reference on repeated key heads: autograd sums the
    gradients of the copies of a key head, which is what dk and dv of grouped-query attention are."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    H = q.shape[1]
    o = A.attention_ref(leaves[0], repeated(leaves[1], H), repeated(leaves[2], H), causal=causal, sm_scale=sm_scale)
    o.backward(do.double())
    return o.detach(), [t.grad for t in leaves]


def tolerance(dtype, ref):
    scale = ref.abs().max().item()
    # float32: exact products in the interpreter; float16 and bfloat16: a few of their rounding steps
    return (1e-4 if dtype == torch.float32 else 5e-2 if dtype == torch.bfloat16 else 5e-3) * max(scale, 1.0)


def check(q, k, v, do, causal=False, sm_scale=None, fn=None):
    fn = fn or AB.attention
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, causal=causal, sm_scale=sm_scale)
    o.backward(do)
    o64, grads64 = truth(q, k, v, do, causal, sm_scale)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert (o.double() - o64).abs().max().item() <= tolerance(q.dtype, o64), "output"
    for name, t, g64 in zip("qkv", leaves, grads64):
        assert t.grad.shape == t.shape, f"d{name} has shape {tuple(t.grad.shape)}"
        err = (t.grad.double() - g64).abs().max().item()
        assert err <= tolerance(q.dtype, g64), f"d{name}: max error {err:.3g}"


# ---- grouped-query attention ---------------------------------------------------------------------


@pytest.mark.parametrize("H, h_kv", [(4, 2), (4, 1), (6, 3), (3, 3)])
@pytest.mark.parametrize("n_q, n_k, causal", [(37, 45, True), (45, 37, True), (50, 29, False)])
def test_grouped_query_attention_matches_repeated_heads(H, h_kv, n_q, n_k, causal):
    """Sizes that are not multiples of the tiles; K and V read once per key head by the kernels."""
    check(*make(2, H, h_kv, n_q, n_k, 16, seed=H + n_q), causal=causal)


def test_grouped_query_attention_through_the_lesson_launchers():
    q, k, v, do = make(1, 4, 2, 40, 33, 32, seed=2)
    o, lse = A.flash_attention(q, k, v, causal=True)
    o64, grads64 = truth(q, k, v, do, causal=True)
    assert (o.double() - o64).abs().max().item() <= tolerance(q.dtype, o64)
    for version in sorted(A.VERSIONS):
        torch.testing.assert_close(A.flash_attention(q, k, v, causal=True, version=version)[0].double(), o64,
                                   atol=tolerance(q.dtype, o64), rtol=0)
    tiles = {"BLOCK_M": 16, "BLOCK_N": 16}
    got = AB.flash_attention_backward(q, k, v, o, lse, do, causal=True, dkdv_config=tiles, dq_config=tiles)
    for g, g64 in zip(got, grads64):
        assert (g.double() - g64).abs().max().item() <= tolerance(q.dtype, g64)


# ---- the lean launchers compute what the lessons' launchers compute -------------------------------


@pytest.mark.parametrize("h_kv, causal", [(2, True), (4, False)])
def test_lean_launchers_match_the_lesson_launchers(h_kv, causal):
    q, k, v, do = make(2, 4, h_kv, 45, 38, 32, seed=7)
    scale = 0.3
    for _ in range(2):                                    # the first call makes the plan, the second uses it
        o, lse = A._forward(q, k, v, causal, scale)
        o_ref, lse_ref = A.flash_attention(q, k, v, causal=causal, sm_scale=scale)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
        got = AB._backward(q, k, v, o, lse, do, causal, scale)
        want = AB.flash_attention_backward(q, k, v, o, lse, do, causal=causal, sm_scale=scale)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_attention_without_gradients_and_through_flash_attention_agree():
    q, k, v, _ = make(1, 2, 2, 30, 30, 16, seed=3)
    with torch.no_grad():
        o = AB.attention(q, k, v, causal=True)
    assert o.grad_fn is None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.equal(AB.FlashAttention.apply(*leaves, True, None).detach(), o)


# ---- the operators ---------------------------------------------------------------------------------


def test_opcheck_forward_and_backward_operators():
    q, k, v, do = make(1, 4, 2, 21, 26, 16, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.kernelcourse.attention_fwd.default, (*leaves, True, 0.25))
    # q laid out as (B, N, H, d), as a fused projection leaves it: the fake output has the real one's strides
    qt = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    torch.library.opcheck(torch.ops.kernelcourse.attention_fwd.default, (qt, leaves[1], leaves[2], False, 0.25))
    o, lse = torch.ops.kernelcourse.attention_fwd(q, k, v, True, 0.25)
    torch.library.opcheck(torch.ops.kernelcourse.attention_bwd.default, (q, k, v, o, lse, do, True, 0.25))


@pytest.fixture
def version_run(monkeypatch):
    """Make the operator's forward run one of chapter 06's versions, as a GPU of another compute capability
    picks it (v2 before Hopper, and under KC_MAX_CAPABILITY=8.0 on an H100), with plans of its own."""
    def run(version):
        monkeypatch.setattr(A, "default_version", lambda capability: version)
        monkeypatch.setattr(A, "_plans", {})
    return run


@pytest.mark.parametrize("version", sorted(A.VERSIONS))
def test_every_version_lays_its_outputs_out_as_the_fake_says(version_run, version):
    """The fake implementations say what layout comes out, and torch.compile's code asserts it at run
    time: the output is laid out as q (as (B, N, H, d) for heads of a fused projection), the log-sum-exp and
    the gradients are contiguous, whichever version the GPU runs. The fake must not ask which version runs:
    a compiled graph cached on disk is reused under another KC_MAX_CAPABILITY."""
    version_run(version)
    q, k, v, do = make(2, 4, 2, 21, 26, 16, seed=9)
    fused = torch.randn(2, 21, 3, 4, 16, device=DEVICE, dtype=DTYPE)  # (B, N, 3, H, d), as a block's projection
    qf, kf, vf = fused.permute(2, 0, 3, 1, 4).unbind(0)
    for args in ((q, k, v), (qf, kf, vf), (qf, k, v)):
        leaves = [t.clone().requires_grad_() if t.is_contiguous() else t.detach().requires_grad_() for t in args]
        for _ in range(2):                                # the first call makes the plan, the second uses it
            o, lse = torch.ops.kernelcourse.attention_fwd(*leaves, True, 0.25)
            fake_o, fake_lse = AB._attention_fwd_fake(*leaves, True, 0.25)
            assert o.stride() == fake_o.stride() == A._empty_in_layout_of(args[0]).stride(), (version, o.stride())
            assert lse.stride() == fake_lse.stride() and lse.is_contiguous()
            grads = torch.ops.kernelcourse.attention_bwd(*leaves, o, lse, do, True, 0.25)
            fakes = AB._attention_bwd_fake(*leaves, o, lse, do, True, 0.25)
            assert [g.stride() for g in grads] == [f.stride() for f in fakes], version
        o64, grads64 = truth(*args, do, causal=True, sm_scale=0.25)
        assert (o.double() - o64).abs().max().item() <= tolerance(q.dtype, o64), f"v{version}"
    torch.library.opcheck(torch.ops.kernelcourse.attention_fwd.default, (*leaves, True, 0.25))


def test_compiles_with_fullgraph_and_matches_eager():
    torch._dynamo.reset()

    def loss(q, k, v, w):
        return (AB.attention(q, k, v, causal=True) * w).sum()

    q, k, v, w = make(1, 4, 2, 24, 24, 16, seed=5)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*eager, w).backward()
    compiled = [t.clone().requires_grad_() for t in (q, k, v)]
    value = torch.compile(loss, fullgraph=True)(*compiled, w)   # fullgraph: a graph break is an error
    value.backward()
    tol = 1e-5 if DTYPE == torch.float32 else 1e-2   # the compiled sum may round differently in float16
    torch.testing.assert_close(value, loss(*eager, w), rtol=tol, atol=tol)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)
    explained = torch._dynamo.explain(loss)(*compiled, w)
    assert explained.graph_break_count == 0, explained.break_reasons


# ---- what attention refuses ------------------------------------------------------------------------


def test_a_second_derivative_raises_instead_of_missing_terms():
    q, k, v, _ = make(1, 2, 1, 16, 16, 16, seed=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for fn in (lambda: AB.attention(*leaves, causal=True), lambda: AB.FlashAttention.apply(*leaves, True, None)):
        with pytest.raises(RuntimeError, match="no second derivative"):
            dq, = torch.autograd.grad(fn().square().sum(), leaves[:1], create_graph=True)
            (dq.square().sum() + leaves[0].sum()).backward()
    # the operator, as torch.compile runs it: the backward's result has a grad_fn that raises
    o, lse = torch.ops.kernelcourse.attention_fwd(*leaves, True, 0.25)
    dq, = torch.autograd.grad(o.square().sum(), leaves[:1], create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        dq.sum().backward()


# ---- inputs that take the copy fallback, large head dims, bfloat16 -----------------------------------


def test_misaligned_inputs_are_copied_and_still_right():
    """A tensor that starts one element into its storage is not 16-byte aligned: a tensor descriptor
    cannot read it, and the launcher copies it."""
    B, H, n, d = 1, 2, 19, 16
    g = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(B * H * n * d + 1, generator=g)[1:].view(B, H, n, d).to(DTYPE) for _ in range(4))
    if GPU:
        q, k, v, do = (torch.empty(B * H * n * d + 1, device=DEVICE, dtype=DTYPE)[1:].view(B, H, n, d).copy_(t)
                       for t in (q, k, v, do))
    assert q.data_ptr() % 16 != 0 and A._descriptor_ready(q) is not q
    check(q, k, v, do, causal=True)


@pytest.mark.parametrize("d", [128, 256])
def test_large_head_dims(d):
    check(*make(1, 2, 1, 20, 27, d, seed=d), causal=True)


bf16 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)),
                          reason="bfloat16 needs a CUDA GPU of compute capability 8.0 or newer")


@bf16
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H, h_kv, d", [(4, 4, 64), (8, 2, 128)])
def test_bfloat16(causal, H, h_kv, d):
    check(*make(2, H, h_kv, 300, 300, d, dtype=torch.bfloat16, seed=d), causal=causal)


def test_bfloat16_in_the_interpreter_is_refused():
    if GPU:
        pytest.skip("bfloat16 runs on this GPU")
    q, k, v, _ = make(1, 1, 1, 8, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 does not run in Triton's interpreter"):
        AB.attention(q, k, v)


def test_chapter_06_module_imports_nothing_from_chapter_07():
    """The modules are layered: kernelcourse.attention (the forward) below kernelcourse.attention_backward
    (the backward and the public ``attention``), which imports it; never the other way round."""
    import subprocess
    import sys

    from tests.helpers import env_importing

    code = ("import sys, kernelcourse as kc; kc.setup(quiet=True); import kernelcourse.attention; "
            "assert 'kernelcourse.attention_backward' not in sys.modules, 'attention imported attention_backward'")
    src = __import__("pathlib").Path(kc.__file__).parents[1]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_importing(src),
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
