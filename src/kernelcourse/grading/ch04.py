"""Graders for chapter 04, Triton kernels (Triton's interpreter on the CPU, compiled on a GPU).

Each grader launches the learner's ``@triton.jit`` kernel itself, so that calling PyTorch from a
launcher cannot pass. Every input and output lives inside a larger buffer: inputs are framed by NaN
(an unmasked read past the data brings NaN into the result), outputs by poison (a write past the data
shows in the frame, an element never written keeps its poison). Results are compared with a float64
truth, row by row for row-wise kernels, with a tolerance of twice PyTorch's own error at the same
precision on the same device. When a result is wrong, the grader also computes the typical mistakes
(a missing mask, a wrong stride, a missing max...) and names the one that matches.

The helpers live in ``harness``, the Triton grading harness chapters 04 to 06 share; they are
re-exported here for graders that import them from this module.
"""
from __future__ import annotations

import numpy as np

from ..world import world
from . import POISON, Report, compare, exercise, explain, fresh_rng

# The Triton grading harness (``harness``), re-exported here for the graders that import it from ch04.
from .harness import (  # noqa: F401
    GUARD, NAN, PAD, STUB, compare_rows, data_mask, diagnose, exact, framed, host, in_float32, launch,
    USUAL_EPS, draw_eps, not_a_kernel, nothing_written, outside_writes, own_eps_hint, rand, rounding_floor, sizes,
    to_numpy, tolerance, torch_dtype)


def gelu64(x):
    """The exact GELU, 0.5 x (1 + erf(x / sqrt 2)), in float64."""
    import torch

    v = torch.from_numpy(np.array(x, dtype=np.float64))
    return (0.5 * v * (1.0 + torch.special.erf(v / np.sqrt(2.0)))).numpy()


# ---- 04.1 fused scale + GELU ---------------------------------------------------------------------


