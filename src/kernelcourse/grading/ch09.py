"""Graders for chapter 09, from kernel to model.

09.1 registers a Triton kernel as a PyTorch operator: its forward, fake implementation and gradient are
checked against float64 on fresh inputs, then ``torch.library.opcheck`` and ``torch.compile(fullgraph=True)``
run on it. 09.2 models a step's timeline from the CPU's and the GPU's time per call, on fresh random
steps, and measures the CPU's time per call of functions whose cost is known. 09.3 is a Hugging Face
attention adapter, called the way transformers calls it. 09.4 is a training step, checked against an
eager one and, on a GPU, timed against it.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ..world import world
from . import Report, call, compare, exercise, explain, fresh_rng, number, speed_vs_peer
from .harness import diagnose, exact, tolerance, unwritten_as_nan

# ---- 09.1 a Triton kernel as an operator ----------------------------------------------------------


def _softplus64(x):
    return np.logaddexp(0.0, x)


def _sigmoid64(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _is_custom_op(obj) -> bool:
    from torch._library.custom_ops import CustomOpDef

    return isinstance(obj, CustomOpDef)


@exercise("09.1", "a Triton kernel as an operator: fake implementation, autograd, torch.compile",
          names=("softplus",), time_limit_s=240)
def grade_operator(report: Report, softplus):
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not _is_custom_op(softplus):
        what = "a plain Python function" if callable(softplus) else type(softplus).__name__
        return report.fail(f"softplus is {what}, not an operator: decorate it with "
                           "@torch.library.custom_op(\"mywork::softplus\", mutates_args=())")
    dev = world().device
    rng = fresh_rng(report)
    # the forward, on sizes that are not multiples of the block, with large values of both signs; 4097 first: one
    # element past four blocks of 1,024 (or of any smaller power of two), that a grid of n // BLOCK leaves out
    for shape in ((4097,), (1,), (1000,), (3, 77)):
        x64 = rng.standard_normal(shape) * rng.choice([1.0, 8.0, 30.0], size=shape)
        x64.flat[-1] = abs(x64.flat[-1]) + 1.0  # softplus > 1.3 there: never the NaN or 0 an unwritten element holds
        x = torch.from_numpy(x64).to(dev, torch.float32)
        with unwritten_as_nan():  # the output the operator allocates starts as NaN, not as what memory held
            got = call(report, f"softplus(x) for x of shape {shape}", softplus, x)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape:
            return report.fail(f"softplus(x) for x of shape {shape} returned "
                               f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}: "
                               "return a tensor of x's shape")
        truth = _softplus64(exact(x))
        # log(1 + e^-|x|) in float32 is good to a few units of float32's eps absolute (1 + e^-|x| is rounded)
        floor = 8 * float(np.finfo(np.float32).eps) / min(1.0, float(np.abs(truth).max()))
        ok, line = compare(got.detach().cpu().float().numpy(), truth, F.softplus(x).cpu().double().numpy(),
                           what=f"softplus(x), shape {shape}", rtol_floor=floor)
        if not ok:
            g64 = got.detach().cpu().double().numpy()
            right = np.isclose(g64, truth, rtol=1e-4, atol=1e-6).reshape(-1)
            first = int(np.argmin(right)) if not right.all() else 0
            n = right.size
            grid_hint = ("the last, partial block was never launched: the grid needs cdiv(n, BLOCK) programs, "
                         "(n + BLOCK - 1) // BLOCK, not n // BLOCK")
            if first > 0 and first % 32 == 0 and right[:first].all() and not right[first:].any():
                line += f": the elements from index {first} on are wrong, those before right: {grid_hint}"
            elif n < 32 and np.isnan(g64).all():
                # never written (NaN, unwritten_as_nan), and fewer elements than any block: n // BLOCK is 0
                line += f": n = {n} is less than one block, so n // BLOCK is 0 programs and nothing ran: {grid_hint}"
        if not report.expect(ok, line, line):
            return
    # the fake implementation: shape, dtype and device of the output without running the kernel
    for shape, dtype in (((3, 5, 7), torch.float32), ((10,), torch.float16), ((2, 1, 33), torch.float64)):
        what = f"the fake implementation for a {str(dtype).removeprefix('torch.')} input of shape {shape}"
        try:
            with FakeTensorMode() as mode:
                fake_in = mode.from_tensor(torch.empty(shape, dtype=dtype, device=dev))
                fake_out = softplus(fake_in)
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            if "fake" in text.lower() or "abstract" in text.lower() or "meta" in text.lower():
                return report.fail(f"{what}: none registered, so torch.compile cannot know the output's shape "
                                   "without running the kernel: add @softplus.register_fake returning "
                                   "torch.empty_like(x)")
            return report.fail(f"{what}: {explain(exc)}")
        if tuple(fake_out.shape) != shape or fake_out.dtype != dtype or fake_out.device != fake_in.device:
            return report.fail(f"{what}: it says the output is {str(fake_out.dtype).removeprefix('torch.')} of shape "
                               f"{tuple(fake_out.shape)} on {fake_out.device}; the kernel writes one value per input "
                               "element, in the input's dtype, on its device: return torch.empty_like(x)")
        report.ok(f"{what}: an output of the same shape and dtype")
    # the gradient, against float64
    for shape in ((1000,), (3, 77)):
        x64 = rng.standard_normal(shape) * 4
        dy64 = rng.standard_normal(shape)
        x = torch.from_numpy(x64).to(dev, torch.float32).requires_grad_(True)
        dy = torch.from_numpy(dy64).to(dev, torch.float32)
        what = f"the gradient for x of shape {shape}"
        try:
            (dx,) = torch.autograd.grad(softplus(x), x, dy)
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            if "autograd" in text.lower() or "does not require grad" in text or "grad_fn" in text:
                return report.fail(f"{what}: the operator has no backward: add one with "
                                   "softplus.register_autograd(backward, setup_context=setup_context)")
            return report.fail(f"{what}: {explain(exc)}")
        xs, dys = exact(x.detach()), exact(dy)
        truth = dys * _sigmoid64(xs)
        ref = (dy * torch.sigmoid(x.detach())).cpu().double().numpy()
        got = dx.detach().cpu().double().numpy()
        ok, line = compare(got, truth, ref, what=what, rtol_floor=8 * float(np.finfo(np.float32).eps))
        if not ok:
            hint = diagnose(got, [
                ("multiply by dy, the gradient that reaches the output (chain rule)", _sigmoid64(xs)),
                ("the derivative of log(1 + e^x) is e^x / (1 + e^x) = sigmoid(x), not 1 - sigmoid(x)",
                 dys * (1 - _sigmoid64(xs))),
                ("the derivative of softplus is sigmoid(x), not softplus(x)", dys * _softplus64(xs)),
                ("save x, the input, in setup_context: the gradient is sigmoid of the input, not of the output",
                 dys * _sigmoid64(_softplus64(xs))),
            ], tolerance(truth, ref, np.float32), truth)
            line += f": {hint}" if hint else ""
        if not report.expect(ok, line, line):
            return
    # PyTorch's own check of the registration, then a compiled graph with no break
    x = torch.from_numpy(rng.standard_normal((4, 33)) * 3).to(dev, torch.float32)
    try:
        result = torch.library.opcheck(softplus, (x,))
    except Exception as exc:  # noqa: BLE001
        return report.fail(f"torch.library.opcheck: {str(exc).strip().splitlines()[0][:200]}")
    failed = [k for k, v in result.items() if v != "SUCCESS"]
    if not report.expect(not failed, f"torch.library.opcheck: {', '.join(result)} pass",
                         f"torch.library.opcheck: {', '.join(failed)} did not pass"):
        return
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda t: softplus(t) * 2.0 + 1.0, fullgraph=True, backend="aot_eager")
        xc = x.clone().requires_grad_(True)
        out = compiled(xc)
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001
        return report.fail(f"torch.compile(fullgraph=True): {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}")
    finally:
        torch._dynamo.reset()
    want_out = 2.0 * _softplus64(exact(x)) + 1.0
    want_grad = 2.0 * _sigmoid64(exact(x))
    ok = np.allclose(out.detach().cpu().double().numpy(), want_out, rtol=1e-5, atol=1e-5) and \
        np.allclose(xc.grad.cpu().double().numpy(), want_grad, rtol=1e-5, atol=1e-5)
    report.expect(ok, "torch.compile(fullgraph=True): one graph, forward and backward match",
                  "torch.compile(fullgraph=True) compiles, but its forward or backward differs from the eager operator")


# ---- 09.2 a step's timeline from CPU and GPU time per call ------------------------------------------


def step_time_ref(cpu_us, gpu_us) -> float:
    """The end of the last kernel: call i's kernel starts when the CPU has issued it (the sum of the CPU
    times up to and including call i) and the kernel before it has finished."""
    issued, end = 0.0, 0.0
    for c, g in zip(cpu_us, gpu_us):
        issued += c
        end = max(issued, end) + g
    return end


def _spin(us: float):
    """A function that keeps the CPU busy for ``us`` microseconds per call."""
    def fn():
        stop = time.perf_counter() + us * 1e-6
        while time.perf_counter() < stop:
            pass
    return fn


def _first_call_slow(us: float, first_ms: float):
    """Costs ``first_ms`` on its first call (compiling, tuning), ``us`` on every later one."""
    state = {"first": True}
    spin = _spin(us)

    def fn():
        if state["first"]:
            state["first"] = False
            time.sleep(first_ms * 1e-3)
        spin()
    return fn


@exercise("09.2", "launch-bound or GPU-bound: a step's timeline", names=("cpu_us_per_call", "step_time", "gpu_idle_share"),
          time_limit_s=120)
def grade_timeline(report: Report, cpu_us_per_call, step_time, gpu_idle_share):
    rng = fresh_rng(report)
    # the model, on steps that are launch-bound, GPU-bound and mixed
    cases = []  # steps of many calls first: there, each wrong model of the timeline gives its own number
    for kind, lo, hi in (("mixed", 1.0, 1.0), ("launch-bound", 2.0, 1.0), ("GPU-bound", 1.0, 2.0)):
        n = int(rng.integers(5, 40))
        cpu = [float(x) for x in rng.uniform(5, 40, n) * lo]
        gpu = [float(x) for x in rng.uniform(2, 40, n) * hi]
        cases.append((f"a {kind} step of {n} calls", cpu, gpu))
    cases += [("one launch-bound call", [30.0], [5.0]), ("one GPU-bound call", [5.0], [40.0])]
    for what, cpu, gpu in cases:
        got = number(report, f"step_time({what})", step_time, list(cpu), list(gpu))
        want = step_time_ref(cpu, gpu)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9):
            follow = "follow each kernel: it starts at max(issued, previous kernel's end)"
            hints = [(sum(cpu) + sum(gpu), "the CPU issues the next call while the GPU runs the last one: they overlap"),
                     (sum(gpu), f"that is the GPU's time alone, but the GPU cannot start a kernel before the CPU has "
                                f"issued it: {follow}"),
                     (sum(cpu), f"that is the CPU's time alone, but each kernel also takes its GPU time after it is "
                                f"issued: {follow}"),
                     (sum(cpu) + gpu[-1], f"a kernel may have to wait for the one before it, not only for its launch: {follow}")]
            hint = next((h for v, h in hints if math.isclose(got, v, rel_tol=1e-6)), "")
            return report.fail(f"step_time({what}) = {got:.2f} us, expected {want:.2f} us" + (f": {hint}" if hint else ""))
        report.ok(f"step_time({what}) = {want:.1f} us")
        got = number(report, f"gpu_idle_share({what})", gpu_idle_share, list(cpu), list(gpu))
        want_idle = 1 - sum(gpu) / want
        if not math.isclose(got, want_idle, rel_tol=1e-6, abs_tol=1e-9):
            hint = ("a share is a fraction between 0 and 1" if not 0 <= got <= 1 else
                    "the GPU's busy time is the sum of its kernels' times; idle is the rest of the step"
                    if not math.isclose(got, sum(gpu) / want, rel_tol=1e-6) else
                    "that is the busy share: the idle share is 1 minus it")
            return report.fail(f"gpu_idle_share({what}) = {got:.4f}, expected {want_idle:.4f}: {hint}")
        report.ok(f"gpu_idle_share({what}) = {want_idle:.1%}")
    # the measurement: functions whose CPU time per call is known, measured by the learner and then here, in the
    # same run (a busy machine slows both alike)
    for us, first_ms in ((300.0, 0.0), (150.0, 300.0)):
        fn = _first_call_slow(us, first_ms) if first_ms else _spin(us)
        what = f"cpu_us_per_call of a function that spins for {us:.0f} us per call" + (
            f" (and {first_ms:.0f} ms on its first call)" if first_ms else "")
        got = number(report, what, cpu_us_per_call, fn, 100)
        mine = _per_call_us(fn, 100)
        if first_ms and got > 3 * mine:
            return report.fail(f"{what} = {got:.0f} us, measured here {mine:.0f} us: the first call's cost (compiling, "
                               "tuning) is in the average: call fn a few times before you start the clock")
        if not 0.4 * mine <= got <= 2.5 * mine:
            hint = ("that is in seconds or milliseconds: return microseconds" if got < mine / 100 else
                    "divide the elapsed time by the number of calls" if got > 20 * mine else
                    "time `calls` calls back to back with time.perf_counter(), and divide by `calls`")
            return report.fail(f"{what} = {got:.1f} us, measured here {mine:.0f} us: {hint}")
        report.ok(f"{what}: {got:.0f} us (measured here: {mine:.0f} us)")


def _per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


# ---- 09.3 a Hugging Face attention adapter -----------------------------------------------------------


class _Module:
    """What transformers passes as ``module``: here only whether the attention is causal."""

    def __init__(self, is_causal: bool, groups: int = 1):
        self.is_causal = is_causal
        self.num_key_value_groups = groups
        self.training = False


def _attention64(q, k, v, causal, scale):
    """Float64 attention, k and v with their own (possibly fewer) heads, query head h on key head h // group."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        s = np.where(np.arange(n_k)[None, :] <= np.arange(n_q)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


