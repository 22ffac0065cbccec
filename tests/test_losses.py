"""The fused cross-entropy of chapter 08 (kernelcourse.losses): loss and gradient against F.cross_entropy in
float64, on vocabularies that are not multiples of the chunk, with ignored rows; the operator passes opcheck
and compiles. Kernels run in Triton's interpreter on the CPU."""
import re

import pytest
import torch
import torch.nn.functional as F

import kernelcourse as kc
from kernelcourse import losses as L

DEV = kc.world().device


def _case(n, v, seed, scale=30.0, ignored=(1,)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).float()
    t = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        if i < n:
            t[i] = -100
    return x.to(DEV), t.to(DEV)


@pytest.mark.parametrize("n, v, block", [(5, 1000, 256), (7, 257, 64), (3, 1, 64), (4, 1024, 1024), (6, 300, None)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradient_match_float64(n, v, block, reduction):
    x, t = _case(n, v, seed=n * v)
    loss, grad = L.cross_entropy_forward_backward(x, t, reduction=reduction, BLOCK=block)
    x64 = x.double().requires_grad_(True)
    want = F.cross_entropy(x64, t, reduction=reduction)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    assert (grad[1] == 0).all() if n > 1 else True  # an ignored row gets no gradient


def test_large_logits_do_not_overflow_and_in_place_overwrites_the_logits():
    x, t = _case(4, 777, seed=3, scale=1.0, ignored=())
    x = x + 5000.0  # exp(5000) overflows: the max must be subtracted
    want_x = x.double().requires_grad_(True)
    want = F.cross_entropy(want_x, t)
    want.backward()
    buf = x.clone()
    loss, grad = L.cross_entropy_forward_backward(buf, t, grad=buf, BLOCK=128)
    assert grad.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(buf.double(), want_x.grad, rtol=1e-5, atol=1e-6)


def test_all_rows_ignored_gives_nan_like_pytorch():
    x, t = _case(3, 50, seed=1, ignored=(0, 1, 2))
    loss, grad = L.cross_entropy_forward_backward(x, t)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x, t))
    assert (grad == 0).all()


def test_operator_autograd_matches_and_a_scaled_loss_scales_the_gradient():
    x, t = _case(6, 300, seed=7)
    for factor in (1.0, 0.25):
        a = x.clone().requires_grad_(True)
        (L.cross_entropy(a, t) * factor).backward()
        b = x.double().requires_grad_(True)
        (F.cross_entropy(b, t) * factor).backward()
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-6)


def test_the_backward_never_asks_the_cpu_for_the_losss_gradient():
    """Whether d_loss is 1 is decided on the device: no .item() (aten._local_scalar_dense), which would make
    the CPU wait for the forward's kernel and cannot be captured in a CUDA graph; with 1 and with a scale."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, t = _case(5, 77, seed=13)
    for factor in (1.0, 3.0):
        a = x.clone().requires_grad_(True)
        loss = L.cross_entropy(a, t) * factor
        with Record():
            loss.backward()
        assert seen and not [f for f in seen if "_local_scalar_dense" in f], seen


@pytest.mark.parametrize("n, v", [(3, 1), (4, 1000), (5, 1500)])
def test_scale_rows_multiplies_in_place_and_leaves_every_bit_alone_at_one(n, v):
    """Rows of odd lengths, and rows past one chunk (1024 in the interpreter), inside a wider buffer (a
    row stride larger than the row); the columns past the view are never touched."""
    g = torch.Generator().manual_seed(n * v)
    buf = torch.randn(n, v + 7, generator=g).to(DEV)
    x, frame = buf[:, :v], buf[:, v:].clone()
    want = x.clone()
    L.scale_rows_(x, torch.tensor(1.0, device=DEV))
    assert torch.equal(x, want)
    L.scale_rows_(x, torch.tensor(-2.5, device=DEV))
    torch.testing.assert_close(x, want * -2.5, rtol=0, atol=0)
    assert torch.equal(buf[:, v:], frame)


def test_a_second_derivative_raises():
    """create_graph=True: the gradient the forward kernel wrote is a constant to autograd, so a backward of the
    backward would leave out the softmax's own derivative; it raises and says what to use instead."""
    x, t = _case(4, 300, seed=3)
    a = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=re.escape(L.NO_SECOND_DERIVATIVE)):
        torch.autograd.grad(L.cross_entropy(a, t), a, create_graph=True)


