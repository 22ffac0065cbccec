"""The lean launch paths and the ``torch.ops.kernelcourse`` operators (chapter 09): the lean paths compute
exactly what the readable launchers compute, the operators pass ``torch.library.opcheck``, and chapter 08's
block and GPT compile with ``torch.compile(fullgraph=True)`` without a graph break. Tiny sizes: on the CPU
the kernels run in Triton's interpreter."""
import re

import pytest
import torch
import torch.nn.functional as F

import kernelcourse as kc
from kernelcourse import attention as kca
from kernelcourse import attention_backward as kcb
from kernelcourse import kernels as K
from kernelcourse import launch
from kernelcourse import transformer as T
from kernelcourse.world import low_precision_dtype

ops = torch.ops.kernelcourse
GPU = kc.world().gpu
needs_cuda = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


def _dev():
    return kc.world().device


# ---- the lean paths compute what the readable launchers compute -----------------------------------


def _twice(fn, *args):
    """The lean path's first call goes through the readable launcher and records its options; the second
    is the lean launch, through Triton's launch, which keeps the compiled kernel; the third launches that
    compiled kernel directly (on a GPU: ``kernelcourse.launch``, switched on here). All three are returned."""
    K._LAUNCH.clear()
    T._LN_BACKWARD.clear()
    launch.DIRECT.clear()
    enabled, launch.ENABLED = launch.ENABLED, True
    try:
        return fn(*args), fn(*args), fn(*args)
    finally:
        launch.ENABLED = enabled


@pytest.mark.parametrize("rows, cols", [(7, 37), (33, 300), (5, 1000)])  # several rows per program, one
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_lean_is_softmax(rows, cols, dtype):
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols, device=_dev()) * 8).to(dtype)
    want = K.softmax(x)
    for got in _twice(K.softmax_lean, x):
        assert torch.equal(got, want)
    x2 = (torch.randn(rows + 4, cols, device=_dev()) * 8).to(dtype)  # another row count, the same options
    assert torch.equal(K.softmax_lean(x2), K.softmax(x2))


@pytest.mark.parametrize("rows, cols, dtype", [(9, 50, torch.float32), (6, 200, torch.float16)])
def test_residual_layer_norm_lean_is_the_launcher(rows, cols, dtype):
    torch.manual_seed(cols)
    x, r = ((torch.randn(rows, cols, device=_dev()) * 3 + 1).to(dtype) for _ in range(2))
    w, b = torch.rand(cols, device=_dev()) + 0.5, torch.randn(cols, device=_dev())
    want = K.residual_layer_norm(x, r, w, b, 1e-5, return_residual=True)
    for got in _twice(K.residual_layer_norm_lean, x, r, w, b, 1e-5):
        assert all(torch.equal(g, t) for g, t in zip(got, want))


@pytest.mark.parametrize("activation", ["", "gelu"])
def test_matmul_lean_is_matmul(activation):
    torch.manual_seed(1)
    a, b = torch.randn(70, 45, device=_dev()), torch.randn(45, 38, device=_dev())
    want = K.matmul(a, b, activation)
    for got in _twice(K.matmul_lean, a, b, activation):
        assert torch.equal(got, want)
    bt = b.t().contiguous().t()  # B transposed in memory: another specialisation, the same options
    assert torch.equal(K.matmul_lean(a, bt, activation), K.matmul(a, bt, activation))


@pytest.mark.parametrize("with_dres", [False, True])
def test_layer_norm_backward_lean_is_the_launcher(with_dres):
    torch.manual_seed(2)
    h, dy, dres = (torch.randn(37, 50, device=_dev()) for _ in range(3))
    w = torch.rand(50, device=_dev()) + 0.5
    dx, dw, db = T.layer_norm_backward(h, w, dy, 1e-5, dres=dres if with_dres else None)
    for got_dx, dwdb in _twice(T.layer_norm_backward_lean, h, w, dy, dres if with_dres else None, 1e-5):
        assert torch.equal(got_dx, dx) and torch.equal(dwdb[0], dw) and torch.equal(dwdb[1], db)


# ---- the operators ----------------------------------------------------------------------------------


def _opcheck(op, args):
    torch.library.opcheck(op, args)  # schema, autograd registration, fake tensors, AOT dispatch


