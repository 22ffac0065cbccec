"""Fused cross-entropy over a large vocabulary (chapter 08, the tiny GPT's loss).

Eager ``F.cross_entropy`` on an (N, V) tensor of logits makes the log-softmax (N x V) in the forward,
and in the backward the gradient of that log-softmax (N x V) and the gradient of the logits (N x V):
three tensors the size of the logits besides the logits themselves. At 8192 tokens and GPT-2's
vocabulary of 50,257 in bf16 each one is 823 MB.

``cross_entropy_kernel`` computes the loss and the gradient of the logits together, one program per
row, in two sweeps over the row in chunks of ``BLOCK`` values:

1. an online log-sum-exp (chapter 06's online softmax: a running max ``m`` and a running sum of
   ``exp(x - m)``, rescaled whenever the max grows), so that the row never has to fit in registers;
2. the gradient, ``(softmax(x) - onehot(target)) / n_valid`` for the mean, written chunk by chunk.

The second sweep reads the row again just after the first read it, mostly from the L2 cache. No
log-softmax is ever stored. This is Liger-Kernel's approach; Liger also writes the gradient over the
logits, which makes the gradient the only N x V tensor there is.

``cross_entropy`` is the operator with autograd, ``torch.ops.kernelcourse.cross_entropy``, made with
``torch.library.custom_op``, so that ``torch.compile`` can trace through it (``register_fake``) and
``loss.backward()`` works (``register_autograd``). The choice about the in-place write: an operator
with a registered autograd formula must be functional (PyTorch refuses ``register_autograd`` for an
operator that mutates its inputs), and overwriting a tensor that autograd tracks would make any other
use of the logits read gradients. So the operator writes the gradient into a new buffer, which it
returns next to the loss and saves for the backward: besides the logits, one N x V tensor (the
gradient, which any method must produce) instead of eager's three. Where no autograd is involved
(a training loop that calls the head's backward itself), ``cross_entropy_forward_backward(...,
grad=logits)`` writes the gradient over the logits, as Liger does: each chunk is read before the same
chunk is written, by the same program.

``ignore_index`` rows (padding) add nothing to the loss and get a zero gradient; the mean divides by
the number of rows that are not ignored, as ``F.cross_entropy`` does.

Import it after ``kc.setup()``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .world import world

__all__ = ["cross_entropy", "cross_entropy_ref", "cross_entropy_forward_backward", "cross_entropy_kernel",
           "bench_cross_entropy", "CE_CONFIGS"]

IGNORE_INDEX = -100  # F.cross_entropy's default


def cross_entropy_ref(logits, target, ignore_index: int = IGNORE_INDEX, reduction: str = "mean"):
    """The spec: ``F.cross_entropy`` (chapter 08)."""
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@triton.jit
def cross_entropy_kernel(logits_ptr, grad_ptr, target_ptr, loss_ptr, count_ptr, n_cols, stride_logits,
                         stride_grad, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 at 32768 tokens x a 128K vocabulary
    x_row = logits_ptr + row * stride_logits
    g_row = grad_ptr + row * stride_grad
    lanes = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    # the mean divides by the number of rows that are not ignored, counted before the launch
    scale = 1.0
    if MEAN:
        scale = 1.0 / tl.load(count_ptr).to(tl.float32)
    scale = tl.where(valid, scale, 0.0)  # an ignored row: no gradient (even when every row is ignored)

    # Sweep 1: the online log-sum-exp. Invariant: after each chunk, m is the max of the values seen so
    # far and d = sum of exp(x - m) over them; a larger max rescales d by exp(m_old - m_new) <= 1.
    m = -float("inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)  # -inf adds exp() = 0
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    x_target = tl.load(x_row + target, mask=valid, other=0.0).to(tl.float32)  # an ignored target is no column
    # loss = logsumexp(x) - x[target] = (m - x[target]) + log(d): m - x[target] first, both large and close,
    # so that the small result keeps its digits
    tl.store(loss_ptr + row, tl.where(valid, (m - x_target) + tl.log(d), 0.0))
    inv_d = 1.0 / d

    # Sweep 2: d loss / d x = (softmax(x) - onehot(target)) * scale, softmax(x) = exp(x - m) / d, written
    # chunk by chunk. Each chunk is read before it is written, by this program alone: grad_ptr may be
    # logits_ptr (in place).
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - m) * inv_d
        g = tl.where(cols == target, p - 1.0, p) * scale
        tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


# Candidates for the autotuner on a GPU (chunk of the vocabulary, warps). The logits are restored after
# each trial, so that the in-place form (grad = logits) can be tuned too.
CE_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w)
              for b, w in ((2048, 8), (4096, 8), (4096, 16), (8192, 16), (16384, 16), (16384, 32), (32768, 32))]
_ce_tuned = None


def cross_entropy_forward_backward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                                   reduction: str = "mean", grad: torch.Tensor | None = None, BLOCK: int | None = None):
    """``(loss, d loss / d logits)`` for ``F.cross_entropy(logits, target)`` in one launch (chapter 08).

    ``logits`` is (N, V) with rows of stride-1 values, ``target`` (N,) integers. The loss is float32.
    ``grad`` is where the gradient goes: a new tensor by default; pass ``grad=logits`` to write it over
    the logits (then the logits are gone). On the CPU the chunk is at most 1024 values; on a GPU it is
    autotuned per vocabulary size unless ``BLOCK`` is given.
    """
    global _ce_tuned
    assert logits.ndim == 2 and logits.stride(1) == 1 and target.shape == logits.shape[:1]
    assert reduction in ("mean", "sum")
    n_rows, n_cols = logits.shape
    grad = torch.empty_like(logits) if grad is None else grad
    assert grad.shape == logits.shape and grad.stride(1) == 1
    row_loss = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    count = (target != ignore_index).sum()  # stays on the device: no synchronisation
    args = (logits, grad, target, row_loss, count, n_cols, logits.stride(0), grad.stride(0), ignore_index)
    mean = reduction == "mean"
    if n_rows:
        if BLOCK is None and world().gpu:
            if _ce_tuned is None:
                _ce_tuned = triton.autotune(CE_CONFIGS, key=["n_cols"], restore_value=["logits_ptr"])(cross_entropy_kernel)
            _ce_tuned[(n_rows,)](*args, MEAN=mean)
        else:
            BLOCK = BLOCK or min(1024, triton.next_power_of_2(n_cols))
            cross_entropy_kernel[(n_rows,)](*args, MEAN=mean, BLOCK=BLOCK, num_warps=min(16, max(4, BLOCK // 1024)))
    loss = row_loss.sum()
    return (loss / count if mean else loss), grad


# ---- the operator, with autograd ---------------------------------------------------------------


NO_SECOND_DERIVATIVE = ("kernelcourse's cross-entropy has no second derivative: its backward hands on the gradient "
                        "its forward kernel wrote, which autograd sees as a constant. Use "
                        "torch.nn.functional.cross_entropy where you need one (create_graph=True)")


@torch.library.custom_op("kernelcourse::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                      reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    loss, grad = cross_entropy_forward_backward(logits, target, ignore_index, reduction)
    return loss.to(logits.dtype), grad


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, reduction):
    return logits.new_empty(()), torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    _, grad = output
    ctx.mark_non_differentiable(grad)
    # Nothing flows back into the second output, and autograd would otherwise hand the backward a tensor
    # of zeros for it: a second N x V buffer. Unmaterialized, that gradient arrives as None.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad)


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a stand-in that torch.compile (or opcheck) traces with, not real data."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def _backward(ctx, d_loss, d_grad):
    (grad,) = ctx.saved_tensors
    if d_loss is None:  # no gradient reached the loss (the gradients are not materialized as zeros)
        return None, None, None, None
    if _traced(grad):
        return grad * d_loss, None, None, None  # traced: the graph must not depend on d_loss's value
    if torch.is_grad_enabled():  # create_graph=True: the saved gradient is a constant to autograd
        raise RuntimeError(NO_SECOND_DERIVATIVE)
    # Run eagerly, the saved gradient is handed on as it is, with no second N x V buffer, multiplied in
    # place by d_loss where d_loss is not 1 (a scaled loss). loss.backward() on the loss itself sends 1, and
    # the GPU finds that out (scale_rows_kernel), not the CPU: d_loss.item() would make the CPU wait for
    # the forward's kernel, and a CUDA graph cannot capture that wait. A second backward through the same
    # graph (retain_graph=True) would multiply again: the loss ends the graph and is backpropagated once.
    scale_rows_(grad, d_loss)
    return grad, None, None, None


@triton.jit
def scale_rows_kernel(x_ptr, factor_ptr, n_cols, stride, BLOCK: tl.constexpr):
    # x[row] *= factor, in place, one program per row, unless factor is 1: then every program returns
    # after loading it, and no row is read.
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        x_row = x_ptr + tl.program_id(0).to(tl.int64) * stride
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask).to(tl.float32)
            tl.store(x_row + cols, (x * factor).to(x_ptr.dtype.element_ty), mask=mask)


def scale_rows_(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x *= factor`` in place for a 2D ``x`` with rows of stride-1 values and a one-element ``factor`` on
    ``x``'s device, with no work and no synchronisation when ``factor`` is 1 (the backward of a loss)."""
    assert x.ndim == 2 and x.stride(1) == 1 and factor.numel() == 1 and factor.device == x.device
    if x.numel():
        block = min(1024 if not world().gpu else 4096, triton.next_power_of_2(x.shape[1]))
        scale_rows_kernel[(x.shape[0],)](x, factor, x.shape[1], x.stride(0), BLOCK=block, num_warps=8)
    return x


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` as one fused operator (chapter 08).

    ``logits`` (N, V), ``target`` (N,); ``reduction`` "mean" (over the rows not ignored) or "sum". The
    loss has the logits' dtype, as ``F.cross_entropy``'s; ``loss.backward()`` gives the logits their
    gradient, computed in the forward (see the module's docstring).
    """
    return torch.ops.kernelcourse.cross_entropy(logits, target, ignore_index, reduction)[0]


# ---- the benchmark (GPU) -----------------------------------------------------------------------


def bench_cross_entropy(n_tokens: int = 8192, vocab: int = 50257, dtype=torch.bfloat16) -> list[dict]:
    """Forward + backward of the loss on (n_tokens, vocab) logits, on a GPU: eager ``F.cross_entropy``,
    ``torch.compile`` of it, this module's operator, and the in-place form (gradient over the logits).

    One row per version: ``ms`` (median of ``kc.bench.do_bench``), ``extra_mb`` (the peak of
    ``torch.cuda.max_memory_allocated`` during one forward + backward, minus the memory allocated before
    it, the logits included: what the loss costs beyond its input), and the ratios to eager (``x_eager``:
    eager's time over this one's; ``mem_vs_eager``: this one's extra memory over eager's) and to
    ``torch.compile`` (``x_compile``). Every version is checked against eager before it is timed.
    """
    from . import bench

    if not world().gpu:
        raise RuntimeError("bench_cross_entropy needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(n_tokens, vocab, device="cuda", dtype=torch.float32, generator=gen).mul_(4).to(dtype)
    target = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=gen)
    target[::17] = IGNORE_INDEX  # some padding rows
    logits = base.clone().requires_grad_(True)
    compiled = torch.compile(lambda lg, t: torch.nn.functional.cross_entropy(lg, t, ignore_index=IGNORE_INDEX))

    def autograd_step(loss_fn):
        def step():
            logits.grad = None
            loss = loss_fn(logits, target)
            loss.backward()
            return loss
        return step

    inplace_logits = base.clone()

    def inplace_step():
        inplace_logits.copy_(base)  # the step destroys its input; restore it (counted in the time, see below)
        return cross_entropy_forward_backward(inplace_logits, target, grad=inplace_logits)[0]

    versions = {
        "eager F.cross_entropy": autograd_step(lambda lg, t: torch.nn.functional.cross_entropy(lg, t, ignore_index=IGNORE_INDEX)),
        "torch.compile": autograd_step(compiled),
        "fused (kernelcourse::cross_entropy)": autograd_step(cross_entropy),
        "fused, gradient over the logits": inplace_step,
    }
    want_loss = versions["eager F.cross_entropy"]().float()
    want_grad = logits.grad.float()
    grad_scale = want_grad.abs().max().item()  # gradients of a mean over 8192 rows are small: a relative atol
    rows = []
    copy_ms = bench.do_bench(lambda: inplace_logits.copy_(base))
    for name, step in versions.items():
        loss = step()  # compile, tune, and check before timing
        got_grad = inplace_logits if name.startswith("fused, gradient") else logits.grad
        torch.testing.assert_close(loss.float(), want_loss, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_grad.float(), want_grad, rtol=2e-2, atol=1e-3 * grad_scale)
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        ms = bench.do_bench(step)
        if name.startswith("fused, gradient"):
            ms -= copy_ms  # the restoring copy is the benchmark's, not the loss's
        rows.append({"impl": name, "tokens": n_tokens, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
                     "ms": ms, "extra_mb": extra / 1e6})
        logits.grad = None
    eager, comp = rows[0], rows[1]
    for r in rows:
        r["x_eager"] = eager["ms"] / r["ms"]
        r["x_compile"] = comp["ms"] / r["ms"]
        r["mem_vs_eager"] = r["extra_mb"] / eager["extra_mb"]
    return rows
