"""Graders for chapter 08, the transformer block (Triton's interpreter on the CPU, compiled on a GPU).

The kernel graders work like chapter 04's (see ``ch04``): inputs framed by NaN or by a finite pad,
outputs framed by poison, a float64 truth, a tolerance of twice PyTorch's own error. The trace
exercise reads the profiler traces the lesson recorded on a GPU, shipped with the package, so it is
graded the same way on any machine.
"""
from __future__ import annotations

import math

import numpy as np

from ..world import low_precision_dtype, world
from . import POISON, Report, as_number, as_tuple, call, compare, exercise, explain, fresh_rng, number, speed_vs_peer
from .harness import (NAN, PAD, STUB, USUAL_EPS, data_mask, diagnose, draw_eps, exact, framed, host, in_float32,
                      launch, never_written, not_a_kernel, nothing_written, outside_writes, own_eps_hint, rand,
                      rounding_floor, sizes, tolerance, unwritten_as_nan)

EPS = 1e-5


def ln_parts64(x, w, dy, eps=EPS):
    """Float64 pieces of the LayerNorm backward for rows of x: (xhat, rstd, g = dy * w)."""
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
    return (x - mean) * rstd, rstd, dy * w


def ln_dx64(x, w, dy, eps=EPS):
    xhat, rstd, g = ln_parts64(x, w, dy, eps)
    return rstd * (g - xhat * (xhat * g).mean(-1, keepdims=True) - g.mean(-1, keepdims=True))


def _torch_dx(x, w, dy, eps=EPS):
    """PyTorch's dX at the kernel's precision, on this device: the tolerance's reference."""
    import torch

    from ..transformer import layer_norm_backward_ref

    dev = world().device
    t = lambda a: torch.from_numpy(a).to(dev, torch.float32)  # noqa: E731
    return layer_norm_backward_ref(t(x), t(w), t(dy), eps)[0].cpu().double().numpy()


def _dx_mistakes(x, w, dy, block, eps=EPS):
    xhat, rstd, g = ln_parts64(x, w, dy, eps)
    c1, c2 = (xhat * g).mean(-1, keepdims=True), g.mean(-1, keepdims=True)
    n = x.shape[-1]
    mean = x.mean(-1, keepdims=True)
    # the variance taken over the whole block, padding (0 - mean) included
    var_pad = (((x - mean) ** 2).sum(-1, keepdims=True) + (block - n) * mean ** 2) / n
    xhat_pad = (x - mean) / np.sqrt(var_pad + eps)
    return [
        ("the gradient reaching x̂ is g = dy * w: multiply dy by the weight first", ln_dx64(x, np.ones_like(w), dy, eps)),
        ("dX = rstd * (g - x̂ * mean(x̂ * g) - mean(g)): the mean(g) term is missing", rstd * (g - xhat * c1)),
        ("dX = rstd * (g - x̂ * mean(x̂ * g) - mean(g)): the x̂ * mean(x̂ * g) term is missing", rstd * (g - c2)),
        ("dX = rstd * (g - ...): the factor rstd is missing", g - xhat * c1 - c2),
        ("the means divide by n_cols, not by BLOCK", rstd * (g - xhat * (xhat * g).sum(-1, keepdims=True) / block
                                                          - g.sum(-1, keepdims=True) / block)),
        ("x - mean is not 0 in the padding: zero it with tl.where(mask, x - mean, 0.0) before the variance",
         (1.0 / np.sqrt(var_pad + eps)) * (g - xhat_pad * (xhat_pad * g).mean(-1, keepdims=True) - c2)),
        *([(own_eps_hint(eps), ln_dx64(x, w, dy, USUAL_EPS))] if eps != USUAL_EPS else []),
    ]


def columns_never_written(got: np.ndarray) -> int | None:
    """The first column from which on no element of any row was written (all hold the poison) while every
    element before it was: what a kernel leaves that covers fewer columns than the BLOCK it was launched with."""
    unwritten = never_written(got)
    empty = unwritten.all(axis=0)
    if got.ndim != 2 or not empty.any():
        return None
    first = int(np.argmax(empty))
    return first if first > 0 and empty[first:].all() and not unwritten[:, :first].any() else None


# ---- 08.1 LayerNorm backward: dX -----------------------------------------------------------------


