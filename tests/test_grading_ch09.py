"""Chapter 09's graders: the generated stubs fail, typical wrong answers are rejected with a message that
teaches, and different but correct answers are accepted. Kernels run in Triton's interpreter on the CPU.

09.3's grader ends with a grouped-query case (fewer key/value heads than query heads), which needs
grouped-query attention in ``kernelcourse.attention_backward.attention``; the tests named ``test_gqa_*`` reach it,
and are expected failures while the kernels lack it.
"""
import math
import time

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import grading
from kernelcourse.grading import ch09
from tests.helpers import grade, memorised



# ---- 09.1 a Triton kernel as an operator -------------------------------------------------------------


@triton.jit
def softplus_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_softplus(x, block=1024, grid="cdiv"):
    x = x.contiguous()
    y = torch.empty_like(x)
    # grid="floor": n // BLOCK programs, the last partial block never launched
    programs = x.numel() // block if grid == "floor" else triton.cdiv(x.numel(), block)
    softplus_kernel[(programs,)](x, y, x.numel(), BLOCK=block)
    return y


def make_op(name, fake="empty_like", backward="sigmoid", save="input", block=1024, grid="cdiv"):
    """A softplus operator registered under test09::<name>, with one piece changed."""
    @torch.library.custom_op(f"test09::{name}", mutates_args=())
    def softplus(x: torch.Tensor) -> torch.Tensor:
        return launch_softplus(x, block, grid)

    fakes = {"empty_like": lambda x: torch.empty_like(x), "new_empty": lambda x: x.new_empty(x.shape),
             "float32": lambda x: torch.empty(x.shape, dtype=torch.float32, device=x.device),
             "flat": lambda x: x.new_empty(x.numel())}
    if fake:
        softplus.register_fake(fakes[fake])
    if backward:
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0] if save == "input" else output)

        def bwd(ctx, dy):
            (t,) = ctx.saved_tensors
            return {"sigmoid": lambda: dy * torch.sigmoid(t), "exp": lambda: dy / (1 + torch.exp(-t)),
                    "no_dy": lambda: torch.sigmoid(t), "one_minus": lambda: dy * (1 - torch.sigmoid(t))}[backward]()

        softplus.register_autograd(bwd, setup_context=setup_context)
    return softplus


def test_09_1_solution_passes():
    passed, text = grade("09.1", softplus=make_op("solution"))
    assert passed, text
    assert "opcheck" in text and "fullgraph=True" in text


def test_09_1_alternative_correct_version_passes():
    """Another block size, x.new_empty as the fake, sigmoid written as 1 / (1 + e^-x)."""
    passed, text = grade("09.1", softplus=make_op("alternative", fake="new_empty", backward="exp", block=256))
    assert passed, text


