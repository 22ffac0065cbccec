"""Chapter 08's module: the LayerNorm backward against a float64 truth, the course's block against the
eager one, the GPT, the corpus and the trace helpers. Small sizes: kernels run in the interpreter."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernelcourse as kc
from kernelcourse import bench
from kernelcourse import transformer as T
from kernelcourse.world import low_precision_dtype

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("rows, cols, programs", [(37, 50, 3), (5, 128, 5), (9, 200, 2), (1, 33, None)])
def test_layer_norm_backward_matches_float64(rows, cols, programs):
    torch.manual_seed(rows + cols)
    dev = kc.world().device
    h = (torch.randn(rows, cols, dtype=torch.float64) * 2 + torch.randn(rows, 1, dtype=torch.float64)).to(dev)
    w = (torch.rand(cols, dtype=torch.float64) + 0.5).to(dev)
    dy, dres = torch.randn_like(h), torch.randn_like(h)
    dx, dw, db = T.layer_norm_backward(h.float(), w.float(), dy.float(), dres=dres.float(), programs=programs)
    tx, tw, tb = T.layer_norm_backward_ref(h, w, dy)  # float64: the truth
    px, pw, pb = T.layer_norm_backward_ref(h.float(), w.float(), dy.float())  # PyTorch at float32
    for got, truth, peer in ((dx, tx + dres, px + dres.float()), (dw, tw, pw), (db, tb, pb)):
        err, peer_err = (got.double() - truth).abs().max(), (peer.double() - truth).abs().max()
        assert err <= 2 * peer_err + 1e-5 * truth.abs().max(), (err, peer_err)


@pytest.mark.parametrize("n_regs, warps, shared, gpu, want", [
    (75, 8, 1024, {}, 3),                          # 2,560 registers a warp: 25 warps of an H100's 65,536
    (64, 8, 1024, {}, 4),                          # 2,048 a warp: 32 warps, four 8-warp programs
    (40, 8, 1024, {}, 4),                          # room for six, but four are enough to fill an SM
    (32, 16, 1024, dict(threads_per_sm=1024), 2),  # a T4's SM runs 1,024 threads: two 16-warp programs
    (32, 4, 100_000, {}, 2),                       # shared memory runs out first
])
def test_programs_per_sm_is_what_an_sm_holds_at_once(n_regs, warps, shared, gpu, want):
    """The LayerNorm backward launches as many programs as the GPU holds at once (at most four per SM): at 75
    registers a thread, an H200 ran a grid of four 8-warp programs per SM in two waves, 1.4x slower than a
    kernel of 64 registers, whose four fit."""
    assert T.programs_per_sm(n_regs, shared, warps, **gpu) == want


def test_the_grid_is_four_programs_per_sm_without_a_gpu(monkeypatch):
    """In the CPU world nothing is compiled ahead of the launch: four programs per SM, as the CPU world's 4.
    (The world is set here, so that the test means the same on a machine with a GPU.)"""
    import types

    monkeypatch.setattr(T, "world", lambda: types.SimpleNamespace(gpu=False))
    h = torch.randn(64, 40)
    assert T.resident_per_sm(T.layer_norm_backward_kernel, (h, h, h, h[0], h, 64, 40, 40, 1e-5),
                             dict(BLOCK=64, HAS_DRES=False, num_warps=1)) == 4


def test_on_a_gpu_the_grid_comes_from_the_compiled_kernel(monkeypatch):
    """The GPU path without a GPU: the kernel is compiled ahead of its launch (warmup) with the launch's
    arguments, a float32 buffer for the partial sums and four programs' worth of rows, and the grid is
    as many programs as an SM holds of it."""
    import types

    seen = {}

    class Compiled:
        n_regs, metadata = 75, types.SimpleNamespace(shared=1024)

        def _init_handles(self):
            seen["loaded"] = True

    class Kernel:
        def warmup(self, *args, grid, **meta):
            seen.update(args=args, grid=grid, meta=meta)
            return Compiled()

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                                  shared_memory_per_multiprocessor=233472, warp_size=32)
    monkeypatch.setattr(T, "world", lambda: types.SimpleNamespace(gpu=True))
    monkeypatch.setattr(T, "_sm_count", lambda device: 132)
    monkeypatch.setattr(T.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(T.torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(T, "_PER_SM", {})
    h = torch.randn(64, 40)
    kernel = Kernel()
    meta = dict(BLOCK=2048, HAS_DRES=False, num_warps=8)
    assert T.resident_per_sm(kernel, (h, h, h, h[0], h, 16384, 2048, 2048, 1e-5), meta) == 3
    assert seen["loaded"] and seen["grid"] == (1,) and seen["meta"] == dict(meta, ROWS_PER_PROGRAM=32)
    part = seen["args"][5]
    assert part.dtype == torch.float32 and seen["args"][6:] == (16384, 2048, 2048, 1e-5)
    assert T._programs(16384, 3) == 396  # one wave of three programs on each of 132 SMs
    seen.clear()
    assert T.resident_per_sm(kernel, (h, h, h, h[0], h, 8192, 2048, 2048, 1e-5), meta) == 3 and not seen  # once


def test_torch_layer_norm_backward_is_autograds():
    """The timing peer computes what autograd through F.layer_norm computes (float32, on the CPU)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(13, 40, generator=g) * 2 + 1
    w = torch.rand(40, generator=g) + 0.5
    dy = torch.randn(13, 40, generator=g)
    for got, want in zip(T.torch_layer_norm_backward(h, w, dy)(), T.layer_norm_backward_ref(h, w, dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_residual_layer_norm_gradients_match_pytorch():
    torch.manual_seed(0)
    dev = kc.world().device
    x = torch.randn(3, 5, 40, device=dev, requires_grad=True)
    r = torch.randn(3, 5, 40, device=dev, requires_grad=True)
    w = (torch.rand(40, device=dev) + 0.5).requires_grad_(True)
    b = torch.randn(40, device=dev, requires_grad=True)
    gy, gh = torch.randn(3, 5, 40, device=dev), torch.randn(3, 5, 40, device=dev)
    y, h = T.residual_layer_norm(x, r, w, b)
    torch.autograd.backward((y, h), (gy, gh))
    got = [t.grad.clone() for t in (x, r, w, b)]
    for t in (x, r, w, b):
        t.grad = None
    h2 = x + r
    torch.autograd.backward((F.layer_norm(h2, (40,), w, b), h2), (gy, gh))
    torch.testing.assert_close(y, F.layer_norm(x + r, (40,), w, b), rtol=1e-5, atol=1e-5)
    for g, t in zip(got, (x, r, w, b)):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("triton_matmuls", [(), T.MATMULS])
def test_course_block_matches_eager_block(triton_matmuls):
    ref, course, h, delta = T.make_pair(2, 24, 32, 2, torch.float32, triton_matmuls=triton_matmuls)
    grads = (torch.randn_like(h), torch.randn_like(h))
    results = []
    for blk in (ref, course):
        h.grad = delta.grad = None
        x, m = blk(h, delta)
        torch.autograd.backward((x, m), grads)
        results.append([x, m, h.grad, delta.grad] + [p.grad for p in blk.parameters()])
    names = ["x", "m", "dh", "ddelta"] + [n for n, _ in ref.named_parameters()]
    # on a GPU, tl.dot rounds float32 inputs to TF32 inside the attention kernels; SDPA does not
    rtol, atol = (2e-2, 2e-3) if kc.world().gpu else (1e-4, 1e-5)
    for name, a, b in zip(names, *results):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=name)


def test_gpt_trains_the_same_with_either_block():
    text = T.course_text()[:5000]
    kw = dict(steps=3, batch=2, seq_len=16, d_model=32, n_heads=2, n_layers=1, text=text)
    a, b = T.train("torch", **kw), T.train("course", **kw)
    assert a["losses"][0] == pytest.approx(torch.log(torch.tensor(float(len(T.CharCodec(text))))).item(), rel=0.05)
    # in float32 on the CPU the two agree to rounding; on a GPU both compute in bf16
    assert a["losses"] == pytest.approx(b["losses"], rel=2e-2 if kc.world().gpu else 1e-4)
    assert a["losses"][-1] < a["losses"][0]


def test_course_text_is_the_course_prose():
    text = T.course_text()
    assert len(text) > 50_000
    codec = T.CharCodec(text[:2000])
    assert codec.decode(codec.encode(text[:2000])) == text[:2000]
    intro = (ROOT / "book" / "intro.md").read_text(encoding="utf-8")
    assert intro[:200] in T.build_course_text(ROOT)


def test_block_counts():
    assert T.block_flops(1, 1, 1, causal=False) == 24 + 4
    assert T.block_flops(8, 1024, 768) == 24 * 8 * 1024 * 768**2 + 2 * 8 * 1024**2 * 768
    assert T.block_train_flops(1, 4, 8, causal=False) == 3 * 24 * 4 * 64 + 3.5 * 4 * 16 * 8
    assert T.block_min_bytes(2, 3, 4, 2) == (12 * 16 + 2 * 2 * 3 * 4) * 2


def test_compact_trace_keeps_what_says_where_time_went(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 9},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 3},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 20.5, "dur": 7},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 40, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "layer_norm_backward_kernel", "ts": 30, "dur": 4},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    ev = T.compact_trace(path)
    assert [e["name"] for e in ev] == ["cudaLaunchKernel", "gemm", "layer_norm_backward_kernel", "gemm"]
    assert ev[0]["ts"] == 0 and ev[1]["ts"] == 10.5
    rows = T.by_kernel(ev)
    assert rows[0]["kernel"] == "gemm" and rows[0]["calls"] == 2 and rows[0]["share"] == pytest.approx(12 / 16)
    assert {r["family"] for r in T.by_family(ev)} == {"matmul", "layer norm"}
    idle = T.gpu_idle(ev)
    assert idle["span_us"] == pytest.approx(24.5) and idle["busy_us"] == 16 and idle["launches"] == 1


