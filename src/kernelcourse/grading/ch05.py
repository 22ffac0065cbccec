"""Graders for chapter 05, the tiled matmul (Triton's interpreter on the CPU, compiled on a GPU).

The kernel graders work like chapter 04's (see ``ch04``): they launch the learner's kernel on inputs
framed by NaN and outputs framed by poison, and compare with a float64 truth. The tolerance knows the
device: on a GPU, ``tl.dot`` on float32 inputs uses TF32 (10 bits of mantissa, not 23) unless told
``input_precision="ieee"``, so there the reference is a float64 matmul of the inputs cut to TF32; in
the interpreter ``tl.dot`` is exact float32, and so is the reference.
"""
from __future__ import annotations

import numpy as np

from ..world import world
from . import POISON, Report, call, compare, exercise, explain, fresh_rng
from .harness import (NAN, PAD, STUB, data_mask, diagnose, exact, framed, host, launch, not_a_kernel,
                   nothing_written, outside_writes, rand, rounding_floor, sizes, tolerance,
                   tolerance_of)

# ---- 05.1 which program computes a tile ------------------------------------------------------


def _row_major(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
    return pid_m * num_pid_n + pid_n


def _full_groups_only(pid_m, pid_n, num_pid_m, num_pid_n, group_m):  # every group assumed group_m rows tall
    group, row = divmod(pid_m, group_m)
    return group * group_m * num_pid_n + pid_n * group_m + row


@exercise("05.1", "which program computes a tile", names=("grouped_program",), time_limit_s=20)
def grade_grouped_program(report: Report, grouped_program):
    from ..kernels import grouped_tile

    # (num_pid_m, num_pid_n, group_m): square, a short last group, group taller than the grid, one row
    cases = [(4, 4, 2), (5, 3, 2), (7, 5, 3), (8, 8, 8), (3, 9, 4), (1, 6, 8), (6, 1, 4), (10, 7, 4)]
    rng = fresh_rng(report)  # and grids no statement shows, drawn fresh on every run
    cases += [(int(rng.integers(1, 13)), int(rng.integers(1, 13)), int(rng.integers(1, 9))) for _ in range(3)]
    mistakes = [(_row_major, "that is row-major order: in grouped order, programs walk down a group of group_m "
                             "tile rows, one column after another, before moving to the next group"),
                (_full_groups_only, "the last group can be shorter: it has min(num_pid_m - first_pid_m, group_m) "
                                    "rows, and its programs step through them in that many")]
    for num_pid_m, num_pid_n, group_m in cases:
        what = f"a {num_pid_m} x {num_pid_n} grid of tiles, group_m={group_m}"
        tiles = [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
        got = {}
        for m, n in tiles:
            asked = f"grouped_program({m}, {n}, {num_pid_m}, {num_pid_n}, {group_m})"
            pid = call(report, asked, grouped_program, m, n, num_pid_m, num_pid_n, group_m)
            if not isinstance(pid, (int, np.integer)):
                return report.fail(f"{asked} returned {pid!r}: a program id is an int")
            got[(m, n)] = int(pid)
        wrong = next(((t, p) for t, p in got.items()
                      if not 0 <= p < len(tiles) or grouped_tile(p, num_pid_m, num_pid_n, group_m) != t), None)
        if wrong is None:
            report.ok(f"{what}: every tile maps to the program that computes it")
            continue
        (m, n), pid = wrong
        want = next(p for p in range(len(tiles)) if grouped_tile(p, num_pid_m, num_pid_n, group_m) == (m, n))
        hint = next((h for fn, h in mistakes
                     if all(got[t] == fn(*t, num_pid_m, num_pid_n, group_m) for t in tiles)), None)
        if hint is None:
            hint = ("program ids run from 0 to num_pid_m * num_pid_n - 1" if not 0 <= pid < len(tiles) else
                    "the groups before this one hold first_pid_m * num_pid_n programs; within its group, the "
                    "tile is program pid_n * (rows in this group) + (pid_m - first_pid_m)")
        return report.fail(f"{what}: tile ({m}, {n}) is computed by program {want}, you said {pid}: {hint}")


# ---- matmul references -------------------------------------------------------------------------


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 values cut to TF32: the low 13 of the 23 mantissa bits set to zero."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def matmul_reference(a, b) -> np.ndarray:
    """What a matmul at the inputs' precision gives on this device, in float64 (the tolerance's base)."""
    import torch

    if world().gpu and a.dtype == torch.float32:
        return tf32(host(a)).astype(np.float64) @ tf32(host(b)).astype(np.float64)
    return host(a @ b).astype(np.float64)


def _operands(rng, M, N, K, bm, bn, bk, dtype, b_transposed, a_column_major=False, data=None):
    """A (M, K) and B (K, N) inside frames wide enough for a whole block past every edge; with
    ``a_column_major``, A is the transpose of a row-major (K, M) tensor (stride_am = 1). ``data``, when
    given, is the (A, B) to place (row-major B), else they are drawn.

    Past K the frame is NaN: a K step that reads there without a mask brings NaN into C. Past M and N
    it is finite: reading there only changes rows and columns of C that the masked store drops.
    """
    def place(data, k_axis, pad):
        full, view = framed(data, dtype, PAD, pad_rows=pad[0], pad_cols=pad[1])
        if k_axis == 1:
            full[:, data.shape[1]:] = float("nan")
        else:
            full[data.shape[0]:, :] = float("nan")
        return view

    if data is not None:
        return place(data[0], 1, (bm, bk + 3)), place(data[1], 0, (bk, bn + 3))
    a = place(rand(rng, (K, M)), 0, (bk, bm + 3)).t() if a_column_major else place(rand(rng, (M, K)), 1, (bm, bk + 3))
    if b_transposed:  # B is the transpose of a row-major (N, K) tensor: stride_bk = 1
        b = place(rand(rng, (N, K)), 1, (bn, bk + 3)).t()
    else:
        b = place(rand(rng, (K, N)), 0, (bk, bn + 3))
    return a, b


def _k_mistakes(A, B, K, bk):
    """Typical K-loop mistakes, as float64 results."""
    kf = (K // bk) * bk
    steps = -(-K // bk)
    first = sum(A[:, :min(bk, K - s * bk)] @ B[:min(bk, K - s * bk), :] for s in range(steps))
    last = A[:, (steps - 1) * bk:] @ B[(steps - 1) * bk:, :]
    out = [("the last, partial K step is missing: loop over tl.cdiv(K, BLOCK_K) steps, and mask it", A[:, :kf] @ B[:kf, :])]
    if steps > 1:
        out += [("every step multiplied the first K block again: advance a_ptrs by BLOCK_K * stride_ak and b_ptrs "
                 "by BLOCK_K * stride_bk after each step", first),
                ("only the last step's product is left: add each step to the accumulator, acc = tl.dot(a, b, acc)",
                 last)]
    return out


def _tile_hint(got, M, N, bm, bn) -> str | None:
    """The hint for a kernel whose programs compute tiles of a size of their own, not the BLOCK_M x BLOCK_N the
    launch passes: the elements written are the rows below some R and the columns below some C, one block of
    R / (programs down) x C / (programs across) per program, short of M or N."""
    written = got != np.asarray(POISON, dtype=got.dtype)
    rows, cols = written.any(axis=1), written.any(axis=0)
    R, C = int(rows.sum()), int(cols.sum())
    gm, gn = -(-M // bm), -(-N // bn)
    if (R, C) == (M, N) or not (rows[:R].all() and cols[:C].all()) or (written != np.outer(rows, cols)).any():
        return None
    if not ((R == M or R % gm == 0) and (C == N or C % gn == 0)):
        return None
    return (f"only the rows below {R} and the columns below {C} were written: each program computes the "
            f"BLOCK_M x BLOCK_N tile the launch passes (here {bm} x {bn}); build offs_m, offs_n and the "
            "accumulator from BLOCK_M and BLOCK_N, never from a tile size of your own")


ACCUMULATOR_HINT = ("this is what a float16 accumulator gives: accumulate in float32, acc = tl.zeros((BLOCK_M, "
                    "BLOCK_N), dtype=tl.float32) and acc = tl.dot(a, b, acc) (tl.dot's float32 out_dtype), and "
                    "convert to C's dtype only at the store")


def _lossy_fp16(rng, M, N, K, bk):
    """fp16 A (M, K) and B (K, N) whose sums hold one large product, 32 x 32 = 1024, in the first K step; the
    rest are small and positive, so the sum stays between 1024 and 2048, where float16 values are 1 apart.
    Every later K step adds 0.23 to 0.46, less than half of that: a float32 accumulator keeps these
    additions (K / BLOCK_K - 1 of them), a float16 accumulator rounds every one of them away."""
    a = rng.uniform(0.12, 0.17, (M, K))
    b = rng.uniform(0.12, 0.17, (K, N))
    first = rng.integers(0, bk, size=M)  # where each row's large product lies, in the first step
    a[np.arange(M), first] = 32.0
    b[first, :] = 32.0  # (a row also meets the 32s of other rows' columns: 0.17 x 32 at most, in the first step)
    return a, b


# ---- 05.2 the K loop ---------------------------------------------------------------------------

LOSSY = "a large product, then small ones"


@exercise("05.2", "matmul: the K loop with masks", names=("matmul_kernel",))
def grade_matmul(report: Report, matmul_kernel):
    if (msg := not_a_kernel(matmul_kernel, "matmul_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    blocks = [int(rng.choice([16, 32, 64])) for _ in range(3)]  # tiles no statement shows, drawn on each run
    # (M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, dtype, B transposed, layout of A and C): K is rarely a multiple of
    # BLOCK_K; A is sometimes column-major (stride_ak is not 1), C sometimes transposed (stride_cn is not 1).
    # The accumulator shows in two cases: fp16 A and B with a float32 C (any float16 rounding on the way shows
    # there), and fp16 values whose sum a float16 accumulator cannot hold (LOSSY: see _lossy_fp16); the
    # first of them has 64 x 64 tiles, larger than a tile size a kernel might write in for 16 or 32.
    cases = sizes([(16, 16, 16, 16, 16, 16, "fp32", False, ""), (37, 53, 45, 16, 32, 16, "fp16", False, ""),
                   (64, 70, 100, 32, 32, 32, "fp32", True, ""), (20, 33, 130, 16, 16, 64, "fp16", False, ""),
                   (29, 41, 37, 16, 16, 16, "fp32", False, "A column-major"),
                   (33, 19, 50, 16, 32, 16, "fp16", True, "C transposed"),
                   (70, 90, 60, 64, 64, 16, "fp16/fp32", False, ""), (20, 24, 480, 16, 16, 16, "fp16", False, LOSSY),
                   (int(rng.integers(20, 90)), int(rng.integers(20, 90)), int(rng.integers(20, 150)), *blocks, "fp32",
                    bool(rng.integers(2)), str(rng.choice(["", "A column-major", "C transposed"])))],
                  [(1000, 1003, 517, 64, 64, 32, "fp16", False, ""), (257, 300, 200, 32, 64, 32, "fp32", True, ""),
                   (513, 260, 300, 64, 32, 32, "fp16", False, "A column-major"),
                   (300, 513, 260, 32, 64, 64, "fp16", True, "C transposed")])
    for M, N, K, bm, bn, bk, dtype, bt, layout in cases:
        dtype, c_dtype = (dtype.split("/") + [dtype])[:2]  # "fp16/fp32": fp16 A and B, a float32 C
        data = _lossy_fp16(rng, M, N, K, bk) if layout == LOSSY else None
        a, b = _operands(rng, M, N, K, bm, bn, bk, dtype, bt, a_column_major=layout == "A column-major", data=data)
        if layout == "C transposed":  # C is the transpose of a row-major (N, M) tensor: stride_cm = 1
            c_full, c = framed(np.full((N, M), POISON), c_dtype, POISON, pad_rows=bn, pad_cols=bm + 3)
            c = c.t()
        else:
            c_full, c = framed(np.full((M, N), POISON), c_dtype, POISON, pad_rows=bm, pad_cols=bn + 3)
        grid = (-(-M // bm), -(-N // bn))
        what = (f"({M}x{K}) @ ({K}x{N}) {dtype}{f' A and B, {c_dtype} C' if c_dtype != dtype else ''}"
                f"{', B transposed' if bt else ''}{', ' + layout if layout else ''}, BLOCK_M/N/K = {bm}/{bn}/{bk}")
        if not launch(report, what, matmul_kernel, grid, a, b, c, M, N, K, a.stride(0), a.stride(1),
                      b.stride(0), b.stride(1), c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk):
            return
        inside = data_mask(c_full.shape, N, M) if layout == "C transposed" else data_mask(c_full.shape, M, N)
        if outside_writes(POISON, c_full, inside):
            return report.fail(f"{what}: wrote outside C: mask the store with offs_m[:, None] < M and "
                               "offs_n[None, :] < N, and use stride_cm and stride_cn for C" +
                               (f" (here C is a transposed view, stride_cm = {c.stride(0)}, stride_cn = {c.stride(1)}: "
                                "never assume a stride of 1)" if layout == "C transposed" else ""))
        got, A, B = host(c), exact(a), exact(b)
        if nothing_written(got):
            return report.fail(f"{what}: {STUB}")
        truth = A @ B
        floor = rounding_floor(got.dtype)
        if c_dtype != dtype:  # a float32 sum of exact fp16 products: float32's own rounding over K terms (x 4: a
            # GPU's tensor cores truncate, in an order of their own), far below one float16 rounding step
            reference = matmul_reference(a.float(), b.float())
            floor = max(floor, 4 * K * float(np.finfo(np.float32).eps))
        elif layout == LOSSY:  # the truth rounded to C's dtype: what a float32 accumulator gives
            reference = truth.astype(got.dtype).astype(np.float64)
        else:
            reference = matmul_reference(a, b)
        passed, line = compare(got, truth, reference, what=what, rtol_floor=floor)
        layout_hint = {"A column-major": f"here A is column-major (stride_am = {a.stride(0)}, stride_ak = "
                                         f"{a.stride(1)}): address A as offs_m * stride_am + offs_k * stride_ak, "
                                         "and never assume a stride of 1",
                       "C transposed": f"here C is a transposed view (stride_cm = {c.stride(0)}, stride_cn = "
                                       f"{c.stride(1)}): store at offs_m * stride_cm + offs_n * stride_cn, and "
                                       "never assume a stride of 1"}.get(layout)
        tile_hint = _tile_hint(got, M, N, bm, bn) if not passed and "never written" in line else None
        if tile_hint or (not passed and "never written" in line and layout_hint):
            line += f": {tile_hint or layout_hint}"
        if not passed and "never written" not in line and "stub" not in line:
            hint = diagnose(got, _k_mistakes(A, B, K, bk), tolerance_of(truth, reference, floor))
            if hint is None and (c_dtype != dtype or layout == LOSSY) and np.isfinite(got).all():
                hint = ACCUMULATOR_HINT
            if hint is None and layout_hint:
                hint = layout_hint
            if hint is None and np.isnan(got.astype(np.float64)).any():
                hint = (("the last K step reads past K (NaN is what lies past the data here): mask the loads with "
                         "offs_k < K - k * BLOCK_K and other=0.0") if K % bk else
                        "NaN came from memory outside A or B: check the strides and the masks of the loads")
            if hint is None:
                hint = ("check the strides: rows of A are stride_am apart and rows of B stride_bk apart (here "
                        "neither is K or N: the tensors are views, and B is sometimes transposed); advance by "
                        "BLOCK_K * stride_ak and BLOCK_K * stride_bk")
            if hint:
                line += f": {hint}"
        if not report.expect(passed, line, line):
            return


# ---- 05.3 a fused epilogue: bias + leaky ReLU --------------------------------------------------


def leaky64(x):
    return np.where(x >= 0, x, 0.01 * x)


@exercise("05.3", "a fused epilogue: bias + leaky ReLU", names=("linear_leaky_relu_kernel",))
def grade_epilogue(report: Report, linear_leaky_relu_kernel):
    import torch
    import torch.nn.functional as F

    if (msg := not_a_kernel(linear_leaky_relu_kernel, "linear_leaky_relu_kernel")):
        return report.fail(msg)
    rng = fresh_rng(report)
    blocks = [int(rng.choice([16, 32, 64])) for _ in range(3)]  # tiles no statement shows, drawn on each run
    # the last fields: A column-major (stride_ak is not 1) or C transposed (stride_cn is not 1); one case has
    # 64 x 64 tiles, larger than a tile size a kernel might write in for 16 or 32
    cases = sizes([(37, 53, 45, 16, 32, 16, "fp32", ""), (20, 70, 50, 16, 32, 16, "fp16", ""),
                   (64, 40, 32, 32, 16, 32, "fp32", ""), (30, 45, 40, 16, 16, 16, "fp32", "A column-major"),
                   (45, 30, 40, 16, 16, 32, "fp16", "C transposed"), (70, 90, 40, 64, 64, 16, "fp16", ""),
                   (int(rng.integers(20, 90)), int(rng.integers(20, 90)), int(rng.integers(20, 150)), *blocks, "fp32",
                    str(rng.choice(["", "A column-major", "C transposed"])))],
                  [(1000, 1003, 517, 64, 64, 32, "fp16", ""), (257, 300, 200, 32, 64, 32, "fp32", ""),
                   (513, 260, 300, 64, 32, 32, "fp16", "A column-major"), (300, 513, 260, 32, 64, 64, "fp16", "C transposed")])
    for M, N, K, bm, bn, bk, dtype, layout in cases:
        a, w = _operands(rng, M, N, K, bm, bn, bk, dtype, False, a_column_major=layout == "A column-major")
        bias_full, bias = framed(rand(rng, N) * 3.0, dtype, NAN)
        if layout == "C transposed":  # C is the transpose of a row-major (N, M) tensor: stride_cm = 1
            c_full, c = framed(np.full((N, M), POISON), dtype, POISON, pad_rows=bn, pad_cols=bm + 3)
            c = c.t()
        else:
            c_full, c = framed(np.full((M, N), POISON), dtype, POISON, pad_rows=bm, pad_cols=bn + 3)
        grid = (-(-M // bm), -(-N // bn))
        what = f"({M}x{K}) @ ({K}x{N}) + bias, {dtype}{', ' + layout if layout else ''}, BLOCK_M/N/K = {bm}/{bn}/{bk}"
        stride_hint = (f" (here A is column-major: stride_am = {a.stride(0)}, stride_ak = {a.stride(1)}; never assume "
                       "a stride of 1)" if layout == "A column-major" else
                       f" (here C is a transposed view: stride_cm = {c.stride(0)}, stride_cn = {c.stride(1)}; never "
                       "assume a stride of 1)" if layout == "C transposed" else "")
        if not launch(report, what, linear_leaky_relu_kernel, grid, a, w, bias, c, M, N, K, a.stride(0), a.stride(1),
                      w.stride(0), w.stride(1), c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk):
            return
        inside = data_mask(c_full.shape, N, M) if layout == "C transposed" else data_mask(c_full.shape, M, N)
        if outside_writes(POISON, c_full, inside):
            return report.fail(f"{what}: wrote outside C: keep the masked store the exercise gives{stride_hint}")
        got, A, W, bs = host(c), exact(a), exact(w), exact(bias)
        mm = A @ W
        truth = leaky64(mm + bs[None, :])
        ref_mm = torch.from_numpy(matmul_reference(a, w)).to(a.dtype).to(a.device)
        reference = host(F.leaky_relu(ref_mm + bias[None, :], 0.01)).astype(np.float64)
        passed, line = compare(got, truth, reference, what=what, rtol_floor=rounding_floor(got.dtype))
        tile_hint = _tile_hint(got, M, N, bm, bn) if not passed and "never written" in line else None
        if tile_hint:
            line += f": {tile_hint}"
        elif not passed and "never written" not in line:
            mistakes = [("that is a @ w alone: add the bias and apply leaky ReLU to acc before the store", mm),
                        ("that is a @ w + bias: now apply leaky ReLU, x if x >= 0 else 0.01 x", mm + bs[None, :]),
                        ("leaky ReLU keeps 0.01 x for negative x, not 0", np.maximum(mm + bs[None, :], 0.0)),
                        ("add the bias before the activation", leaky64(mm) + bs[None, :]),
                        ("leaky ReLU without the bias: load the bias (one value per column) and add it",
                         leaky64(mm))]
            if M <= N:
                mistakes.append(("the bias has one value per column: load it at offs_n and broadcast it over the "
                                 "rows, bias[None, :]", leaky64(mm + bs[:M, None])))
            hint = diagnose(got, mistakes, tolerance(truth, reference, got.dtype))
            if hint is None and np.isnan(got.astype(np.float64)).any():
                hint = ("NaN came from past the end of the bias: it has N values, one per column; load it at offs_n "
                        "with the mask offs_n < N")
            if hint is None and stride_hint:
                hint = "use the strides the launch passes" + stride_hint
            if hint:
                line += f": {hint}"
        elif not passed and stride_hint:
            line += ": use the strides the launch passes" + stride_hint
        if not report.expect(passed, line, line):
            return


# ---- 05.4 tiles for your GPU (graded on speed on a GPU) ---------------------------------------------

SPEED_MNK = 4096                # fp16, square: compute-bound on any GPU with tensor cores
SPEED_VS_CUBLAS = 0.5           # of torch.matmul (cuBLAS) timed in the same run
SPEED_VS_SGEMM = 0.5            # where tl.dot runs on CUDA cores (a T4): of cuBLAS's fp32 SGEMM, CUDA cores too
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _config_problem(config) -> str | None:
    if not isinstance(config, dict):
        return f"matmul_config is {type(config).__name__}: make it a dict with keys {', '.join(_CONFIG_KEYS)}"
    missing = [k for k in _CONFIG_KEYS if k not in config]
    if missing:
        return f"matmul_config has no {', '.join(missing)}: it needs {', '.join(_CONFIG_KEYS)}"
    extra = [k for k in config if k not in _CONFIG_KEYS]
    if extra:
        return f"matmul_config has keys the kernel does not take: {', '.join(map(str, extra))}"
    for k in _CONFIG_KEYS:
        v = config[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"matmul_config[{k!r}] is {v!r}: a positive whole number"
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if config[k] < 16 or config[k] & (config[k] - 1):
            return f"matmul_config[{k!r}] is {config[k]}: tl.dot needs a power of two, at least 16"
    if config["num_warps"] & (config["num_warps"] - 1) or config["num_warps"] > 16:
        return f"matmul_config['num_warps'] is {config['num_warps']}: a power of two, at most 16"
    return None


@exercise("05.4", "tiles for your GPU", names=("matmul_kernel", "matmul_config"))
def grade_matmul_config(report: Report, matmul_kernel, matmul_config):
    import torch

    if (msg := not_a_kernel(matmul_kernel, "matmul_kernel")):
        return report.fail(msg)
    if (msg := _config_problem(matmul_config)):
        return report.fail(msg)
    cfg = dict(matmul_config)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    shape_text = f"BLOCK_M/N/K = {bm}/{bn}/{bk}, {cfg['num_warps']} warps, {cfg['num_stages']} stages"

    def run(a, b, c):
        M, K = a.shape
        N = b.shape[1]
        grid = (-(-M // bm), -(-N // bn))
        return matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                   c.stride(0), c.stride(1), **meta)

    # the config must give right answers, tails included, before its speed counts
    for M, N, K in sizes([(bm + 3, bn - 5, 2 * bk + 7)], [(1000, 1003, 517)]):
        rng = np.random.default_rng(M + N + K)
        a, b = _operands(rng, M, N, K, bm, bn, bk, "fp16", False)
        c_full, c = framed(np.full((M, N), POISON), "fp16", POISON, pad_rows=bm, pad_cols=bn + 3)
        what = f"({M}x{K}) @ ({K}x{N}) fp16 with {shape_text}"
        try:
            run(a, b, c)
            if world().gpu:
                torch.cuda.synchronize()
        except Exception as exc:
            return report.fail(f"{what}: {explain(exc)}")
        if outside_writes(POISON, c_full, data_mask(c_full.shape, M, N)):
            return report.fail(f"{what}: wrote outside C (is matmul_kernel the one from exercise 05.2, masks and all?)")
        got, A, B = host(c), exact(a), exact(b)
        truth, reference = A @ B, matmul_reference(a, b)
        passed, line = compare(got, truth, reference, what=what, rtol_floor=rounding_floor(got.dtype))
        if not passed and "never written" not in line and "stub" not in line:  # K % BLOCK_K is 7: a tail to miss
            hint = diagnose(got, _k_mistakes(A, B, K, bk), tolerance(truth, reference, got.dtype))
            line += f": {hint}" if hint else ""
        if not report.expect(passed, line, line + " (matmul_kernel is exercise 05.2's: pass its grader first)"):
            return

    n = SPEED_MNK
    what = f"{n}x{n}x{n} fp16 with {shape_text}"
    if not world().gpu:
        report.not_graded(f"{what} at {SPEED_VS_CUBLAS:g}x cuBLAS: speed needs a GPU (not graded here)")
        return
    from . import speed_vs_peer

    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    try:  # aligned operands compile to another kernel, pipelined through shared memory: it may not fit
        compiled = run(a, b, c)
        torch.cuda.synchronize()
    except Exception as exc:
        return report.fail(f"{what}: {explain(exc)}")
    if not torch.allclose(c.float(), (a.float() @ b.float()), rtol=2e-2, atol=0.5):
        return report.fail(f"{what}: the result is wrong at this size, so its speed is not graded")
    from ..targets import speed_peer

    a32, b32 = a.float(), b.float()
    c32 = torch.empty_like(a32)

    def sgemm():  # float32 on CUDA cores: TF32 (tensor cores) off
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            torch.matmul(a32, b32, out=c32)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    # the peer runs on the unit the compiler gave the learner's tl.dot on this GPU (kernelcourse.targets)
    peer_name, peer, at_least, why = speed_peer(
        compiled, tensor_cores=("cuBLAS (torch.matmul)", lambda: torch.matmul(a, b, out=c), SPEED_VS_CUBLAS),
        cuda_cores=("cuBLAS's fp32 SGEMM (torch.matmul on float32 copies, TF32 off)", sgemm, SPEED_VS_SGEMM))
    # why: on CUDA cores, why the peer is (said on the line); on tensor cores, a kernel without tl.dot (a hint).
    # library_peer: cuBLAS was built ahead of time, and DISABLE_MMA_V3 leaves it be
    speed_vs_peer(report, what + (f" ({why})" if why and peer is sgemm else ""), lambda: run(a, b, c), peer,
                  peer_name, at_least, hint=why if why and peer is not sgemm else None, library_peer=True)