def test_softmax_operator():
    x = torch.randn(5, 37, device=_dev())
    _opcheck(ops.softmax.default, (x,))
    _opcheck(ops.softmax.default, (x.clone().requires_grad_(True),))
    xg = x.clone().requires_grad_(True)
    y = ops.softmax(xg)
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, xg, g)
    (want,) = torch.autograd.grad(torch.softmax(xg, -1), xg, g)
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-6)


def test_residual_layer_norm_operator():
    dev = _dev()
    x, r = (torch.randn(6, 40, device=dev) for _ in range(2))
    w, b = torch.rand(40, device=dev) + 0.5, torch.randn(40, device=dev)
    _opcheck(ops.residual_layer_norm.default, (x, r, w, b, 1e-5))
    grads = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
    _opcheck(ops.residual_layer_norm.default, (*grads, 1e-5))
    y, h = ops.residual_layer_norm(*grads)  # eps left to its default
    torch.testing.assert_close(y, F.layer_norm(x + r, (40,), w, b), rtol=1e-5, atol=1e-5)
    assert y.grad_fn is not None and "ResidualLayerNorm" in type(y.grad_fn).__name__


def test_layer_norm_backward_operator():
    dev = _dev()
    h, dy, dres = (torch.randn(9, 33, device=dev) for _ in range(3))
    w = torch.rand(33, device=dev) + 0.5
    _opcheck(ops.layer_norm_backward.default, (h, w, dy, dres, 1e-5))
    _opcheck(ops.layer_norm_backward.default, (h, w, dy, None, 1e-5))
    # with inputs that need a gradient, opcheck checks that autograd is registered (it raises, below)
    torch.library.opcheck(ops.layer_norm_backward.default, (h, w, dy.clone().requires_grad_(), dres, 1e-5),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_a_second_derivative_of_the_layer_norm_raises():
    """create_graph=True through the course's LayerNorm: the backward of its backward raises and says what to
    use instead, where PyTorch would warn and leave the terms through the backward kernel out."""
    from kernelcourse.transformer import NO_SECOND_DERIVATIVE, residual_layer_norm

    dev = _dev()
    x = torch.randn(6, 40, device=dev, requires_grad=True)
    r, b = torch.randn(6, 40, device=dev), torch.randn(40, device=dev)
    w = torch.randn(40, device=dev, requires_grad=True)
    y, _ = residual_layer_norm(x, r, w, b)
    (gx,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=re.escape(NO_SECOND_DERIVATIVE)):
        gx.sum().backward()


def test_matmul_operator():
    dev = _dev()
    a, b = torch.randn(20, 24, device=dev), torch.randn(24, 18, device=dev)
    _opcheck(ops.matmul.default, (a, b, ""))
    _opcheck(ops.matmul.default, (a.clone().requires_grad_(True), b.clone().requires_grad_(True), "gelu"))


# ---- torch.compile(fullgraph=True) --------------------------------------------------------------------


def _sdpa_attention(q, k, v, causal=False, sm_scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def _graph_breaks(fn, *args) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(b.reason).splitlines()[0][:200] for b in ex.break_reasons]


_ATTENTION_IS_AN_OPERATOR = []


@pytest.fixture
def attention_compiles():
    """Whether chapter 07's ``attention`` can be traced with fake tensors, as ``torch.compile``
    does (it can once it is a PyTorch operator with a fake function; a Triton launch on fake tensors
    fails); a test of the whole block is an expected failure until then. Cheaper than asking Dynamo,
    which would trace into Triton's interpreter for half a minute before it gave up."""
    if not _ATTENTION_IS_AN_OPERATOR:
        from unittest import mock

        from torch._subclasses.fake_tensor import FakeTensorMode

        try:  # is_compiling: the path attention takes when traced, where it may differ from the eager one
            with FakeTensorMode(), mock.patch("torch.compiler.is_compiling", return_value=True):
                q = torch.randn(1, 2, 16, 16, device=_dev())
                _course_attention()(q, q, q, causal=True)
            _ATTENTION_IS_AN_OPERATOR.append(True)
        except Exception:  # noqa: BLE001 - "Cannot access data pointer" and the like
            _ATTENTION_IS_AN_OPERATOR.append(False)
    if not _ATTENTION_IS_AN_OPERATOR[0]:
        pytest.xfail("chapter 07's attention cannot be traced with fake tensors: it is not yet a PyTorch operator")


def _course_attention():
    """Chapter 07's differentiable attention, from the module the block imports it from."""
    return getattr(kcb, "attention", None) or kca.attention


@pytest.fixture
def sdpa_attention(monkeypatch):
    """The course's block with SDPA in place of chapter 07's attention: everything else is this module's."""
    for module in (kca, kcb):
        if hasattr(module, "attention"):
            monkeypatch.setattr(module, "attention", _sdpa_attention)


def _tiny_pair(triton_matmuls=T.MATMULS):
    return T.make_pair(2, 16, 32, 2, torch.float32, triton_matmuls=triton_matmuls)


def test_course_block_compiles_whole_apart_from_attention(sdpa_attention):
    _, course, h, delta = _tiny_pair()
    assert _graph_breaks(course, h, delta) == (0, [])


def test_course_block_compiles_whole(attention_compiles):
    """Depends on chapter 07's attention being an operator."""
    _, course, h, delta = _tiny_pair()
    assert _graph_breaks(course, h, delta) == (0, [])
    _compiled_matches_eager(course, (h, delta), "aot_eager")


def _compiled_matches_eager(model, args, backend):
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    outs = []
    for fn in (model, compiled):
        for p in model.parameters():
            p.grad = None
        out = fn(*args)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
        outs.append([o.detach() for o in out] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_compiled_course_block_matches_eager(sdpa_attention):
    """Forward and backward through AOT autograd (the operators' fake functions and autograd), without
    Inductor's code generation, which on the CPU takes long and tests PyTorch rather than the course."""
    _, course, h, delta = _tiny_pair()
    _compiled_matches_eager(course, (h, delta), "aot_eager")


def _tiny_gpt():
    torch.manual_seed(0)
    model = T.GPT(vocab=11, d_model=32, n_heads=2, n_layers=1, seq_len=16, impl="course",
                  triton_matmuls=T.MATMULS, device=_dev())
    idx = torch.randint(0, 11, (2, 16), device=_dev())
    return model, idx, torch.roll(idx, -1, 1)


def test_gpt_compiles_whole_apart_from_attention(sdpa_attention):
    model, idx, targets = _tiny_gpt()
    assert _graph_breaks(model, idx, targets) == (0, [])


def test_gpt_compiles_whole(attention_compiles):
    """Depends on chapter 07's attention being an operator."""
    model, idx, targets = _tiny_gpt()
    assert _graph_breaks(model, idx, targets) == (0, [])


# ---- on a GPU: Inductor, and CUDA graphs with mode="reduce-overhead" ------------------------------------


def _check_reduce_overhead_graphs_the_block_step():
    """The compiled course block, forward and backward, replayed as CUDA graphs: no cudagraph skips (a skip
    means Inductor found something it cannot capture and ran that part launch by launch)."""
    from torch._dynamo.utils import counters

    dtype = low_precision_dtype()
    _, course, h, delta = T.make_pair(2, 128, 128, 2, dtype, triton_matmuls=T.MATMULS)
    grads = (torch.randn_like(h), torch.randn_like(h))
    x, m = course(h, delta)  # eager first: the kernels tune here, not during reduce-overhead's warm-up
    torch.autograd.backward((x, m), grads)
    ref_x, ref_m = x.detach().clone(), m.detach().clone()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(course, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):  # warm-up runs, then recording, then replays
        x, m = compiled(h, delta)
        torch.autograd.backward((x, m), grads)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch.testing.assert_close(x, ref_x, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(m, ref_m, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_reduce_overhead_graphs_the_block_step_apart_from_attention(sdpa_attention):
    _check_reduce_overhead_graphs_the_block_step()


@needs_cuda
def test_reduce_overhead_graphs_the_block_step(attention_compiles):
    """Depends on chapter 07's attention being an operator."""
    _check_reduce_overhead_graphs_the_block_step()


@needs_cuda
def test_inductor_compiled_gpt_trains_like_eager(attention_compiles):
    model, idx, targets = _tiny_gpt()
    loss = model(idx, targets)
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(idx, targets), loss, rtol=1e-3, atol=1e-3)