@pytest.mark.parametrize("name", ["08_trace_course", "08_trace_eager"])
def test_recorded_traces_are_real_and_small(name):
    path = bench.recorded_path(name)
    assert path.stat().st_size < 1_000_000
    ev = bench.load(name).rows
    # recorded in the run that stamped lesson 08: the CPU world shows what the website shows
    stamp = json.loads((ROOT / "notebooks" / "08_transformer_block.ipynb").read_text())["metadata"]["kernelcourse"]["stamp"]
    assert bench.load(name).provenance["gpu"] == stamp["gpu"] and stamp["gpu"].startswith("NVIDIA")
    fams = {r["family"] for r in T.by_family(ev)}
    assert {"matmul", "attention", "layer norm"} <= fams
    assert 0 < T.gpu_idle(ev)["idle_share"] < 1


@pytest.mark.parametrize("name, family", [("nvjet_sm90_tst_192x128_64x5", "matmul"), ("flash_attention_kernel", "attention"),
                                          ("attention_bwd_dkdv_kernel", "attention"), ("column_sum_kernel", "layer norm"),
                                          ("triton_poi_fused_add_0", "elementwise"), ("mystery", "other")])
def test_kernel_family(name, family):
    assert T.kernel_family(name) == family


def test_sixteen_bit_dtype_comes_from_the_world():
    """No bfloat16 written into chapter 08's code: the T4 has none. Defaults ask world.low_precision_dtype()
    (bfloat16 where the GPU has it, float16 before compute capability 8.0, float32 on the CPU)."""
    import inspect

    source = inspect.getsource(T)
    assert "torch.bfloat16" not in source
    for fn in (T.bench_block, T.bench_launch_cost, T.bench_layer_norm_backward, T.bench_matmuls, T.profile_step,
               T.bench_gpt):
        assert inspect.signature(fn).parameters["dtype"].default is None, fn.__name__
    assert inspect.signature(T.train).parameters["compute_dtype"].default is None
    if not kc.world().gpu:
        assert low_precision_dtype() == torch.float32