@exercise("04.1", "fused scale + GELU", names=("scale_gelu_kernel",))
@in_float32
def grade_scale_gelu(report: Report, scale_gelu_kernel):
    import torch
    import torch.nn.functional as F

    if (msg := not_a_kernel(scale_gelu_kernel, "scale_gelu_kernel")):
        return report.fail(msg)
    run_rng = fresh_rng(report)  # values, and a size and a BLOCK no statement shows, drawn fresh on every run
    cases = sizes([(1000, 256, "fp32"), (1, 128, "fp32"), (4099, 1024, "fp32"), (1000, 256, "fp16"),
                   (int(run_rng.integers(300, 3000)), int(run_rng.choice([64, 512])), "fp32")],
                  [((1 << 20) + 3, 1024, "fp32"), ((1 << 20) + 3, 1024, "fp16")])
    for n, block, dtype in cases:
        for draw in (1, 2):  # two draws of this run's values at each size
            rng = run_rng
            scale = float(rng.uniform(0.5, 2.0))
            x_full, x = framed(rand(rng, n), dtype, NAN)
            y_full, y = framed(np.full(n, POISON), dtype, POISON)
            grid = (-(-n // block),)
            what = f"n={n} {dtype}, draw {draw} (grid {grid[0]} x BLOCK {block})"
            if not launch(report, what, scale_gelu_kernel, grid, x, y, n, scale, BLOCK=block):
                return
            if outside_writes(POISON, y_full, data_mask(y_full.shape, n)):
                return report.fail(f"{what}: wrote past the end of y (index >= n): mask the store with offs < n")
            got, xs = host(y), exact(x)
            if nothing_written(got):
                return report.fail(f"{what}: {STUB}")
            written = got != np.asarray(POISON, dtype=got.dtype)
            if n > block and written[:block].all() and not written[block:].any():
                return report.fail(f"{what}: only elements 0-{block - 1} were written: every program stored the same "
                                   "block; the offsets are pid * BLOCK + tl.arange(0, BLOCK)")
            truth = gelu64(xs * scale)
            reference = host(F.gelu(x * scale))
            passed, line = compare(got, truth, reference, what=what, rtol_floor=rounding_floor(got.dtype))
            if not passed and "never written" in line and not written[n - 1] and written[: n - 1].all():
                line += ": the last element is missing; the mask is offs < n"
            elif not passed and "never written" in line:
                line += (f": program pid covers the BLOCK elements from pid * BLOCK; use the BLOCK the launch passes "
                         f"(here {block}: the grader varies it), not a number of your own")
            elif not passed and "never written" not in line:
                tol = tolerance(truth, reference, got.dtype)
                hint = diagnose(got, [
                    ("that is gelu(x): multiply x by scale first", gelu64(xs)),
                    ("that is the tanh approximation of GELU; use the exact form 0.5 x (1 + erf(x / sqrt(2)))",
                     _gelu_tanh64(xs * scale)),
                    ("that is x * scale without the GELU", xs * scale),
                    ("that is scale * gelu(x): the scale goes inside the GELU", scale * gelu64(xs)),
                ], tol)
                if hint:
                    line += f": {hint}"
                elif np.isnan(got).any():
                    line += ": NaN came from memory past the end of x; mask the load with offs < n"
            if not report.expect(passed, line, line):
                return


def _gelu_tanh64(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


# ---- 04.2 a bias over a 2D tile, with strides ----------------------------------------------------


@exercise("04.2", "2D tiles and strides: add a bias row", names=("add_bias_kernel",))
def grade_add_bias(report: Report, add_bias_kernel):
    if (msg := not_a_kernel(add_bias_kernel, "add_bias_kernel")):
        return report.fail(msg)
    # (rows, cols, BLOCK_M, BLOCK_N, dtype): rows != cols, neither a multiple of its block
    rng = fresh_rng(report)  # values, and a shape and blocks no statement shows, drawn fresh on every run
    # and once with the largest blocks drawn, over more than one of them both ways: a tile of the kernel's own
    # (tl.arange(0, 32) for BLOCK_M) smaller than those leaves elements unwritten on every run
    cases = sizes([(1, 1, 16, 16, "fp32"), (37, 53, 16, 32, "fp32"), (20, 130, 8, 64, "fp16"),
                   (70, 9, 32, 16, "fp32"), (70, 131, 64, 128, "fp32"),
                   (int(rng.integers(2, 90)), int(rng.integers(2, 90)), int(rng.choice([4, 8, 64])),
                    int(rng.choice([4, 16, 128])), "fp32")],
                  [(1000, 1003, 32, 64, "fp32"), (1000, 1003, 64, 128, "fp16")])
    for rows, cols, bm, bn, dtype in cases:
        # the two row strides differ from cols, and from each other; y's are the wider, so that a kernel storing y
        # with x's stride writes inside y's rows (into its padding), where the grader names it
        pad_x, pad_y = 3, 5
        x_full, x = framed(rand(rng, (rows, cols)), dtype, NAN, pad_rows=bm, pad_cols=pad_x + bn)
        b_full, b = framed(rand(rng, cols), dtype, NAN)
        y_full, y = framed(np.full((rows, cols), POISON), dtype, POISON, pad_rows=bm, pad_cols=pad_y + bn)
        sx, sy = x.stride(0), y.stride(0)
        grid = (-(-rows // bm), -(-cols // bn))
        what = f"{rows}x{cols} {dtype}, grid {grid}, BLOCK_M={bm}, BLOCK_N={bn}"
        if not launch(report, what, add_bias_kernel, grid, x, b, y, rows, cols, sx, sy, BLOCK_M=bm, BLOCK_N=bn):
            return
        if outside_writes(POISON, y_full, data_mask(y_full.shape, rows, cols)):
            written = host(y_full).ravel() != np.asarray(POISON, dtype=host(y_full).dtype)
            at_sx = (np.arange(rows)[:, None] * sx + np.arange(cols)[None, :]).ravel()
            if written.sum() == at_sx.size and written[at_sx].all():
                return report.fail(f"{what}: y was stored with x's row stride: y's rows are stride_y = {sy} elements "
                                   f"apart, x's stride_x = {sx}; address y at rows[:, None] * stride_y + "
                                   "cols[None, :], each tensor with its own stride")
            return report.fail(f"{what}: wrote outside y (a row >= n_rows or a column >= n_cols): the mask needs "
                               "both, rows[:, None] < n_rows and cols[None, :] < n_cols; y's rows are stride_y apart")
        got, xs, bs = host(y), exact(x), exact(b)
        if nothing_written(got):
            return report.fail(f"{what}: {STUB}")
        truth = xs + bs[None, :]
        reference = host(x + b[None, :])
        passed, line = compare(got, truth, reference, what=what, rtol_floor=rounding_floor(got.dtype))
        if not passed and "never written" in line:
            line += (": tl.program_id(0) runs over blocks of rows, tl.program_id(1) over blocks of columns; "
                     f"each program covers BLOCK_M rows and BLOCK_N columns: use the BLOCK_M and BLOCK_N the launch "
                     f"passes (here {bm} and {bn}: the grader varies them), not numbers of your own")
        elif not passed:
            tol = tolerance(truth, reference, got.dtype)
            hxf = exact(x_full).ravel()
            strided = hxf[np.arange(rows)[:, None] * cols + np.arange(cols)[None, :]] + bs[None, :]
            mistakes = [("rows of x are stride_x elements apart, not n_cols: x is a view into a wider tensor",
                         strided)]
            if rows <= cols:
                mistakes.append(("the bias has one value per column: load it at the column offsets and broadcast "
                                 "it over the rows, b[None, :]", xs + bs[:rows, None]))
            hint = diagnose(got, mistakes, tol)
            if hint:
                line += f": {hint}"
            elif np.isnan(got).any():
                line += (": NaN came from memory outside x or b: use stride_x for x, and load b at the column "
                         "offsets with the column mask")
        if not report.expect(passed, line, line):
            return


# ---- 04.3 row log-softmax ------------------------------------------------------------------------


def _softmax_rows(rng, rows, cols):
    """Rows of very different scales and offsets, one of them all negative: exp() overflows unless
    the max is subtracted, and zero padding shows in the all-negative row."""
    scales = [1.0, 30.0, 1000.0]
    offsets = [0.0, 500.0, -500.0]
    x = np.empty((rows, cols))
    for i in range(rows):
        x[i] = rand(rng, cols) * scales[i % 3] + offsets[(i // 3) % 3]
    x[-1] = -np.abs(x[-1]) - 2.0  # all negative
    return x


def log_softmax64(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@exercise("04.3", "row log-softmax", names=("log_softmax_kernel",))
@in_float32
def grade_log_softmax(report: Report, log_softmax_kernel):
    import torch
    import triton

    if (msg := not_a_kernel(log_softmax_kernel, "log_softmax_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    # (rows, cols, dtype, BLOCK wider than needed): one row longer than 1024 (a kernel that ignores BLOCK for a
    # number of its own shows), and a BLOCK twice the next power of two (the padding is the kernel's to mask)
    cases = sizes([(1, 1, "fp32", False), (7, 37, "fp32", False), (4, 1000, "fp32", False), (7, 37, "fp16", False),
                   (3, int(rng.integers(1030, 1500)), "fp32", False), (5, int(rng.integers(20, 200)), "fp32", True)],
                  [(64, 4099, "fp32", False), (64, 4099, "fp16", False)])
    for rows, cols, dtype, wide in cases:
        block = triton.next_power_of_2(cols) * (2 if wide else 1)
        data = _softmax_rows(rng, rows, cols)
        if dtype == "fp16":
            data = np.clip(data, -6e4, 6e4)
        # a finite frame: a read past the row (or with the wrong stride) gives a wrong value we can name
        x_full, x = framed(data, dtype, PAD, pad_rows=1, pad_cols=5 + block)
        y_full, y = framed(np.full((rows, cols), POISON), dtype, POISON, pad_rows=1, pad_cols=3 + block)
        what = f"{rows}x{cols} {dtype} (BLOCK {block})"
        if not launch(report, what, log_softmax_kernel, (rows,), x, y, cols, x.stride(0), y.stride(0), BLOCK=block):
            return
        if outside_writes(POISON, y_full, data_mask(y_full.shape, rows, cols)):
            return report.fail(f"{what}: wrote outside y (a column >= n_cols, or the wrong row): mask the store with "
                               "cols < n_cols and start row i at y_ptr + i * stride_y")
        got, xs = host(y), exact(x)
        if nothing_written(got):
            return report.fail(f"{what}: {STUB}")
        truth = log_softmax64(xs)
        reference = host(torch.log_softmax(x, dim=-1))
        hxf = exact(x_full).ravel()

        def mistakes(i):
            row = xs[i]
            m = row.max()
            padded = np.concatenate([row, np.zeros(block - cols)])
            unmasked = np.concatenate([row, np.full(block - cols, PAD)])
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                return [
                    ("mask the load (cols < n_cols, other=-float('inf')): the row's last block reads past its end",
                     log_softmax64(unmasked[None, :])[0, :cols]),
                    ("that is softmax; log-softmax is (x - max) - log(sum(exp(x - max)))",
                     np.exp(row - m) / np.exp(row - m).sum()),
                    ("subtract the max from x as well: (x - max) - log(sum(exp(x - max)))",
                     row - np.log(np.exp(row - m).sum())),
                    ("padded columns must not count: load with other=-float('inf'), so that they neither win the "
                     "max nor add to the sum",
                     row - padded.max() - np.log(np.exp(padded - padded.max()).sum())),
                    ("rows of x are stride_x elements apart, not n_cols",
                     log_softmax64(hxf[i * cols: i * cols + cols][None, :])[0] if hxf.size >= (i + 1) * cols
                     else np.full(cols, np.inf)),
                ]

        passed, line = compare_rows(got, truth, reference, what, mistakes, nonfinite=(
            "exp() overflows for large inputs (above 88 in float32): subtract the row max before tl.exp; and mask "
            "the load, so that NaN from past the row cannot get in"))
        if not passed and "never written" in line:
            line += (f": one program covers a whole row with tl.arange(0, BLOCK); use the BLOCK the launch passes "
                     f"(here {block}: the grader varies it), not a number of your own")
        if not report.expect(passed, line, line):
            return


# ---- 04.4 RMSNorm --------------------------------------------------------------------------------


def rms_norm64(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


@exercise("04.4", "RMSNorm row kernel", names=("rms_norm_kernel",))
@in_float32
def grade_rms_norm(report: Report, rms_norm_kernel):
    import torch
    import triton

    if (msg := not_a_kernel(rms_norm_kernel, "rms_norm_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    eps = draw_eps(rng)  # never the 1e-5 a kernel might write in: it must use its argument
    # (rows, cols, dtype, BLOCK wider than needed), as in 04.3
    cases = sizes([(1, 1, "fp32", False), (6, 100, "fp32", False), (3, 1000, "fp32", False), (6, 100, "fp16", False),
                   (3, int(rng.integers(1030, 1500)), "fp32", False), (4, int(rng.integers(20, 200)), "fp32", True)],
                  [(64, 4099, "fp32", False), (64, 4099, "fp16", False)])
    for rows, cols, dtype, wide in cases:
        block = triton.next_power_of_2(cols) * (2 if wide else 1)
        data = rand(rng, (rows, cols))
        data[0] *= 2e-3  # tiny values: eps matters here
        if rows > 2:
            data[2] *= 300.0  # x * x overflows float16 (above 65504): statistics belong in float32
        x_full, x = framed(data, dtype, PAD, pad_rows=1, pad_cols=5 + block)
        w_full, w = framed(rng.uniform(0.5, 2.0, cols) * rng.choice([-1.0, 1.0], cols), dtype, NAN)
        y_full, y = framed(np.full((rows, cols), POISON), dtype, POISON, pad_rows=1, pad_cols=3 + block)
        what = f"{rows}x{cols} {dtype} (BLOCK {block})"
        if not launch(report, what, rms_norm_kernel, (rows,), x, w, y, cols, x.stride(0), y.stride(0), eps,
                      BLOCK=block):
            return
        if outside_writes(POISON, y_full, data_mask(y_full.shape, rows, cols)):
            return report.fail(f"{what}: wrote outside y (a column >= n_cols, or the wrong row): mask the store with "
                               "cols < n_cols and start row i at y_ptr + i * stride_y")
        got, xs, ws = host(y), exact(x), exact(w)
        if nothing_written(got):
            return report.fail(f"{what}: {STUB}")
        truth = rms_norm64(xs, ws, eps)
        xr = x.float() if dtype == "fp16" else x
        reference = host((xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype))
        hxf = exact(x_full).ravel()

        def mistakes(i):
            row = xs[i]
            ms = (row * row).mean()
            past = (block - cols) * PAD * PAD  # what an unmasked load adds to the sum of squares
            return [
                ("mask the load (cols < n_cols, other=0.0): the row's block reads past its end",
                 row / np.sqrt(((row * row).sum() + past) / cols + eps) * ws),
                ("rows of x are stride_x elements apart, not n_cols: start row i at x_ptr + i * stride_x",
                 rms_norm64(hxf[i * cols: i * cols + cols], ws, eps)),
                ("divide the sum of squares by n_cols, not BLOCK: padding is not part of the row",
                 row / np.sqrt((row * row).sum() / block + eps) * ws),
                ("add eps inside the square root: rsqrt(mean(x * x) + eps)", row / np.sqrt(ms) * ws),
                ("eps goes inside the square root, not after it", row / (np.sqrt(ms) + eps) * ws),
                ("multiply by the weight w", row / np.sqrt(ms + eps)),
                (own_eps_hint(eps), row / np.sqrt(ms + USUAL_EPS) * ws),
                *([("x * x overflows float16 for |x| > 256: compute the statistics in float32 (x.to(tl.float32))",
                    np.zeros_like(row))] if dtype == "fp16" and np.abs(row).max() > 256 else []),
                ("that is LayerNorm; RMSNorm does not subtract the mean",
                 (row - row.mean()) / np.sqrt(((row - row.mean()) ** 2).mean() + eps) * ws),
            ]

        passed, line = compare_rows(got, truth, reference, what, mistakes, nonfinite=(
            "x * x overflows float16 for |x| > 256: compute the statistics in float32 (x.to(tl.float32)); and mask "
            "the load, so that NaN from past the row cannot get in"))
        if not passed and "never written" in line:
            line += (f": one program covers a whole row with tl.arange(0, BLOCK); use the BLOCK the launch passes "
                     f"(here {block}: the grader varies it), not a number of your own")
        if not report.expect(passed, line, line):
            return


# ---- 04.5 RMSNorm on many short rows (graded on speed on a GPU) ------------------------------------

SHORT_ROWS_SHAPE = (1 << 20, 128)  # fp16: one RMSNorm per attention head of every token (QK-norm)
SHORT_ROWS_AT_LEAST = 0.6          # of a device-to-device copy of as many bytes, timed in the same run


@exercise("04.5", "RMSNorm on many short rows", names=("rms_norm_rows",))
@in_float32
def grade_rms_norm_rows(report: Report, rms_norm_rows):
    import torch

    if not callable(rms_norm_rows) or hasattr(rms_norm_rows, "__getitem__"):
        return report.fail("rms_norm_rows should be a plain Python function that launches your kernel and "
                           "returns y, not the kernel itself")
    dev = "cuda" if world().gpu else "cpu"
    rng = fresh_rng(report)
    eps = draw_eps(rng)  # never the 1e-5 a kernel might write in: it must use its argument
    # (rows, cols, dtype, x's rows further apart than n_cols): x is sometimes a view into a wider tensor (the
    # heads of a fused projection), whose rows are stride_x apart
    cases = sizes([(1, 1, "fp32", False), (37, 128, "fp32", False), (130, 64, "fp16", False), (19, 100, "fp16", False),
                   (5, 700, "fp32", False), (int(rng.integers(20, 140)), 64, "fp16", True),
                   (int(rng.integers(3, 40)), int(rng.integers(2, 300)), "fp32", True)],
                  [(100_003, 128, "fp16", False), (4099, 96, "fp32", False), (30_001, 128, "fp16", True)])
    for rows, cols, dtype, strided in cases:
        data = rand(rng, (rows, cols))
        data[0] *= 2e-3  # tiny values: eps matters here
        if rows > 2:
            data[2] *= 300.0  # x * x overflows float16 (above 65504): statistics belong in float32
        if strided:
            wide = torch.from_numpy(rand(rng, (rows, 3 * cols))).to(torch_dtype(dtype)).to(dev)
            x = wide[:, cols:2 * cols]  # the middle third of each row, like k out of a fused qkv
            x.copy_(torch.from_numpy(data).to(x.dtype))
        else:
            x = torch.from_numpy(data).to(torch_dtype(dtype)).to(dev)
        w = torch.from_numpy(rng.uniform(0.5, 2.0, cols) * rng.choice([-1.0, 1.0], cols)).to(x.dtype).to(dev)
        what = f"{rows}x{cols} {dtype}" + (f", rows {x.stride(0)} elements apart" if strided else "")
        try:
            y = rms_norm_rows(x, w, eps)
            if world().gpu:
                torch.cuda.synchronize()
        except Exception as exc:
            return report.fail(f"{what}: {explain(exc)}")
        if not isinstance(y, torch.Tensor):
            return report.fail(f"{what}: rms_norm_rows returned {type(y).__name__}, not the tensor y")
        if y.dtype != x.dtype:
            return report.fail(f"{what}: y is {y.dtype}, x is {x.dtype}: allocate y with x's dtype "
                               "(torch.empty_like(x)); the statistics are float32 inside the kernel only")
        xs, ws = exact(x), exact(w)
        truth = rms_norm64(xs, ws, eps)
        xr = x.float()
        reference = host((xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype))
        got = host(y)
        if got.shape == truth.shape and strided and np.isfinite(got).all():
            flat = exact(wide).ravel()  # the rows a kernel reading x as packed (row stride n_cols) gets
            packed = flat[cols + np.arange(rows)[:, None] * cols + np.arange(cols)[None, :]]
            wrong = rms_norm64(packed, ws, eps)
            if not compare_rows(got, truth, reference, what)[0] and \
                    np.abs(got.astype(np.float64) - wrong).max() < np.abs(got.astype(np.float64) - truth).max():
                return report.fail(f"{what}: the rows were read as if packed, n_cols apart: here x is a view "
                                   f"whose rows are x.stride(0) = {x.stride(0)} elements apart; pass x.stride(0) "
                                   "as stride_x and address row r at x_ptr + r * stride_x")
        passed, line = compare_rows(got, truth, reference, what, nonfinite=(
            "x * x overflows float16 for |x| > 256: compute the statistics in float32 (x.to(tl.float32))"))
        if not passed and got.shape == truth.shape and (short := _first_columns_only(got, xs, ws, eps)):
            return report.fail(f"{what}: only the first {short} values of each row were normalised (a BLOCK "
                               f"of {short}, whatever n_cols is): choose BLOCK from n_cols, "
                               "triton.next_power_of_2(n_cols), so that a tile row covers the whole row; the "
                               "grader's rows are not all 64 or 128 wide")
        if not passed and got.shape == truth.shape and np.allclose(got.astype(np.float64), rms_norm64(xs, ws, USUAL_EPS),
                                                                    rtol=1e-2, atol=1e-3):
            line += f": {own_eps_hint(eps)}"
        elif not passed and got.shape == truth.shape:
            done = np.isclose(got.astype(np.float64), truth, rtol=1e-2, atol=1e-3).all(axis=1)
            if done.any() and not done.all():
                first = int(np.flatnonzero(~done)[0])
                line += (f" (rows from {first} on are wrong: with several rows per program, the grid needs "
                         "cdiv(n_rows, ROWS) programs and the last program's rows past n_rows must be masked)")
        if not report.expect(passed, line, line):
            return

    rows, cols = SHORT_ROWS_SHAPE
    what = f"{rows}x{cols} fp16 (x read, y written: {2 * rows * cols * 2 / 1e6:.0f} MB)"
    if not world().gpu:
        report.not_graded(f"{what} at {SHORT_ROWS_AT_LEAST:.0%} of a copy's bandwidth: speed needs a GPU "
                          "(not graded here)")
        return
    from . import speed_vs_roof

    x = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
    w = torch.rand(cols, device="cuda", dtype=torch.float16) + 0.5
    y = rms_norm_rows(x, w, eps)
    xr = x.float()
    want = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * w.float()).half()
    if not torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2):
        return report.fail(f"{what}: the result is wrong at this size, so its speed is not graded")
    speed_vs_roof(report, what, lambda: rms_norm_rows(x, w, eps), 2 * x.nbytes + w.nbytes, SHORT_ROWS_AT_LEAST)


def _first_columns_only(got, xs, ws, eps) -> int | None:
    """The power of two c < n_cols such that each row of ``got`` begins with RMSNorm of its first c values
    only (their sum of squares divided by n_cols or by c): what a launcher that fixes BLOCK at c computes,
    whatever it leaves in the columns after; None if there is none."""
    cols = xs.shape[1]
    out = got.astype(np.float64)
    for c in (16, 32, 64, 128, 256, 512, 1024):
        if c >= cols:
            break
        head = xs[:, :c]
        for over in (cols, c):
            want = head / np.sqrt((head * head).sum(axis=1, keepdims=True) / over + eps) * ws[:c]
            if np.allclose(out[:, :c], want, rtol=1e-2, atol=1e-3):
                return c
    return None


# ---- 04.6 fused GroupNorm + SiLU -------------------------------------------------------------------


def group_norm_silu64(x, w, b, n_groups, eps, denominator=None, silu_first=False, weight_channel=None,
                      interleaved=False):
    """silu(group_norm(x) * w + b) for x of shape (B, C, HW), in float64; the keyword arguments make the
    typical mistakes: ``denominator(n)`` for the variance, SiLU before the affine, the channel each weight
    is read at (``weight_channel(c)``), groups made of every n_groups-th channel."""
    B, C, HW = x.shape
    per = C // n_groups
    ch = np.arange(C)
    group_of = ch % n_groups if interleaved else ch // per
    out = np.empty_like(x)
    for g in range(n_groups):
        sel = group_of == g
        v = x[:, sel, :]                                   # (B, per, HW)
        n = v[0].size
        mean = v.mean(axis=(1, 2), keepdims=True)
        var = ((v - mean) ** 2).sum(axis=(1, 2), keepdims=True) / (denominator(n) if denominator else n)
        out[:, sel, :] = (v - mean) / np.sqrt(var + eps)
    wc = ch if weight_channel is None else weight_channel(ch)
    ww, bb = w[wc][None, :, None], b[wc][None, :, None]
    if silu_first:
        s = out / (1.0 + np.exp(-out))
        return s * ww + bb
    z = out * ww + bb
    return z / (1.0 + np.exp(-z))


def _gn_unmasked64(x_flat_full, w, b, shape, n_groups, eps, block):
    """What a kernel whose loads are not masked computes: each group's statistics also take the values
    past its end, up to the next multiple of BLOCK (the next group's, or the frame after x)."""
    B, C, HW = shape
    per = C // n_groups
    n = per * HW
    padded = -(-n // block) * block
    out = np.empty((B * n_groups, n))
    for p in range(B * n_groups):
        run = x_flat_full[p * n: p * n + padded]
        mean = run.sum() / n
        var = max(((run * run).sum() / n - mean * mean), 0.0)
        out[p] = (x_flat_full[p * n: p * n + n] - mean) / np.sqrt(var + eps)
    out = out.reshape(B, C, HW)
    z = out * w[None, :, None] + b[None, :, None]
    return z / (1.0 + np.exp(-z))


GN_BLOCKS_TRIED = (64, 128, 256, 512, 1024)


@exercise("04.6", "fused GroupNorm + SiLU", names=("group_norm_silu_kernel",))
@in_float32
def grade_group_norm_silu(report: Report, group_norm_silu_kernel):
    import torch

    from ..kernels import group_norm_silu_ref

    if (msg := not_a_kernel(group_norm_silu_kernel, "group_norm_silu_kernel")):
        return report.fail(msg)
    # (B, C, H, W, groups, dtype, mean offset of the groups, the BLOCKs it is launched with):
    # C / groups * H * W is a multiple of no block, H * W is odd in two cases; the fp16 case has a mean of
    # about 100, so that float16 sums overflow (its sum of squares passes 65,504 after a few elements)
    cases = sizes([(2, 6, 5, 7, 3, "fp32", 2.0, (64, 256)), (1, 10, 9, 11, 5, "fp32", 2.0, (128, 64)),
                   (3, 4, 1, 1, 4, "fp32", 2.0, (64,)), (2, 8, 16, 17, 2, "fp16", 100.0, (1024, 256))],
                  [(2, 320, 64, 64, 32, "fp16", 100.0, (1024, 4096)), (8, 1280, 16, 16, 32, "fp16", 4.0, (2048,))])
    rng = fresh_rng(report)  # values drawn fresh on every run
    eps = draw_eps(rng)  # never the 1e-5 a kernel might write in: it must use its argument
    for B, C, H, W, G, dtype, offset, blocks in cases:
        HW = H * W
        data = rand(rng, (B, C, HW)) + np.repeat(rng.uniform(-offset, offset, (B, G)), C // G, axis=1)[:, :, None]
        x_full, x = framed(data.ravel(), dtype, PAD)
        _, w = framed(rng.uniform(0.5, 1.5, C) * rng.choice([-1.0, 1.0], C), dtype, NAN)
        _, b = framed(rng.uniform(-1.0, 1.0, C), dtype, NAN)
        xs, ws, bs = exact(x).reshape(B, C, HW), exact(w), exact(b)
        truth = group_norm_silu64(xs, ws, bs, G, eps).ravel()
        xt = x.reshape(B, C, H, W)
        if x.dtype == torch.float16 and not world().gpu:  # eager fp16 GroupNorm on the CPU: through float32
            reference = host(group_norm_silu_ref(xt.float(), G, w.float(), b.float(), eps).half()).ravel()
        else:
            reference = host(group_norm_silu_ref(xt, G, w, b, eps)).ravel()
        for block in blocks:
            n = C // G * HW
            y_full, y = framed(np.full(B * C * HW, POISON), dtype, POISON)
            what = f"({B}, {C}, {H}, {W}) {dtype}, {G} groups of {n} value(s), BLOCK {block}"
            if not launch(report, what, group_norm_silu_kernel, (B * G,), x, w, b, y, C, HW, G, eps, BLOCK=block):
                return
            if outside_writes(POISON, y_full, data_mask(y_full.shape, y.numel())):
                return report.fail(f"{what}: wrote past the end of y: the group's last chunk runs past its "
                                   f"{n} values; mask the store with offs < n")
            got = host(y)
            if nothing_written(got):
                return report.fail(f"{what}: {STUB}; if it is written, its loops never ran: a group holds "
                                   f"n = C // n_groups * HW values, with the C, HW and n_groups the launch passes "
                                   f"(here {C}, {HW} and {G}: the grader varies them), not numbers of your own")
            passed, line = compare(got, truth, reference, what=what, rtol_floor=rounding_floor(got.dtype))
            if not passed:
                tol = tolerance(truth, reference, got.dtype)
                per = C // G
                mistakes = [
                    ("the variance divides by n - 1; GroupNorm's divides by n, the number of values in the group",
                     group_norm_silu64(xs, ws, bs, G, eps, denominator=lambda m: m - 1).ravel()),
                    ("the statistics count the padding past n: divide by n, and keep masked lanes out of the sums "
                     "(tl.where(mask, v, 0.0), or other=0.0 and no shift on padding)",
                     group_norm_silu64(xs, ws, bs, G, eps, denominator=lambda m: -(-m // block) * block).ravel()),
                    (own_eps_hint(eps), group_norm_silu64(xs, ws, bs, G, USUAL_EPS).ravel()),
                    ("SiLU comes after the affine: silu(x_hat * w + b), not silu(x_hat) * w + b",
                     group_norm_silu64(xs, ws, bs, G, eps, silu_first=True).ravel()),
                    ("w and b are indexed by the channel within the group; the channel is "
                     "group * (C // n_groups) + offs // HW",
                     group_norm_silu64(xs, ws, bs, G, eps, weight_channel=lambda c: c % per).ravel()),
                    ("a group is C // n_groups consecutive channels, not every n_groups-th channel",
                     group_norm_silu64(xs, ws, bs, G, eps, interleaved=True).ravel() if per > 1 and G > 1 else None),
                    ("the loads are not masked: the group's last chunk reads values past its end into the "
                     "statistics; mask with offs < n",
                     _gn_unmasked64(exact(x_full).ravel(), ws, bs, (B, C, HW), G, eps, block).ravel()
                     if n % block else None),
                ]
                hint = None if "never written" in line else diagnose(got, mistakes, tol, truth=truth)
                if hint is None and not np.isfinite(got.astype(np.float64)).all():
                    hint = ("NaN or Inf: with values near 100 in float16, the sums (and x * x, near 10^4) pass "
                            "float16's largest value 65,504: convert to float32 after loading and accumulate "
                            "in float32")
                if hint is None:
                    right_with = [blk for blk in GN_BLOCKS_TRIED if blk != block and _gn_passes(
                        group_norm_silu_kernel, B * G, x, w, b, C, HW, G, eps, blk, truth, reference, dtype)]
                    if right_with:
                        hint = (f"right with BLOCK={right_with[0]}, wrong with BLOCK={block}: use the BLOCK argument "
                                "everywhere (tl.arange(0, BLOCK), the loop's step), not a number")
                if hint is None and "never written" in line:
                    hint = ("each program owns one (batch, group), the n = C // n_groups * HW values from pid * n "
                            "on; loop over all of them, BLOCK at a time")
                if hint:
                    line += f": {hint}"
            if not report.expect(passed, line, line):
                return


def _gn_passes(kernel, programs, x, w, b, C, HW, G, eps, block, truth, reference, dtype) -> bool:
    """Whether the kernel's result is right when launched with another BLOCK (no line is recorded)."""
    _, y = framed(np.full(x.numel(), POISON), dtype, POISON)
    try:
        kernel[(programs,)](x, w, b, y, C, HW, G, eps, BLOCK=block)
    except Exception:  # noqa: BLE001
        return False
    return compare(host(y), truth, reference, what="", rtol_floor=rounding_floor(host(y).dtype))[0]