def test_09_1_stub_fails():
    @torch.library.custom_op("test09::stub", mutates_args=())
    def softplus(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("replace this line with your answer (about 4 lines)")

    passed, text = grade("09.1", softplus=softplus)
    assert not passed and "not written yet" in text, text


@pytest.mark.parametrize("kwargs, message", [
    (dict(fake=None), "register_fake"),
    (dict(fake="float32"), "in the input's dtype"),
    (dict(fake="flat"), "one value per input element"),
    (dict(backward=None), "register_autograd"),
    (dict(backward="no_dy"), "multiply by dy"),
    (dict(backward="one_minus"), "not 1 - sigmoid(x)"),
    (dict(save="output"), "save x, the input"),
])
def test_09_1_typical_mistakes_are_named(kwargs, message):
    name = "wrong_" + "_".join(f"{k}_{v}" for k, v in kwargs.items())
    passed, text = grade("09.1", softplus=make_op(name, **kwargs))
    assert not passed and message in text, text


def test_09_1_rejects_a_grid_of_n_floor_block():
    """A launcher whose grid is n // BLOCK: right on whole blocks, the last partial one never launched."""
    passed, text = grade("09.1", softplus=make_op("floor_grid", grid="floor"))
    assert not passed and "the last, partial block was never launched" in text and "cdiv(n, BLOCK)" in text, text


def test_09_1_a_grid_of_n_floor_block_fails_where_memory_holds_the_answer(monkeypatch):
    """On a GPU the grader runs in the caller's process, and torch.empty hands back a block freed a moment ago
    with its values: after a correct operator ran on the same drawn inputs (the same KC_GRADE_SEED), the tail a
    grid of n // BLOCK never launched held the right answer and passed. The grader fills what the operator
    allocates with NaN, so the tail shows."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    monkeypatch.setenv("KC_GRADE_SEED", "101")
    assert grade("09.1", softplus=make_op("warm_memory"))[0]
    passed, text = grade("09.1", softplus=make_op("floor_grid_warm", grid="floor"))
    assert not passed and "from index 4096 on are wrong" in text and "never launched" in text, text


def test_09_1_the_output_an_operator_allocates_starts_as_nan(monkeypatch):
    """The mechanism, where the CPU's allocator would not show it: while the grader calls the operator's forward,
    the tensor its launcher takes from torch.empty_like holds NaN, whatever memory held; the switch is put back."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    fresh = []

    @torch.library.custom_op("test09::recording_empty", mutates_args=())
    def softplus(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        fresh.append(bool(torch.isnan(y).all()))
        softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    softplus.register_fake(lambda x: torch.empty_like(x))
    softplus.register_autograd(lambda ctx, dy: dy * torch.sigmoid(ctx.saved_tensors[0]),
                               setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))
    assert grade("09.1", softplus=softplus)[0]
    assert fresh[:4] == [True] * 4, fresh  # the four forward cases
    assert not torch.are_deterministic_algorithms_enabled()  # the switch is put back


def test_09_1_names_a_launch_of_no_program_for_fewer_elements_than_a_block():
    """n = 1 is less than any block: a grid of n // BLOCK is 0 programs there, and the output is never written."""
    @torch.library.custom_op("test09::none_below_a_block", mutates_args=())
    def softplus(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        if x.numel() >= 1024:  # right on the first case, 4097 elements; no program at all for n = 1
            softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    softplus.register_fake(lambda x: torch.empty_like(x))
    passed, text = grade("09.1", softplus=softplus)
    assert not passed and "shape (1,)" in text and "n = 1 is less than one block" in text, text
    assert "the last, partial block was never launched" in text, text


def test_09_1_draws_its_values_on_every_run(monkeypatch):
    """An operator that answers from a table of one run's outputs (keyed by the input's values) passes that run and
    fails the next: the inputs are drawn afresh."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    seen = {}

    @torch.library.custom_op("test09::recording", mutates_args=())
    def recording(x: torch.Tensor) -> torch.Tensor:
        y = launch_softplus(x)
        seen[x.detach().cpu().numpy().tobytes()] = y.detach().cpu().clone()
        return y

    @torch.library.custom_op("test09::copied", mutates_args=())
    def copied(x: torch.Tensor) -> torch.Tensor:
        y = seen.get(x.detach().cpu().numpy().tobytes())
        return torch.zeros_like(x) if y is None else y.to(x.device, x.dtype).reshape(x.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    for op in (recording, copied):
        op.register_fake(lambda x: torch.empty_like(x))
        op.register_autograd(lambda ctx, dy: dy * torch.sigmoid(ctx.saved_tensors[0]), setup_context=setup_context)
    monkeypatch.setenv("KC_GRADE_SEED", "11")
    assert grade("09.1", softplus=recording)[0]
    assert grade("09.1", softplus=copied)[0]  # the same run's inputs: the table answers them
    monkeypatch.setenv("KC_GRADE_SEED", "12")
    passed, text = grade("09.1", softplus=copied)
    assert not passed and "KC_GRADE_SEED=12" in text, text


def test_09_1_a_plain_function_is_not_an_operator():
    passed, text = grade("09.1", softplus=launch_softplus)
    assert not passed and "custom_op" in text, text


# ---- 09.2 a step's timeline ---------------------------------------------------------------------------


def step_time(cpu_us, gpu_us):
    issued = end = 0.0
    for c, g in zip(cpu_us, gpu_us):
        issued += c
        end = max(issued, end) + g
    return end


def gpu_idle_share(cpu_us, gpu_us):
    return 1 - sum(gpu_us) / step_time(cpu_us, gpu_us)


def cpu_us_per_call(fn, calls):
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def test_09_2_solution_passes():
    passed, text = grade("09.2", cpu_us_per_call=cpu_us_per_call, step_time=step_time, gpu_idle_share=gpu_idle_share)
    assert passed, text


def test_09_2_alternative_correct_version_passes():
    """The timeline as a recurrence on the kernels' start times, idle as span minus busy, timing with
    perf_counter_ns and one warm-up call."""
    def step_time_alt(cpu_us, gpu_us):
        starts, issued, prev_end = [], 0.0, 0.0
        for c, g in zip(cpu_us, gpu_us):
            issued += c
            starts.append(max(issued, prev_end))
            prev_end = starts[-1] + g
        return prev_end

    def idle_alt(cpu_us, gpu_us):
        total = step_time_alt(cpu_us, gpu_us)
        return (total - math.fsum(gpu_us)) / total

    def per_call_alt(fn, calls):
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        return (time.perf_counter_ns() - t0) / 1e3 / calls

    passed, text = grade("09.2", cpu_us_per_call=per_call_alt, step_time=step_time_alt, gpu_idle_share=idle_alt)
    assert passed, text


@pytest.mark.parametrize("wrong, message", [
    (lambda c, g: sum(g), "max(issued, previous kernel's end)"),
    (lambda c, g: sum(c), "max(issued, previous kernel's end)"),
    (lambda c, g: sum(c) + sum(g), "they overlap"),
    (lambda c, g: max(sum(c), sum(g)), "max(issued, previous kernel's end)"),
])
def test_09_2_wrong_timelines_are_named(wrong, message):
    passed, text = grade("09.2", cpu_us_per_call=cpu_us_per_call, step_time=wrong, gpu_idle_share=gpu_idle_share)
    assert not passed and message in text, text


def test_09_2_busy_share_is_not_idle_share():
    passed, text = grade("09.2", cpu_us_per_call=cpu_us_per_call, step_time=step_time,
                         gpu_idle_share=lambda c, g: sum(g) / step_time(c, g))
    assert not passed and "1 minus it" in text, text


def test_09_2_measurement_without_warm_up_is_rejected():
    def no_warm_up(fn, calls):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    passed, text = grade("09.2", cpu_us_per_call=no_warm_up, step_time=step_time, gpu_idle_share=gpu_idle_share)
    assert not passed and "before you start the clock" in text, text


def test_09_2_cases_are_fresh_every_run(monkeypatch):
    """A table of one run's step times and idle shares (keyed by the calls' times) fails the next run: its three
    steps of many calls are drawn afresh."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    times, times_table = memorised(lambda c, g: step_time(list(c), list(g)))
    idle, idle_table = memorised(lambda c, g: gpu_idle_share(list(c), list(g)), default=0.5)
    assert grade("09.2", cpu_us_per_call=cpu_us_per_call, step_time=lambda c, g: times(tuple(c), tuple(g)),
                 gpu_idle_share=lambda c, g: idle(tuple(c), tuple(g)))[0]
    passed, text = grade("09.2", cpu_us_per_call=cpu_us_per_call, step_time=lambda c, g: times_table(tuple(c), tuple(g)),
                         gpu_idle_share=lambda c, g: idle_table(tuple(c), tuple(g)))
    assert not passed and "step_time(a mixed step of" in text and "KC_GRADE_SEED=" in text, text


def test_09_2_seconds_are_not_microseconds():
    passed, text = grade("09.2", cpu_us_per_call=lambda fn, calls: cpu_us_per_call(fn, calls) / 1e6,
                         step_time=step_time, gpu_idle_share=gpu_idle_share)
    assert not passed and "return microseconds" in text, text


# ---- 09.3 a Hugging Face attention adapter ----------------------------------------------------------


def my_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if attention_mask is not None:
        raise ValueError("no mask")
    if dropout:
        raise ValueError("no dropout")
    causal = module.is_causal and query.shape[2] > 1
    return kc.attention_backward.attention(query, key, value, causal=causal, sm_scale=scaling).transpose(1, 2).contiguous(), None


def adapter(*, layout="transpose", scale=True, causal="module", refuse_mask=True, refuse_dropout=True):
    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if refuse_mask and attention_mask is not None:
            raise ValueError("no mask")
        if refuse_dropout and dropout:
            raise ValueError("no dropout")
        is_causal = {"module": module.is_causal and query.shape[2] > 1, "always": True,
                     "never": False}[causal]
        out = kc.attention_backward.attention(query, key, value, causal=is_causal, sm_scale=scaling if scale else None)
        B, H, N, d = out.shape
        out = {"transpose": out.transpose(1, 2), "none": out, "reshape": out.reshape(B, N, H, d)}[layout]
        return out.contiguous(), None
    return fn


def test_gqa_09_3_solution_passes():
    passed, text = grade("09.3", my_attention=my_attention)
    assert passed, text


def test_gqa_09_3_alternative_correct_version_passes():
    def alt(module, query, key, value, attention_mask=None, **kwargs):
        if attention_mask is not None or kwargs.get("dropout", 0.0) > 0:
            raise ValueError("the course's kernels take neither a mask nor dropout")
        n_q = query.size(2)
        out = kc.attention_backward.attention(query, key, value, causal=bool(module.is_causal and n_q != 1),
                                     sm_scale=kwargs.get("scaling"))
        return out.permute(0, 2, 1, 3), None

    passed, text = grade("09.3", my_attention=alt)
    assert passed, text


def test_09_3_stub_fails():
    def stub(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        raise NotImplementedError("replace this line with your answer (about 7 lines)")

    passed, text = grade("09.3", my_attention=stub)
    assert not passed and "not written yet" in text, text


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="none"), "transpose(1, 2)"),
    (dict(layout="reshape"), "mixes heads and tokens"),
    (dict(scale=False), "pass it to the kernel as sm_scale"),
    (dict(causal="never"), "causal only when the module is causal"),
    (dict(causal="always"), "causal only when the module is causal"),
])
def test_09_3_typical_mistakes_are_named(kwargs, message):
    passed, text = grade("09.3", my_attention=adapter(**kwargs))
    assert not passed and message in text, text