@exercise("09.3", "a Hugging Face attention adapter", names=("my_attention",), time_limit_s=180)
def grade_adapter(report: Report, my_attention):
    import torch

    from ..attention import attention_ref

    dev = world().device
    # tl.dot on float32 is TF32 on a GPU: grade in float16 there (every GPU the course supports has it)
    dt = torch.float16 if world().gpu else torch.float32
    eps = float(np.finfo(np.float16 if world().gpu else np.float32).eps)
    rng = fresh_rng(report)
    cases = [("causal, 3 heads, 37 tokens", True, 2, 3, 3, 37, 37, 16, 0.3),
             ("not causal (an encoder), 2 heads, 20 tokens", False, 1, 2, 2, 20, 20, 32, None),
             ("one query against 21 cached keys (a decoding step)", True, 2, 2, 2, 1, 21, 16, None),
             ("grouped-query: 4 query heads sharing 2 key/value heads, 29 tokens", True, 1, 4, 2, 29, 29, 16, 0.25)]
    for what, causal, B, H, H_kv, n_q, n_k, d, scaling in cases:
        q64, k64, v64 = (rng.standard_normal((B, h, n, d)) for h, n in ((H, n_q), (H_kv, n_k), (H_kv, n_k)))
        q, k, v = (torch.from_numpy(a).to(dev, dt) for a in (q64, k64, v64))
        got = call(report, what, my_attention, _Module(causal, H // H_kv), q, k, v, None, dropout=0.0, scaling=scaling)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return report.fail(f"{what}: returned {type(got).__name__}: return (attn_output, None), as transformers expects")
        out, weights = got
        if weights is not None:
            return report.fail(f"{what}: the second value is the attention weights, which FlashAttention never "
                               "holds: return None there")
        scale = scaling if scaling is not None else d ** -0.5
        is_causal = causal and n_q > 1
        qs, ks, vs = exact(q), exact(k), exact(v)
        truth = _attention64(qs, ks, vs, is_causal, scale).transpose(0, 2, 1, 3)  # (B, N, H, d)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != truth.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            hint = (": transformers expects (B, N, H, d): transpose(1, 2) the kernel's (B, H, N, d) output"
                    if shape == (B, H, n_q, d) else "")
            return report.fail(f"{what}: output {shape}, expected {truth.shape}{hint}")
        g = out.detach().cpu().double().numpy()
        kr, vr = (t.repeat_interleave(H // H_kv, dim=1) for t in (k, v))
        ref = attention_ref(q, kr, vr, causal=is_causal, sm_scale=scale, compute_dtype=dt)  # PyTorch at q's precision
        ref = ref.transpose(1, 2).cpu().double().numpy()
        ok, line = compare(g, truth, ref, what=what, rtol_floor=16 * eps)
        if not ok:
            mistakes = [("the scale comes in as `scaling`: pass it to the kernel as sm_scale",
                         _attention64(qs, ks, vs, is_causal, d ** -0.5).transpose(0, 2, 1, 3) if scaling else None),
                        ("causal only when the module is causal (module.is_causal) and there is more than one query",
                         _attention64(qs, ks, vs, not is_causal, scale).transpose(0, 2, 1, 3)),
                        ("transpose(1, 2) is the layout: a reshape of (B, H, N, d) to (B, N, H, d) mixes heads and tokens",
                         _attention64(qs, ks, vs, is_causal, scale).reshape(B, n_q, H, d))]
            hint = diagnose(g, mistakes, tolerance(truth, ref, np.float16 if world().gpu else np.float32), truth)
            line += f": {hint}" if hint else ""
        if not report.expect(ok, line, line):
            return
    # what the kernels cannot honour must raise a ValueError, never return a result
    q = torch.from_numpy(rng.standard_normal((1, 2, 8, 16))).to(dev, dt)
    refusals = [("a padding mask", dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool, device=dev).tril())),
                ("dropout=0.1", dict(attention_mask=None, dropout=0.1))]
    for what, kwargs in refusals:
        try:
            my_attention(_Module(True), q, q, q, **kwargs)
        except ValueError:
            report.ok(f"{what}: refused with a ValueError")
            continue
        except Exception as exc:  # noqa: BLE001
            return report.fail(f"{what}: raised {type(exc).__name__}, expected a ValueError that says what is "
                               "not supported")
        return report.fail(f"{what}: returned a result the kernel did not compute as asked: raise a ValueError "
                           "saying what came in and what is supported")


# ---- 09.4 a fast training step ----------------------------------------------------------------------

WIDTH, DEPTH, BATCH = 256, 12, 64


def launch_bound_mlp(seed: int = 0, device=None):
    """The model 09.4 trains: DEPTH layers of Linear(WIDTH, WIDTH) and GELU, float32. At batch BATCH its
    kernels are a few microseconds each: an eager step of it is launch-bound."""
    import torch

    torch.manual_seed(seed)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(device or world().device)


def eager_train_step(model, lr: float):
    """The peer: eager forward and backward, AdamW with PyTorch's defaults."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


@exercise("09.4", "a training step fast enough", names=("make_train_step",), time_limit_s=420)
def grade_train_step(report: Report, make_train_step):
    import torch

    dev = world().device
    rng = fresh_rng(report)
    seed = int(rng.integers(0, 2**31))
    lr = float(rng.choice([2e-4, 2e-3, 5e-3]) * rng.uniform(1.0, 2.0))  # drawn: never the 1e-3 the model shows
    ref_model, model = launch_bound_mlp(seed, dev), launch_bound_mlp(seed, dev)
    steps = 4
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(BATCH, WIDTH, generator=gen).to(dev), torch.randn(BATCH, WIDTH, generator=gen).to(dev))
            for _ in range(steps)]
    ref_step = eager_train_step(ref_model, lr)
    step = call(report, f"make_train_step(model, lr={lr:.3g})", make_train_step, model, lr)
    if not callable(step):
        return report.fail(f"make_train_step returned {type(step).__name__}: return a function step(x, y)")
    before = [p.detach().clone() for p in model.parameters()]
    for i, (x, y) in enumerate(data):
        ref_step(x, y)
        try:
            step(x.clone(), y.clone())
        except Exception as exc:  # noqa: BLE001
            return report.fail(f"step {i + 1}: {explain(exc)}")
        if world().gpu:
            torch.cuda.synchronize()
        worst, name = 0.0, ""
        for (n, p), r in zip(model.named_parameters(), ref_model.parameters()):
            err = ((p.detach() - r.detach()).abs().max() / (r.detach().abs().max() + 1e-12)).item()
            if err > worst:
                worst, name = err, n
        if worst > 1e-3:
            unchanged = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
            hint = ("the parameters did not change: call the optimizer's step() after backward()" if unchanged else
                    "the gradients add up from step to step: zero them after each optimizer step"
                    if i > 0 else
                    f"the update differs from AdamW(lr={lr:.3g}) with PyTorch's defaults on F.mse_loss(model(x), y): "
                    "use the lr argument (the grader draws it)")
            return report.fail(f"after step {i + 1}, parameter {name} differs from an eager step by {worst:.1e} "
                               f"(relative): {hint}")
    report.ok(f"{steps} steps update every parameter as an eager AdamW step does")
    if not world().gpu:
        return speed_vs_peer(report, "training step", None, None, "the eager step", 1.5)
    x, y = data[0]
    speed_vs_peer(report, f"training step of a {DEPTH}-layer MLP, batch {BATCH}", lambda: step(x, y),
                  lambda: ref_step(x, y), "the eager step (eager forward and backward, AdamW's defaults)", 1.5)
