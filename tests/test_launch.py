"""kernelcourse.launch: the key that decides which compiled kernel a direct launch may reuse, and the call it
makes. Off a GPU the interpreter compiles nothing, so the direct path is checked here with a stand-in for
Triton's compiled kernel and launcher that records what it is given; on a GPU the lean launchers' own
tests (test_ops_rows, test_attention_op, test_transformer) run it for real, bit for bit against the
readable launchers."""
import inspect

import pytest
import torch
import triton
import triton.language as tl

import kernelcourse as kc

kc.setup()
from kernelcourse import launch  # noqa: E402


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = x * factor
    if TWICE:
        y = y * factor
    tl.store(y_ptr + offs, y, mask=offs < n)


def test_the_key_holds_what_triton_specialises_on():
    s = launch.specialization
    assert s(1) == (1,) and s(32) == (16,) and s(7) == (0,) and s(0) == (16,)
    assert s(2**33) == (80,) and s(2**33 + 1) == (64,)           # 64-bit, and divisible by 16 or not
    assert s(0.5, None, True) == (None, None, None)              # floats, None and bools: not specialised
    x = torch.randn(64)
    assert s(x, x[1:], x[4:]) == (True, False, True)             # 16-byte alignment of the address
    assert s(x, 48, x[1:]) != s(x, 48, x)


def test_the_tail_is_the_constexprs_in_order_with_their_defaults():
    assert launch._tail(scale_kernel, 4, {"BLOCK": 128, "num_warps": 4}) == (128, False)
    assert launch._tail(scale_kernel, 4, {"TWICE": True, "BLOCK": 64}) == (64, True)
    names = list(inspect.signature(scale_kernel.fn).parameters)
    assert names[4:] == ["BLOCK", "TWICE"]


@pytest.mark.skipif(kc.world().gpu, reason="the interpreter's path: on a GPU the bit-for-bit test below runs instead")
def test_on_the_cpu_it_is_the_ordinary_launch(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    x = torch.randn(300)
    y = torch.empty_like(x)
    launch.direct(scale_kernel, ("cpu-test",), (3,), (x, y, 300, 2.0), {"BLOCK": 128, "TWICE": True})
    torch.testing.assert_close(y, x * 4)
    assert ("cpu-test",) not in {k for _, k in launch.DIRECT}      # the interpreter compiles nothing to keep


class _Launcher:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _CompiledKernel:
    """What Triton's JITFunction.run returns, as far as a direct launch uses it."""

    def __init__(self):
        self.run = _Launcher()
        self.function = "function handle"
        self.packed_metadata = ("packed",)


class _Kernel:
    """A stand-in for a JITFunction: counts its ordinary launches, returns the compiled kernel."""
    fn = staticmethod(scale_kernel.fn)

    def __init__(self):
        self.compiled = _CompiledKernel()
        self.runs = []

    def run(self, *args, grid, warmup, **kwargs):
        self.runs.append((args, grid, kwargs))
        return self.compiled


@pytest.fixture
def gpu_driver(monkeypatch):
    """Triton's driver as a GPU machine's: device 0, its stream 1234."""
    from triton.runtime import driver

    fake = type("Driver", (), {"get_current_device": staticmethod(lambda: 0),
                               "get_current_stream": staticmethod(lambda device: 1234)})()
    monkeypatch.setattr(driver, "_active" if hasattr(driver, "_active") else "active", fake)
    monkeypatch.setattr(launch, "DIRECT", {})
    monkeypatch.setattr(launch, "ENABLED", True)


def test_the_first_call_launches_through_triton_and_the_next_ones_directly(gpu_driver):
    k = _Kernel()
    x, y = torch.randn(8), torch.randn(8)
    consts = {"BLOCK": 128, "num_warps": 4}
    launch.direct(k, ("key",), (3,), (x, y, 300, 2.0), consts)
    assert len(k.runs) == 1 and not k.compiled.run.calls
    launch.direct(k, ("key",), (5, 2), (y, x, 300, 3.0), consts)
    assert len(k.runs) == 1
    # what JITFunction.run passes to the launcher: the grid's three sizes, the stream, the function, the
    # packed metadata, the launch metadata and the two hooks, then every argument, constexprs included
    assert k.compiled.run.calls == [(5, 2, 1, 1234, "function handle", ("packed",), None, None, None,
                                     y, x, 300, 3.0, 128, False)]


def test_another_key_or_a_launch_hook_goes_through_triton(gpu_driver, monkeypatch):
    k = _Kernel()
    x = torch.randn(64)
    launch.direct(k, ("key",) + launch.specialization(x), (1,), (x, x, 64, 1.0), {"BLOCK": 64})
    launch.direct(k, ("key",) + launch.specialization(x[1:]), (1,), (x[1:], x, 63, 1.0), {"BLOCK": 64})
    assert len(k.runs) == 2                                        # a misaligned pointer: another compiled kernel
    hook = lambda *a: None  # noqa: E731
    chain = triton.knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton 3.5 and newer: a chain of hooks, empty unless a profiler adds one
        monkeypatch.setattr(chain, "calls", [hook])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)
    launch.direct(k, ("key",) + launch.specialization(x), (1,), (x, x, 64, 1.0), {"BLOCK": 64})
    assert len(k.runs) == 3 and not k.compiled.run.calls           # a profiler's hook sees every launch


def test_without_kc_direct_launch_every_launch_goes_through_triton(gpu_driver, monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", False)
    k = _Kernel()
    x = torch.randn(64)
    for _ in range(3):
        launch.direct(k, ("key",), (1,), (x, x, 64, 1.0), {"BLOCK": 64})
    assert len(k.runs) == 3 and not k.compiled.run.calls and not launch.DIRECT


@pytest.mark.skipif(not kc.world().gpu, reason="a direct launch needs a compiled kernel: a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_launched_directly_is_bit_for_bit_the_first_launch(causal, monkeypatch):
    """Forward and backward, three times each at one shape: the first works out the plan, the second
    launches through Triton and keeps the compiled kernels, the third launches them directly."""
    from kernelcourse import attention_backward as kcb

    monkeypatch.setattr(launch, "ENABLED", True)
    launch.DIRECT.clear()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    runs = []
    for _ in range(3):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        o = kcb.attention(qs, ks, vs, causal=causal)
        o.backward(do)
        runs.append((o.detach(), qs.grad, ks.grad, vs.grad))
    assert len({key for kernel, key in launch.DIRECT}) >= 2, "the direct path was not taken"
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
