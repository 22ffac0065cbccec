"""What a call of each of the course's short kernels costs the CPU and the GPU (chapter 09), on a GPU.

For the row kernels (softmax, residual add + LayerNorm), the LayerNorm backward (two kernels) and the
matmul: the readable launcher that the lessons print, its lean launch path, the ``torch.ops.kernelcourse``
operator, and the PyTorch peer; as the floor, a one-line Triton kernel and ``Tensor.add_``. CPU µs per
call: ``--calls`` calls back to back with no wait for the GPU, after a warm-up; GPU µs per call:
``kc.bench.gpu_time`` (the calls in a CUDA graph, L2 flushed between them). ``x floor`` is the CPU cost
over the one-line Triton kernel's; the lean paths aim at 2x or less. Each lean path and operator is timed
twice, the second time (``, direct``) with ``kernelcourse.launch``'s direct launch switched on.

    python tools/launch_cost_rows.py [--calls 300] [--dtype bf16|fp16|fp32] [--block]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import kernelcourse as kc  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--block", action="store_true", help="also one forward + backward of chapter 08's block")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="default: kernelcourse.world.low_precision_dtype() (bf16, or fp16 before compute capability 8.0)")
    args = parser.parse_args()
    world = kc.setup(quiet=True)
    if not world.gpu:
        print("launch_cost_rows.py times launches on a GPU; this machine has none.")
        return 1
    import torch
    import torch.nn.functional as F
    import triton
    import triton.language as tl

    from kernelcourse import kernels as K
    from kernelcourse import launch
    from kernelcourse import transformer as T
    from kernelcourse.bench import gpu_time, table
    from kernelcourse.world import low_precision_dtype

    @triton.jit
    def one_line_kernel(x_ptr):
        tl.store(x_ptr + tl.arange(0, 16), tl.full((16,), 1.0, tl.float32))

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype) or low_precision_dtype()
    dev = "cuda"
    enabled = launch.ENABLED
    ops = torch.ops.kernelcourse
    tiny = torch.zeros(16, device=dev)
    s = torch.randn(4096, 1024, device=dev, dtype=dtype)
    x, r = (torch.randn(8192, 1024, device=dev, dtype=dtype) for _ in range(2))
    w, b = torch.rand(1024, device=dev) + 0.5, torch.randn(1024, device=dev)
    wt, bt = w.to(dtype), b.to(dtype)
    a, m = torch.randn(8192, 768, device=dev, dtype=dtype), torch.randn(768, 768, device=dev, dtype=dtype) / 28
    cases = [
        ("floor", "one-line Triton kernel", lambda: one_line_kernel[(1,)](tiny)),
        ("floor", "Tensor.add_", lambda: tiny.add_(1.0)),
        ("softmax 4096x1024", "readable launcher", lambda: K.softmax(s)),
        ("softmax 4096x1024", "lean launch", lambda: K.softmax_lean(s)),
        ("softmax 4096x1024", "operator", lambda: ops.softmax(s)),
        ("softmax 4096x1024", "torch.softmax", lambda: torch.softmax(s, -1)),
        ("residual+LayerNorm 8192x1024", "readable launcher", lambda: K.residual_layer_norm(x, r, w, b, return_residual=True)),
        ("residual+LayerNorm 8192x1024", "lean launch", lambda: K.residual_layer_norm_lean(x, r, w, b)),
        ("residual+LayerNorm 8192x1024", "operator", lambda: ops.residual_layer_norm(x, r, w, b)),
        ("residual+LayerNorm 8192x1024", "PyTorch (add, layer_norm)", lambda: F.layer_norm(x + r, (1024,), wt, bt)),
        ("LayerNorm backward 8192x1024", "readable launcher", lambda: T.layer_norm_backward(x, w, r)),
        ("LayerNorm backward 8192x1024", "lean launch", lambda: T.layer_norm_backward_lean(x, w, r)),
        ("LayerNorm backward 8192x1024", "operator", lambda: ops.layer_norm_backward(x, w, r)),
        ("LayerNorm backward 8192x1024", "PyTorch", T.torch_layer_norm_backward(x, w, r)),
        ("matmul 8192x768x768", "readable launcher", lambda: K.matmul(a, m)),
        ("matmul 8192x768x768", "lean launch", lambda: K.matmul_lean(a, m)),
        ("matmul 8192x768x768", "operator", lambda: ops.matmul(a, m)),
        ("matmul 8192x768x768", "cuBLAS (a @ b)", lambda: a @ m),
    ]
    # each lean path and operator once more with the direct launch (kernelcourse.launch) switched on, in
    # this run, whatever KC_DIRECT_LAUNCH says: the two rows of a pair differ in that alone
    timed = []
    for op, impl, fn in cases:
        timed.append((op, impl, fn, False))
        if impl in ("lean launch", "operator"):
            timed.append((op, impl + ", direct", fn, True))
    rows = []
    for op, impl, fn, direct in timed:
        launch.ENABLED = direct
        c = kc.bench.cpu_time_per_call(fn, calls=args.calls, warmup=10)
        rows.append({"op": op, "impl": impl, "cpu_us": c, "gpu_us": gpu_time(fn) * 1e3})
    if args.block:  # one training step of chapter 08's block: which side, CPU or GPU, sets its pace
        ref, course, h, delta = T.make_pair(8, 1024, 768, 12, dtype)
        grads = (torch.randn_like(h), torch.randn_like(h))
        for impl, blk, direct in (("eager PyTorch + SDPA", ref, False), ("course kernels", course, False),
                                  ("course kernels, direct", course, True)):
            launch.ENABLED = direct
            fn = T.step_fn(blk, h, delta, grads)
            c = kc.bench.cpu_time_per_call(fn, calls=10, warmup=10)  # ~60 launches a step: 10 steps stay within the GPU's launch queue
            rows.append({"op": "block fwd+bwd 8x1024x768", "impl": impl, "cpu_us": c, "gpu_us": gpu_time(fn, reps=3) * 1e3})
    launch.ENABLED = enabled
    floor = rows[0]["cpu_us"]
    for row in rows:
        row["x_floor"] = row["cpu_us"] / floor
    print(f"{world.name}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, triton {triton.__version__}: "
          f"microseconds per call ({args.calls} calls back to back for the CPU, kc.bench.gpu_time for the GPU)")
    print(table(rows, {"op": "", "impl": "", "cpu_us": ".1f", "gpu_us": ".1f", "x_floor": ".2f"}))
    lean = [r for r in rows if r["impl"].startswith(("lean launch", "operator"))]
    over = [f"{r['op']} ({r['impl']}, {r['x_floor']:.2f}x)" for r in lean if r["x_floor"] > 2.0]
    print("CPU cost within 2x the one-line kernel's: " + ("all lean paths and operators" if not over
                                                          else "not " + ", ".join(over)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