@exercise("08.1", "LayerNorm backward: dX row by row", names=("layer_norm_dx_kernel",))
@in_float32
def grade_layer_norm_dx(report: Report, layer_norm_dx_kernel):
    if (msg := not_a_kernel(layer_norm_dx_kernel, "layer_norm_dx_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    eps = draw_eps(rng)  # never the 1e-5 a kernel might write in: it must use its argument
    # float16 rows share a large offset: their sum in float16 loses the digits that x - mean keeps, so a
    # kernel that computes the statistics in 16 bits is visibly wrong; BLOCK is sometimes wider than needed, and
    # rows longer than 1,024 take a BLOCK wider than any a kernel might write in
    for rows, cols, dtype, wide in sizes([(5, 37, "fp32", False), (3, 128, "fp32", True), (4, 200, "fp32", False),
                                          (4, int(rng.integers(40, 100)), "fp16", False),
                                          (2, int(rng.integers(1025, 1500)), "fp32", False)],
                                         [(513, 768, "fp32", False), (64, 3000, "fp32", False), (64, 1000, "fp16", True)]):
        block = (1 << (cols - 1).bit_length()) * (2 if wide else 1)
        for seed in (0, 1):
            if dtype == "fp16":  # one offset of about 300 for all rows, spread 1: the row sums need float32
                x64 = rand(rng, (rows, cols), (1.0,)) + rng.uniform(250, 350) * rng.choice([-1, 1])
            else:
                x64 = rand(rng, (rows, cols)) + rng.uniform(-2, 2, (rows, 1))  # rows with a mean far from 0
                x64[0] *= 3e-3  # a row of small variance: there eps changes the result
            w64 = rng.uniform(0.5, 1.5, cols)
            dy64 = rand(rng, (rows, cols))
            x_full, x = framed(x64, dtype, PAD, pad_rows=1, pad_cols=3)
            dy_full, dy = framed(dy64, dtype, PAD, pad_rows=1, pad_cols=3)
            _, w = framed(w64, dtype, NAN)
            dx_full, dx = framed(np.full((rows, cols), POISON), dtype, POISON, pad_rows=1, pad_cols=3)
            what = f"{rows} x {cols} {dtype}" + (f" (BLOCK {block})" if wide else "") + f", seed {seed}"
            if not launch(report, what, layer_norm_dx_kernel, (rows,), x, dy, w, dx, cols, x.stride(0), eps, BLOCK=block):
                return
            if outside_writes(POISON, dx_full, data_mask(dx_full.shape, rows, cols)):
                return report.fail(f"{what}: wrote outside dx's rows: mask the store with cols < n_cols "
                                   "and use the row stride")
            got = host(dx)
            if nothing_written(got):
                return report.fail(f"{what}: {STUB}")
            xs, ws, dys = exact(x), exact(w), exact(dy)
            truth = ln_dx64(xs, ws, dys, eps)
            ref = _torch_dx(xs, ws, dys, eps)  # float32 math, then rounded to the output's dtype
            ref = ref.astype(got.dtype).astype(np.float64)
            floor = 8 * float(np.finfo(np.float32).eps) if dtype == "fp32" else rounding_floor(got.dtype)
            ok, line = compare(got, truth, ref, what=f"dX, {what}", rtol_floor=floor, dtype=got.dtype)
            if not ok and (first := columns_never_written(got)) is not None:
                line += (f": columns {first} to {cols - 1} of every row were never written: a program covers the "
                         f"BLOCK columns the launch passes (BLOCK={block} here; the grader varies it), "
                         "tl.arange(0, BLOCK), not a number of your own")
            if not ok and "never written" not in line:
                hint = diagnose(got, _dx_mistakes(xs, ws, dys, block, eps), tolerance(truth, ref, got.dtype))
                if hint is None and dtype == "fp16":
                    hint = ("these rows share a large offset, and in float16 their sum loses the digits x - mean "
                            "needs: convert what you load with .to(tl.float32) and compute the statistics in float32")
                if hint:
                    line += f": {hint}"
            if not report.expect(ok, line, line):
                return


# ---- 08.2 dW and dB: summing partial sums ---------------------------------------------------------


@exercise("08.2", "dW and dB: the column sum of partial sums", names=("column_sum_kernel",))
def grade_column_sum(report: Report, column_sum_kernel):
    if (msg := not_a_kernel(column_sum_kernel, "column_sum_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    for n_parts, n_cols in sizes([(40, 70), (16, 32), (5, 100), (100, 33), (1, 7)], [(528, 1536), (1000, 4096)]):
        for seed in (0, 1):
            # the grader picks the block sizes, some that no statement shows: the kernel must use its arguments
            BLOCK_P, BLOCK_N = (16, 32) if seed == 0 else (int(rng.choice([4, 8, 32])), int(rng.choice([64, 128])))
            p64 = rand(rng, (n_parts, n_cols))
            part_full, part = framed(p64, "fp32", NAN, pad_rows=BLOCK_P, pad_cols=5)
            part_full[:n_parts, n_cols:] = PAD  # rows past n_parts are NaN; the end of each row finite, to be named
            packed = host(part_full).reshape(-1)[:n_parts * n_cols].reshape(n_parts, n_cols).astype(np.float64)
            out_full, out = framed(np.full(n_cols, POISON), "fp32", POISON)
            what = f"{n_parts} partial sums of {n_cols} columns, BLOCK_P={BLOCK_P}, BLOCK_N={BLOCK_N}"
            grid = (-(-n_cols // BLOCK_N),)
            if not launch(report, what, column_sum_kernel, grid, part, out, n_parts, n_cols, part.stride(0),
                          BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N):
                return
            if outside_writes(POISON, out_full, data_mask(out_full.shape, n_cols)):
                return report.fail(f"{what}: wrote past the end of out: mask the store with cols < n_cols")
            got = host(out)
            if nothing_written(got):
                return report.fail(f"{what}: {STUB}")
            ps = exact(part)
            truth = ps.sum(0)
            ok, line = compare(got, truth, ps.astype(np.float32).sum(0, dtype=np.float32), what=what,
                               rtol_floor=4 * n_parts * float(np.finfo(np.float32).eps))
            if not ok:
                if "never written" in line:
                    line += (": program pid sums columns pid * BLOCK_N to pid * BLOCK_N + BLOCK_N - 1; use the BLOCK_N "
                             "and BLOCK_P the launch passes (the grader varies them), not numbers of your own")
                elif np.isnan(got).any():
                    line += (": NaN came from rows past n_parts: mask the loads with rows < n_parts "
                             "(the last step of the loop runs past the end)")
                elif np.allclose(got, ps[:BLOCK_P].sum(0), rtol=1e-4, atol=1e-4):
                    line += ": only the first BLOCK_P rows were added: loop over all n_parts rows, BLOCK_P at a time"
                elif n_parts > 1 and np.allclose(got, ps[-((n_parts - 1) % BLOCK_P + 1):].sum(0), rtol=1e-4, atol=1e-4):
                    line += ": the accumulator is overwritten in each step of the loop: add to it (acc += ...)"
                elif np.allclose(got, packed.sum(0), rtol=1e-4, atol=1e-4):
                    line += (f": the rows of part are `stride` elements apart ({part.stride(0)} here, a view into a "
                             "wider tensor), not n_cols: address row r at part_ptr + r * stride")
            if not report.expect(ok, line, line):
                return


# ---- 08.3 the block's FLOPs and bytes -----------------------------------------------------------


@exercise("08.3", "the block's FLOPs and bytes", names=("block_flops", "block_min_bytes"), time_limit_s=20)
def grade_block_counts(report: Report, block_flops, block_min_bytes):
    from .. import transformer as T

    rng = fresh_rng(report)  # and shapes no statement shows, drawn fresh on every run
    cases = [(8, 1024, 768, True), (1, 128, 64, False), (4, 2048, 1024, True), (2, 300, 96, False),
             *[(int(rng.integers(1, 17)), int(rng.integers(17, 5000)), int(rng.integers(8, 2049)), bool(c))
               for c in (0, 1)]]
    for B, N, d, causal in cases:
        what = f"block_flops(B={B}, N={N}, d={d}, causal={causal})"
        got = number(report, what, block_flops, B, N, d, causal)
        if got is None:
            return
        want = T.block_flops(B, N, d, causal)
        mm, attn = 24 * B * N * d * d, 4 * B * N * N * d * (0.5 if causal else 1.0)
        hints = [(want / 2, "each multiply-add is 2 FLOPs: a (M, K) x (K, N) matmul is 2·M·K·N"),
                 (mm, "attention's two products (q kᵀ and p v) are missing: 4·B·N²·d, half when causal"),
                 (mm + 4 * B * N * N * d, "with a causal mask only half the scores are computed"),
                 (16 * B * N * d * d + attn, "the MLP's hidden layer is 4·d wide: its two matmuls are 16·B·N·d²"),
                 (8 * B * N * d * d + attn, "count all four projections: QKV (d x 3d), output (d x d), MLP (d x 4d, 4d x d)")]
        if not _expect_number(report, what, got, want, hints):
            return
    for B, N, d, itemsize in [(8, 1024, 768, 2), (1, 128, 64, 4), (4, 2048, 1024, 2),
                              (int(rng.integers(1, 17)), int(rng.integers(17, 5000)), int(rng.integers(8, 2049)),
                               int(rng.choice([1, 2, 4])))]:
        what = f"block_min_bytes(B={B}, N={N}, d={d}, itemsize={itemsize})"
        got = number(report, what, block_min_bytes, B, N, d, itemsize)
        if got is None:
            return
        want = T.block_min_bytes(B, N, d, itemsize)
        hints = [(want / itemsize, "multiply the element count by itemsize, the bytes per element"),
                 (12 * d * d * itemsize, "the input is read and the output written once: add 2·B·N·d elements"),
                 ((4 * d * d + 2 * B * N * d) * itemsize, "the MLP's weights (8·d²) are read too: 12·d² in all"),
                 ((12 * d * d + B * N * d) * itemsize, "count both the input read and the output written")]
        if not _expect_number(report, what, got, want, hints):
            return


def _expect_number(report, what, got, want, hints) -> bool:
    if math.isclose(got, want, rel_tol=1e-6):
        report.ok(f"{what} = {got:.4g}")
        return True
    hint = next((h for v, h in hints if math.isclose(got, v, rel_tol=1e-6)), "")
    report.fail(f"{what} = {got:.4g}, expected {want:.4g}", hint)
    return False


# ---- 08.4 reading a profiler trace --------------------------------------------------------------


def synthetic_trace(rng=None) -> list[dict]:
    """A small trace with known answers: a name launched often with short kernels beats the longest
    single kernel, runtime calls that must not count as GPU time, two overlapping kernels, and a
    first kernel that does not start at 0. With ``rng``, its counts, times and durations are drawn (the
    grader's, fresh on every run, so that no table of answers fits it); without, the fixed one below."""
    if rng is None:
        n, t0, small, gap, before_big, big, side_after, side, tail = 6, 100.0, 20.0, 10.0, 10.0, 100.0, 50.0, 80.0, 180.0
    else:
        n, small = int(rng.integers(4, 10)), round(float(rng.uniform(10, 30)), 1)
        t0, gap, before_big = (round(float(rng.uniform(*r)), 1) for r in ((30, 300), (5, 15), (5, 20)))
        big = round(float(rng.uniform(0.4, 0.8)) * n * small, 1)  # the longest call, less than the small ones' sum
        # the copy starts inside the gemm and ends after it, as in the fixed trace, and is shorter than it
        after = float(rng.uniform(0.3, 0.8))
        side_after, side = round(after * big, 1), round((1 - after + float(rng.uniform(0.05, 0.2))) * big, 1)
        tail = round(float(rng.uniform(20, 100)), 1)
    ev = [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 400.0}]
    t = t0
    for i in range(n):
        ev.append({"cat": "kernel", "name": "small_add_kernel", "ts": t, "dur": small})
        ev.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t - 5, "dur": 4.0})
        t = round(t + small + gap, 1)
    ev.append({"cat": "kernel", "name": "big_gemm_kernel", "ts": t + before_big, "dur": big})
    # the copy starts while the gemm runs (another stream): the two overlap
    ev.append({"cat": "kernel", "name": "side_stream_copy", "ts": t + before_big + side_after, "dur": side})
    ev.append({"cat": "user_annotation", "name": "forward", "ts": 0.0,
               "dur": round(t + before_big + side_after + side + tail, 1)})
    return ev


@exercise("08.4", "reading a profiler trace", names=("dominant_kernel", "idle_share"), time_limit_s=30)
def grade_trace(report: Report, dominant_kernel, idle_share):
    import copy

    from .. import bench
    from .. import transformer as T

    rng = fresh_rng(report)  # the synthetic trace's counts and times, drawn fresh on every run
    traces = [("the synthetic trace", synthetic_trace(rng))]
    for name in ("08_trace_course", "08_trace_eager"):
        try:
            traces.append((f"the recorded trace {name}", bench.load(name).rows))
        except FileNotFoundError as exc:
            return report.fail(str(exc))
    for label, events in traces:
        got = as_tuple(report, f"dominant_kernel({label})",
                       call(report, f"dominant_kernel({label})", dominant_kernel, copy.deepcopy(events)), 2)
        if got is None:
            return
        top = T.by_kernel(events)[0]
        gpu = [e for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
        longest = max(gpu, key=lambda e: e["dur"])
        name, share = got
        if name != top["kernel"]:
            hint = ("that is the longest single call; sum each name's calls first"
                    if name == longest["name"] else "sum the durations of each kernel name over all its calls")
            if name in {e["name"] for e in events if e["cat"] != "kernel"}:
                hint = "only GPU events (cat 'kernel', 'gpu_memcpy', 'gpu_memset') ran on the GPU"
            return report.fail(f"dominant_kernel({label}): {str(name)[:60]!r}, expected {top['kernel'][:60]!r}: {hint}")
        share = as_number(report, f"dominant_kernel({label})'s share", share)
        if share is None:
            return
        if not math.isclose(share, top["share"], rel_tol=1e-3, abs_tol=1e-4):
            hint = ("a share is a fraction of the total GPU time, between 0 and 1"
                    if share > 1 else "divide by the summed duration of every GPU event")
            return report.fail(f"dominant_kernel({label}): share {share:.4f}, expected {top['share']:.4f}: {hint}")
        report.ok(f"dominant_kernel({label}) = {top['kernel'][:50]!r}, {top['share']:.1%} of GPU time")

        got = number(report, f"idle_share({label})", idle_share, copy.deepcopy(events))
        if got is None:
            return
        want = T.gpu_idle(events)["idle_share"]
        if not math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-4):
            span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
            naive = 1 - sum(e["dur"] for e in gpu) / span
            from_zero = 1 - (span - want * span) / max(e["ts"] + e["dur"] for e in gpu)
            hint = ("kernels that overlap cover that time once: merge the intervals before adding them up"
                    if math.isclose(got, naive, rel_tol=1e-3) else
                    "the span runs from the first kernel's start, not from 0"
                    if math.isclose(got, from_zero, rel_tol=1e-3) else
                    "the idle time is the span (first kernel start to last kernel end) minus the time some "
                    "kernel runs, as a fraction of the span")
            return report.fail(f"idle_share({label}) = {got:.4f}, expected {want:.4f}: {hint}")
        report.ok(f"idle_share({label}) = {want:.1%}")


# ---- 08.5 the fused LayerNorm backward, and its speed ---------------------------------------------


@exercise("08.5", "fused LayerNorm backward: dX, partial dW and dB, and its speed",
          names=("layer_norm_backward_kernel",), time_limit_s=300)
@in_float32
def grade_fused_backward(report: Report, layer_norm_backward_kernel):
    import torch

    from .. import transformer as T

    if (msg := not_a_kernel(layer_norm_backward_kernel, "layer_norm_backward_kernel")):
        return report.fail(msg)
    dev = world().device
    rng = fresh_rng(report)
    eps = draw_eps(rng)  # never the 1e-5 a kernel might write in: it must use its argument
    # float16 cases (the interpreter has no bfloat16) share a large offset: statistics summed in 16 bits lose
    # the digits that x - mean keeps; the number of programs, and so the rows each one takes, varies (up to 10
    # to 16 rows a program, of more than 1,024 columns: no ROWS_PER_PROGRAM or BLOCK written in covers them all)
    for rows, cols, programs, with_dres, dtype in sizes(
            [(7, 37, 3, False, "fp32"), (10, 64, 4, True, "fp32"), (5, 200, 5, True, "fp32"),
             (int(rng.integers(5, 12)), int(rng.integers(40, 100)), int(rng.integers(2, 5)), bool(rng.integers(2)),
              "fp16"),
             (int(rng.integers(19, 32)), int(rng.integers(1025, 1300)), 2, True, "fp32")],
            [(8192, 768, None, True, "fp32"), (1000, 3000, None, False, "fp32"), (4096, 1000, None, True, "fp16")]):
        dt = torch.float16 if dtype == "fp16" else torch.float32
        h64 = rand(rng, (rows, cols), (1.0,)) + rng.uniform(250, 350) if dtype == "fp16" else \
            rand(rng, (rows, cols)) + rng.uniform(-1, 1, (rows, 1))
        if dtype == "fp32":
            h64[0] *= 3e-3  # a row of small variance: there eps changes the result
        h = torch.from_numpy(h64).to(dev, dt)
        w = torch.from_numpy(rng.uniform(0.5, 1.5, cols)).to(dev, torch.float32)
        dy = torch.from_numpy(rand(rng, (rows, cols))).to(dev, dt)
        dres = torch.from_numpy(rand(rng, (rows, cols))).to(dev, dt) if with_dres else None
        what = f"{rows} x {cols}" + (f", {programs} programs" if programs else "") + (", with dres" if with_dres else "")
        what += ", fp16 with a large common offset" if dtype == "fp16" else ""
        try:
            dx, dw, db = T.layer_norm_backward(h, w, dy, eps, dres=dres, programs=programs,
                                               kernel=PoisonedOutputs(layer_norm_backward_kernel))
            if world().gpu:
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            return report.fail(f"{what}: {explain(exc)}")
        h64, w64, dy64 = exact(h), exact(w), exact(dy)
        xhat, _, _ = ln_parts64(h64, w64, dy64, eps)
        truths = {"dx": ln_dx64(h64, w64, dy64, eps) + (exact(dres) if with_dres else 0.0),
                  "dw": (dy64 * xhat).sum(0), "db": dy64.sum(0)}
        # PyTorch's backward in float32 math, dX rounded to the output's dtype
        refs = dict(zip(("dx", "dw", "db"), (t.cpu().double().numpy()
                                              for t in T.layer_norm_backward_ref(h.float(), w, dy.float(), eps))))
        if with_dres:
            refs["dx"] = refs["dx"] + exact(dres)
        refs["dx"] = refs["dx"].astype(host(dx).dtype).astype(np.float64)
        for key, got in (("dx", dx), ("dw", dw), ("db", db)):
            g = host(got)
            floor = 8 * float(np.finfo(np.float32).eps) * (1 if key == "dx" else rows)
            ok, line = compare(g, truths[key], refs[key], what=f"{key}, {what}",
                               rtol_floor=max(floor, rounding_floor(g.dtype)) if g.dtype == np.float16 else floor)
            unwritten = bool(never_written(g).any())  # compare's line says so already
            if not ok and dtype == "fp16" and not unwritten:
                line += (": these rows share a large offset, and in float16 their sums lose the digits x - mean "
                         "needs: convert what you load with .to(tl.float32) and compute in float32")
            if not ok and key == "dx":
                usual = ln_dx64(h64, w64, dy64, USUAL_EPS) + (exact(dres) if with_dres else 0.0)
                if np.abs(g - usual).max() < 0.1 * np.abs(g - truths[key]).max():
                    line += f": {own_eps_hint(eps)}"
            if not ok and key == "dx" and programs and (hint := rows_skipped(g, truths[key], rows, programs)):
                line += f": {hint}"
            elif not ok and key == "dx" and programs and cols > 1024 and (
                    not unwritten or columns_never_written(g) is not None):
                line += (f": rows longer than 1,024 elements are launched with BLOCK = {1 << (cols - 1).bit_length()}: "
                         "a program covers the BLOCK columns the launch passes, tl.arange(0, BLOCK), not a number of "
                         "your own")
            if not ok and key == "dx" and with_dres and compare(g, truths[key] - exact(dres), refs[key] - exact(dres),
                                                                what="", rtol_floor=1e-5)[0]:
                line += ": add dres (the gradient flowing past the LayerNorm) to dX when HAS_DRES"
            if not ok and key != "dx" and np.isnan(g).any():
                line += (": the partial sums are NaN before the kernel runs (the grader fills them so): does every "
                         "program store its partial dW and dB, at part_ptr + pid * 2 * n_cols?")
            elif not ok and not unwritten and np.abs(g).max() > 1e6 * max(np.abs(truths[key]).max(), 1.0):
                line += ": values this large were never computed: did the kernel store dx and the partial sums?"
            if not ok and key != "dx" and programs:
                per_row = dy64 * xhat if key == "dw" else dy64
                rpp = -(-rows // programs)
                last_rows = [r for r in range(rpp - 1, -(-rows // rpp) * rpp, rpp) if r < rows]
                if np.allclose(g, per_row[last_rows].sum(0), rtol=1e-4, atol=1e-4):
                    line += ": each program must add up all of its rows (dw += ...), not keep the last one"
            if not report.expect(ok, line, line):
                return
    if not rows_apart_by_their_stride(report, layer_norm_backward_kernel, rng, eps):
        return
    # traffic a correct kernel never makes, whatever the speed of the GPU: reading its partial sums back
    if not partial_sums_stay_in_registers(report, layer_norm_backward_kernel, rng):
        return
    # speed: the whole backward (this kernel and the column sum) against PyTorch's, in 16-bit, at a large shape
    n_rows, n_cols = 16384, 2048
    if not world().gpu:
        return speed_vs_peer(report, f"LayerNorm backward at {n_rows} x {n_cols} 16-bit", None, None, "PyTorch", 0.9)
    low = low_precision_dtype()  # bfloat16, or float16 on a GPU without it (the T4)
    name = str(low).removeprefix("torch.")
    h = torch.randn(n_rows, n_cols, device=dev, dtype=low)
    dy = torch.randn_like(h)
    w = torch.rand(n_cols, device=dev) + 0.5
    # the kernels' GPU time (a CUDA graph): the launcher's Python (two launches, three allocations) is the same
    # for every kernel, and on a busy machine it alone took longer than the kernels it launches
    speed_vs_peer(report, f"LayerNorm backward at {n_rows} x {n_cols} {name}",
                  lambda: T.layer_norm_backward(h, w, dy, EPS, kernel=layer_norm_backward_kernel),
                  T.torch_layer_norm_backward(h, w, dy, EPS), "PyTorch's LayerNorm backward", 0.9, gpu_only=True)
    # and against the course's kernel, timed in the same run: PyTorch's speed varies from GPU to GPU, so a
    # kernel that loads and stores its partial sums for every row can clear 0.9x PyTorch on some runs; against
    # a peer that does the same work with the sums in registers, it cannot
    speed_vs_peer(report, f"LayerNorm backward against the course's kernel at {n_rows} x {n_cols} {name}",
                  lambda: T.layer_norm_backward(h, w, dy, EPS, kernel=layer_norm_backward_kernel),
                  lambda: T.layer_norm_backward(h, w, dy, EPS), "the course's kernel", 0.9, hint=KEEP_IN_REGISTERS,
                  gpu_only=True)


class PoisonedOutputs:
    """08.5's kernel as ``T.layer_norm_backward`` launches it, with dx filled with poison (-inf in float16, as
    ``framed`` does) and the partial sums with NaN first. The launcher allocates them with torch.empty, which on a
    GPU hands back memory freed before: often the right answer to the same case (PyTorch's reference, an earlier
    grading), so rows or columns a kernel never writes would pass, and the mistake would show only in dW, unnamed."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def poisoned(h, dy, dres, w, dx, part, *args, **meta):
            import torch

            dx.fill_(-math.inf if dx.dtype == torch.float16 else POISON)
            part.fill_(NAN)
            return launch(h, dy, dres, w, dx, part, *args, **meta)

        return poisoned


def rows_skipped(got, truth, rows: int, programs: int) -> str | None:
    """08.5's hint when whole rows of dX are wrong and the others right, in the pattern of a kernel that takes
    fewer rows per program than the launch's ROWS_PER_PROGRAM (a number of its own in the loop, or in the row
    index too), or None."""
    rpp = -(-rows // programs)
    programs = -(-rows // rpp)
    wrong = ~np.isclose(got, truth, rtol=1e-3, atol=1e-3 * float(np.abs(truth).max())).all(axis=1)
    r = np.arange(rows)
    if not any((wrong == (r % rpp >= k)).all() or (wrong == (r >= k * programs)).all() for k in range(1, rpp)):
        return None
    bad = np.flatnonzero(wrong)
    return (f"rows {', '.join(map(str, bad[:4]))}{', ...' if bad.size > 4 else ''} are wrong, the others right: program pid "
            f"takes the ROWS_PER_PROGRAM rows from pid * ROWS_PER_PROGRAM on, the number the launch passes ({rpp} "
            "here; the grader varies it), not a number of your own")


def rows_apart_by_their_stride(report: Report, kernel, rng, eps: float) -> bool:
    """08.5 on rows further apart than n_cols: h, dy, dres and dx are views into wider tensors with one row stride
    (the launcher above makes its inputs contiguous, so there the stride is always n_cols). Launched here directly."""
    import torch
    import triton

    rows, cols, programs, pad = int(rng.integers(9, 20)), int(rng.integers(40, 90)), 3, int(rng.integers(3, 9))
    h64 = rand(rng, (rows, cols)) + rng.uniform(-1, 1, (rows, 1))
    dy64, dres64, w64 = rand(rng, (rows, cols)), rand(rng, (rows, cols)), rng.uniform(0.5, 1.5, cols)
    _, h = framed(h64, "fp32", PAD, pad_cols=pad)
    _, dy = framed(dy64, "fp32", PAD, pad_cols=pad)
    _, dres = framed(dres64, "fp32", PAD, pad_cols=pad)
    dx_full, dx = framed(np.full((rows, cols), POISON), "fp32", POISON, pad_cols=pad)
    w = torch.from_numpy(w64).to(world().device, torch.float32)
    rpp = -(-rows // programs)
    programs = -(-rows // rpp)
    part = torch.full((programs, 2 * cols), float("nan"), device=world().device, dtype=torch.float32)
    what = f"{rows} x {cols}, rows {h.stride(0)} elements apart, {programs} programs, with dres"
    if not launch(report, what, kernel, (programs,), h, dy, dres, w, dx, part, rows, cols, h.stride(0), eps,
                  ROWS_PER_PROGRAM=rpp, BLOCK=triton.next_power_of_2(cols), HAS_DRES=True):
        return False
    h64, dy64, dres64, w64 = exact(h), exact(dy), exact(dres), exact(w)
    xhat, _, _ = ln_parts64(h64, w64, dy64, eps)
    got = {"dx": host(dx), "dw": host(part[:, :cols]).sum(0), "db": host(part[:, cols:]).sum(0)}
    truths = {"dx": ln_dx64(h64, w64, dy64, eps) + dres64, "dw": (dy64 * xhat).sum(0), "db": dy64.sum(0)}
    written_outside = outside_writes(POISON, dx_full, data_mask(dx_full.shape, rows, cols))
    for key in ("dx", "dw", "db"):
        ok, line = compare(got[key], truths[key], truths[key], what=f"{key}, {what}",
                           rtol_floor=64 * float(np.finfo(np.float32).eps) * (1 if key == "dx" else rows))
        if not ok or (key == "dx" and written_outside):
            line = (f"{key}, {what}: wrong, where the rows of h, dy, dres and dx are views into wider tensors: "
                    "address row r at ptr + r * stride (the stride argument), not r * n_cols")
            return report.expect(False, "", line)
    return report.expect(True, f"rows {h.stride(0)} elements apart (views into wider tensors): dx, dw and db match",
                         "")


KEEP_IN_REGISTERS = ("keep each program's partial dW and dB in registers across its rows (dw += dy * xhat) and "
                     "store them once at the end: a load and a store of the partial sums for every row costs "
                     "memory traffic and makes each row wait for the last")


def partial_sums_stay_in_registers(report: Report, kernel, rng) -> bool:
    """08.5: the kernel never loads from ``part``. On the CPU, counted as Triton's interpreter runs it; on a GPU,
    read from the code Triton compiled for it (the launches of the checks above)."""
    import torch

    from .. import transformer as T
    from .addresses import compiled_function, loads_in_compiled, traffic

    fn = compiled_function(kernel)
    names = list(getattr(fn, "arg_names", []))
    part = names[5] if len(names) > 5 else "part_ptr"  # the sixth argument, as the statement orders them
    if world().gpu:
        loads = loads_in_compiled(kernel, part)
        where = f"its compiled code has {loads} tl.load of `{part}`" if loads else ""
    else:
        rows, cols, programs = 24, int(rng.integers(33, 64)), 3
        h = torch.from_numpy(rand(rng, (rows, cols))).float()
        dy = torch.from_numpy(rand(rng, (rows, cols))).float()
        w = torch.from_numpy(rng.uniform(0.5, 1.5, cols)).float()
        try:
            with traffic() as counts:
                T.layer_norm_backward(h, w, dy, EPS, programs=programs, kernel=kernel)
        except Exception as exc:  # noqa: BLE001
            return report.expect(False, "", f"{rows} x {cols}, {programs} programs: {explain(exc)}")
        loads = None if counts is None else counts[(getattr(fn, "__name__", ""), part, "load")]
        where = (f"at {rows} x {cols} on {programs} programs of {rows // programs} rows it loaded {loads} values of "
                 f"`{part}`") if loads else ""
    if loads is None:  # nothing to read it from: the speed check below still times it
        return True
    return report.expect(not loads, f"partial sums: `{part}` is written once per program and never read back",
                         f"partial sums: {where}, which a kernel that keeps them in registers never reads: "
                         + KEEP_IN_REGISTERS)


# ---- 08.6 fused cross-entropy: the loss and the gradient of the logits in one pass --------------------


def cross_entropy64(x, target, ignore_index):
    """(mean loss, d loss / d x) of F.cross_entropy in float64, rows whose target is ignore_index left out."""
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    valid = target != ignore_index
    rows = np.flatnonzero(valid)
    count = max(int(valid.sum()), 1)
    loss = float((lse[rows, 0] - x[rows, target[rows]]).sum() / count) if rows.size else float("nan")
    grad = np.exp(x - lse)
    grad[rows, target[rows]] -= 1.0
    grad[~valid] = 0.0
    return loss, grad / count, lse[:, 0], valid


@exercise("08.6", "fused cross-entropy: loss and gradient in one pass", names=("cross_entropy_fwd_bwd",))
def grade_cross_entropy(report: Report, cross_entropy_fwd_bwd):
    import torch
    import torch.nn.functional as F

    from .harness import rounding_floor, to_numpy

    if not callable(cross_entropy_fwd_bwd) or hasattr(cross_entropy_fwd_bwd, "__getitem__"):
        return report.fail("cross_entropy_fwd_bwd should be a plain Python function that launches your kernel and "
                           "returns (loss, grad), not the kernel itself")
    dev = world().device
    # (rows, vocabulary, dtype, ignore_index, the BLOCKs it is called with): no vocabulary is a multiple of a
    # block; every third row has logits near 1000 (exp overflows unless the max is subtracted)
    rng = fresh_rng(report)  # values, and the second case's ignore_index (a class id), drawn fresh on every run
    cases = sizes([(6, 1000, "fp32", -100, (256, 1024)), (5, 257, "fp32", int(rng.integers(1, 257)), (64,)),
                   (7, 130, "fp16", -100, (64, 128))],
                  [(512, 50257, "fp32", -100, (4096,)), (300, 32003, "fp16", -100, (2048,))])
    counted = False
    for rows, V, dtype, ignore_index, blocks in cases:
        data = rand(rng, (rows, V), scales=(1.0, 3.0))
        data[1::3] += 1000.0
        target = rng.integers(0, V, rows)
        target[0] = ignore_index                       # an ignored row (padding)
        if ignore_index >= 0:
            target[target == ignore_index] = (ignore_index + 1) % V
            target[0] = ignore_index
        for block in blocks:
            # logits: a view into a wider tensor whose extra columns hold a finite pad
            logits_full, logits = framed(data, dtype, PAD, pad_rows=1, pad_cols=max(blocks) + 3)
            tgt = torch.from_numpy(target).to(dev)
            xs = exact(logits)
            loss64, grad64, lse64, valid = cross_entropy64(xs, target, ignore_index)
            what = f"{rows} x {V} {dtype}, ignore_index={ignore_index}, BLOCK={block}"
            ref_x = logits.detach().clone().float().requires_grad_(True) if dtype == "fp16" and not world().gpu \
                else logits.detach().clone().requires_grad_(True)
            ref_loss = F.cross_entropy(ref_x, tgt, ignore_index=ignore_index)
            ref_loss.backward()
            ref_grad = host(ref_x.grad.to(logits.dtype))
            made = _LargeTensors(rows * V)
            # the gradient and the per-row losses the launcher allocates start as NaN, not as what memory held (on a
            # GPU, the right values a previous case or run left there): a row the kernel never stores shows
            with unwritten_as_nan():
                if counted:  # the count slows the interpreter down: the first call is enough to see how it works
                    got = call(report, what, cross_entropy_fwd_bwd, logits, tgt, ignore_index, BLOCK=block)
                else:
                    with made:
                        got = call(report, what, cross_entropy_fwd_bwd, logits, tgt, ignore_index, BLOCK=block)
                    counted = True
            got = as_tuple(report, what, got, 2)
            if got is None:
                return
            if world().gpu:
                torch.cuda.synchronize()
            loss, grad = got
            try:
                loss = float(loss.item() if hasattr(loss, "item") else loss)
            except (TypeError, ValueError, RuntimeError):
                return report.fail(f"{what}: the loss is {type(loss).__name__}, not a number (a 0-d tensor or a float)")
            if not hasattr(grad, "shape") or tuple(grad.shape) != (rows, V):
                return report.fail(f"{what}: the gradient has shape {tuple(getattr(grad, 'shape', ()))}, "
                                   f"expected ({rows}, {V}), one value per logit")
            if getattr(grad, "dtype", logits.dtype) != logits.dtype:
                return report.fail(f"{what}: the gradient is {grad.dtype}, the logits {logits.dtype}: allocate it in the "
                                   "logits' dtype (torch.empty_like(logits)), as F.cross_entropy's is; the kernel "
                                   "computes in float32 and converts when it stores")
            n_valid, count_all = int(valid.sum()), rows
            # float32 rounds a row's loss at the scale of its log-sum-exp (logits near 1000: a kernel that forms
            # m + log(s) before subtracting the target's logit is right and rounds at 1000), not of the loss
            scale = max(abs(loss64), float(np.abs(lse64[valid]).max(initial=0.0)))
            tol = max(2 * abs(float(ref_loss) - loss64), 8 * float(np.finfo(np.float32).eps) * scale, 1e-6)
            if not math.isfinite(loss) or abs(loss - loss64) > tol:
                if not math.isfinite(loss) and _finite_in_rows(grad, valid, rows, V):
                    hint = ("the rows not ignored have a finite gradient, so the NaN comes from an ignored row: its "
                            "loss is 0, but that 0 must be stored, since torch.empty gives memory as it was, not zeros "
                            "(the grader fills it with NaN): store 0 as an ignored row's loss")
                    if not _finite_in_rows(grad, ~valid, rows, V):
                        hint += ", and zeros in its row of the gradient"
                elif not math.isfinite(loss):
                    hint = ("exp() overflows for logits near 1000: keep the running max m and a running sum of "
                            "exp(x - m), rescaled by exp(m_old - m_new) when the max grows")
                elif math.isclose(loss, loss64 * n_valid / count_all, rel_tol=1e-3):
                    hint = ("the mean is over the rows that are not ignored: divide by the number of targets "
                            "!= ignore_index, not by the number of rows")
                elif math.isclose(loss, cross_entropy64(host(logits_full).astype(np.float64).reshape(-1)[:rows * V]
                                                        .reshape(rows, V), target, ignore_index)[0], rel_tol=1e-3):
                    hint = (f"the rows of the logits are {logits.stride(0)} elements apart here (a view into a wider "
                            "tensor), not n_cols: pass logits.stride(0) and address row r at r * stride")
                elif block < V and math.isclose(loss, _loss_of_first_columns(xs, target, valid, block), rel_tol=1e-3):
                    hint = (f"only the first {block} columns of each row got into the log-sum-exp: step over the row by "
                            "the BLOCK the launch passes (the grader varies it), for start in range(0, n_cols, BLOCK), "
                            "loading tl.arange(0, BLOCK) at each step")
                else:
                    hint = ("the loss of a row is logsumexp(x) - x[target], 0 for an ignored row; the mean divides "
                            "their sum by the number of rows not ignored")
                return report.fail(f"{what}: loss {loss:.6g}, expected {loss64:.6g} (tolerance {tol:.2g}): {hint}")
            report.ok(f"{what}: loss {loss:.6g} matches (error {abs(loss - loss64):.2g})")
            if len(made.ops) > 1:
                return report.fail(f"{what}: the launcher made {len(made.ops)} tensors as large as the logits "
                                   f"({', '.join(made.ops[:4])}): only the gradient should be one; compute the softmax "
                                   "inside the kernel (and pass the logits' row stride rather than a contiguous copy)")
            g = to_numpy(grad)
            ok, line = compare(g, grad64, ref_grad, what=f"{what}: the gradient",
                               rtol_floor=rounding_floor(g.dtype))
            if not ok:
                pad_cols = -(-V // block) * block - V
                unmasked = np.concatenate([xs, np.full((rows, pad_cols), PAD)], axis=1)
                lse_unmasked = unmasked.max(1, keepdims=True) + np.log(
                    np.exp(unmasked - unmasked.max(1, keepdims=True)).sum(1, keepdims=True))
                g_unmasked = np.exp(xs - lse_unmasked)
                r = np.flatnonzero(valid)
                g_unmasked[r, target[r]] -= 1.0
                g_unmasked[~valid] = 0.0
                hint = None
                if _finite_in_rows(g, valid, rows, V) and not _finite_in_rows(g, ~valid, rows, V):
                    hint = ("all in the rows whose target is ignore_index: an ignored row gets no gradient, but its "
                            "zeros must be stored, since torch.empty_like(logits) gives memory as it was, not zeros "
                            "(the grader fills it with NaN): store zeros in its row")
                hint = hint or diagnose(g, [
                    ("the gradient of the mean is divided by the number of rows not ignored: "
                     "(softmax(x) - onehot(target)) / n_valid", grad64 * n_valid),
                    ("divide the gradient by the number of rows not ignored, not by the number of rows",
                     grad64 * n_valid / count_all),
                    ("the last chunk of the row runs past the vocabulary: mask it (cols < n_cols, other=-inf for "
                     "the max and the sum) so that no value past the row gets into the log-sum-exp",
                     (g_unmasked / max(n_valid, 1)) if pad_cols else None),
                ], tolerance(grad64, ref_grad, g.dtype), truth=grad64)
                if hint is None and np.isfinite(grad64).all() and not np.isfinite(g.astype(np.float64)).all():
                    hint = ("NaN or Inf: exp() overflows for logits near 1000: subtract the running max before "
                            "exp, and rescale the running sum when the max grows")
                if hint is None and np.abs(g[~valid]).max(initial=0.0) > 0:
                    hint = "an ignored row gets no gradient: store zeros in its row"
                if hint:
                    line += f": {hint}"
            if not report.expect(ok, line, line):
                return


def _finite_in_rows(grad, which: np.ndarray, rows: int, cols: int) -> bool:
    """True when ``grad`` is a (rows, cols) gradient whose rows marked in ``which`` hold only finite values (08.6:
    NaN in an ignored row alone is that row never stored, read from a buffer that unwritten_as_nan made NaN)."""
    from .harness import to_numpy

    if not hasattr(grad, "shape") or tuple(grad.shape) != (rows, cols):
        return False
    try:
        g = np.asarray(to_numpy(grad), dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(np.isfinite(g[which]).all())


def _loss_of_first_columns(x, target, valid, block: int) -> float:
    """08.6's mean loss with each row's log-sum-exp taken over its first ``block`` columns only: what a kernel
    computes that steps over the row by more than the BLOCK it loads (a step of its own)."""
    first = x[:, :block]
    m = first.max(axis=1)
    lse = m + np.log(np.exp(first - m[:, None]).sum(axis=1))
    rows = np.flatnonzero(valid)
    return float((lse[rows] - x[rows, target[rows]]).sum() / max(rows.size, 1))


def _LargeTensors(numel: int):
    """A dispatch mode that lists the PyTorch ops (not views) that made a tensor of at least ``numel``
    elements, in ``.ops``: a Triton launch is no PyTorch op, so a launcher whose kernel does the work
    lists only the buffers it allocates."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LargeTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            # views and in-place ops make no new tensor; the interpreter's launch moves bytes (uint8), not floats
            if not getattr(func, "is_view", False) and not name.endswith("_"):
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel() >= numel:
                        self.ops.append(name)
                        break
            return out

    return LargeTensors()