def test_opcheck_passes():
    x, t = _case(6, 300, seed=11)
    x.requires_grad_(True)
    result = torch.library.opcheck(torch.ops.kernelcourse.cross_entropy.default, (x, t, -100, "mean"))
    assert all(v == "SUCCESS" for v in result.values()), result
    result = torch.library.opcheck(torch.ops.kernelcourse.cross_entropy.default, (x, t, -100, "sum"))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_compiles_with_fullgraph():
    x, t = _case(5, 129, seed=5)
    a = x.clone().requires_grad_(True)
    loss = torch.compile(lambda lg, tg: L.cross_entropy(lg, tg), fullgraph=True)(a, t)
    loss.backward()
    b = x.double().requires_grad_(True)
    F.cross_entropy(b, t).backward()
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not kc.world().gpu, reason="the benchmark needs a CUDA GPU")
def test_bench_cross_entropy_runs_small():
    rows = L.bench_cross_entropy(n_tokens=256, vocab=1000)
    assert {r["impl"] for r in rows} >= {"eager F.cross_entropy", "torch.compile", "fused (kernelcourse::cross_entropy)"}
    fused = next(r for r in rows if r["impl"] == "fused (kernelcourse::cross_entropy)")
    assert fused["mem_vs_eager"] < 1.0


def test_the_gradient_buffer_made_in_the_forward_becomes_the_logits_grad_without_a_copy(monkeypatch):
    made = []
    original = L.cross_entropy_forward_backward

    def spy(*args, **kwargs):
        loss, grad = original(*args, **kwargs)
        made.append(grad.data_ptr())
        return loss, grad

    monkeypatch.setattr(L, "cross_entropy_forward_backward", spy)
    x, t = _case(6, 300, seed=2)
    x.requires_grad_(True)
    L.cross_entropy(x, t).backward()
    assert x.grad.data_ptr() == made[0]  # one N x V buffer in all: the memory the benchmark's target counts on


def test_no_other_tensor_the_size_of_the_logits_is_made():
    """Forward and backward through the operator make one N x V tensor, the gradient, and no other: in
    particular autograd does not hand the backward a tensor of zeros for the operator's second output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, v = 6, 300
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            for o in (out if isinstance(out, (tuple, list)) else (out,)):  # new memory only: no views, no in-place
                if isinstance(o, torch.Tensor) and o.numel() == n * v and o.data_ptr() not in given:
                    made.append(str(func))
            return out

    x, t = _case(n, v, seed=3)
    x.requires_grad_(True)
    with Record():
        L.cross_entropy(x, t).backward()
    assert made == ["kernelcourse.cross_entropy.default"], made
    x.grad = None
    with Record():
        (L.cross_entropy(x, t) * 3.0).backward()  # a scaled loss: multiplied in place, still one buffer
    assert made[1:] == ["kernelcourse.cross_entropy.default"], made


@pytest.mark.skipif(not kc.world().gpu, reason="CUDA graphs need a CUDA GPU")
def test_forward_and_backward_through_the_operator_replay_in_a_cuda_graph():
    """A training step can be captured whole: nothing in the operator's forward or backward waits for the
    GPU. Replayed on new logits copied into the captured buffer, the gradient is that of the new logits."""
    from kernelcourse.transformer import cuda_graph

    x, t = _case(64, 5000, seed=17)
    logits = x.clone().requires_grad_(True)

    def step():
        logits.grad = None
        (L.cross_entropy(logits, t) * 0.5).backward()  # a scaled loss: the kernel that multiplies runs too

    replay = cuda_graph(step)
    y, _ = _case(64, 5000, seed=18)
    with torch.no_grad():
        logits.copy_(y)
    replay()
    b = y.double().requires_grad_(True)
    (F.cross_entropy(b, t) * 0.5).backward()
    torch.testing.assert_close(logits.grad.double(), b.grad, rtol=1e-4, atol=1e-6)