@pytest.mark.parametrize("kwargs, what", [(dict(refuse_mask=False), "a padding mask"),
                                          (dict(refuse_dropout=False), "dropout=0.1")])
def test_gqa_09_3_a_mask_or_dropout_taken_silently_is_rejected(kwargs, what):
    passed, text = grade("09.3", my_attention=adapter(**kwargs))
    assert not passed and f"{what}: returned a result" in text, text


def test_09_3_returning_only_the_output_is_rejected():
    passed, text = grade("09.3", my_attention=lambda *a, **k: my_attention(*a, **k)[0])
    assert not passed and "return (attn_output, None)" in text, text


# ---- 09.4 a training step -------------------------------------------------------------------------


def make_train_step(model, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


GPU = kc.world().gpu
needs_gpu = pytest.mark.skipif(not GPU, reason="speed is graded on a GPU only")
cpu_only = pytest.mark.skipif(GPU, reason="on a GPU the speed check is graded, and an eager step fails it")


def fast_train_step(model, lr):
    """The solution: fused AdamW, the model compiled to CUDA graphs on a GPU."""
    gpu = next(model.parameters()).is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=gpu)
    forward = torch.compile(model, mode="reduce-overhead") if gpu else model

    def step(x, y):
        F.mse_loss(forward(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


@cpu_only
def test_09_4_eager_step_passes_and_speed_is_not_graded_on_the_cpu():
    for fn in (make_train_step, fast_train_step):
        passed, text = grade("09.4", make_train_step=fn)
        assert passed, text
        speed = [line for line in text.splitlines() if "speed needs a GPU" in line]
        assert len(speed) == 1 and speed[0].startswith(grading.NOT_GRADED), text


@needs_gpu
def test_09_4_solution_passes_on_speed_and_an_eager_step_fails():
    passed, text = grade("09.4", make_train_step=fast_train_step)
    assert passed, text
    passed, text = grade("09.4", make_train_step=make_train_step)
    assert not passed and "needs at least 1.5x" in text, text


@cpu_only
def test_09_4_alternative_correct_version_passes():
    """A step written as one closure over its own loss function, AdamW without foreach, gradients set to zero."""
    def alt(model, lr):
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=lr, foreach=False)
        loss_fn = torch.nn.MSELoss()

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        return step

    passed, text = grade("09.4", make_train_step=alt)
    assert passed, text


def test_09_4_stub_fails():
    def stub(model, lr):
        raise NotImplementedError("replace this line with your answer (about 10 lines)")

    passed, text = grade("09.4", make_train_step=stub)
    assert not passed and "not written yet" in text, text


def _step(zero=True, update=True, optimizer="adamw"):
    def make(model, lr):
        opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=lr)

        def step(x, y):
            F.mse_loss(model(x), y).backward()
            if update:
                opt.step()
            if zero:
                opt.zero_grad()
        return step
    return make


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero=False), "zero them after each optimizer step"),
    (dict(update=False), "call the optimizer's step()"),
    (dict(optimizer="sgd"), "AdamW(lr="),
])
def test_09_4_typical_mistakes_are_named(kwargs, message):
    passed, text = grade("09.4", make_train_step=_step(**kwargs))
    assert not passed and message in text, text


def test_the_model_of_09_4_is_launch_bound_sized():
    model = ch09.launch_bound_mlp(0, "cpu")
    assert sum(isinstance(m, torch.nn.Linear) for m in model) == ch09.DEPTH


def test_09_4_rejects_a_step_that_keeps_a_learning_rate_of_its_own():
    """The grader draws lr on every run (never 1e-3): a step that writes AdamW(lr=1e-3) in updates otherwise."""
    def fixed_lr(model, lr):
        return make_train_step(model, 1e-3)

    passed, text = grade("09.4", make_train_step=fixed_lr)
    assert not passed and "use the lr argument" in text, text
