"""Graders for chapter 01, CUDA vector add (numba.cuda kernels: simulator on CPU, real on a GPU)."""
from __future__ import annotations

import numpy as np

from ..world import world
from . import POISON, Report, call, compare, exercise, explain, fresh_rng, number, poisoned
from .harness import sizes

GUARD = 64  # poisoned elements past the end of every output, to catch writes beyond n


def _rand(rng, shape):
    # Mixed signs and magnitudes, never zeros: an unwritten or misindexed element cannot hide.
    return (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3], size=shape)).astype(np.float32)


def _is_kernel(obj) -> str | None:
    if callable(obj) and not hasattr(obj, "__getitem__"):
        return "is a plain Python function: decorate it with @cuda.jit so it can be launched as kernel[grid, block](...)"
    return None


def _launch(kernel, grid, block, inputs, out_shape):
    """Copy inputs in, launch, copy the output back; the output is poisoned, with a poisoned guard after it."""
    from numba import cuda

    d_in = [cuda.to_device(a) for a in inputs]
    flat = poisoned(int(np.prod(out_shape)) + GUARD)
    d_flat = cuda.to_device(flat)
    d_out = d_flat[: flat.size - GUARD].reshape(out_shape) if len(out_shape) > 1 else d_flat[: flat.size - GUARD]
    kernel[grid, block](*d_in, d_out)
    cuda.synchronize()
    host = d_flat.copy_to_host()
    return host[: flat.size - GUARD].reshape(out_shape), host[flat.size - GUARD:]


def _oob_hint(exc: Exception, check: str = "if i < out.size:") -> str:
    if isinstance(exc, IndexError) or "out of bounds" in str(exc).lower():
        return f"{explain(exc)}; add the bounds check `{check}`"
    return explain(exc)


@exercise("01.1", "global index and bounds check", names=("add_kernel",))
def grade_add_kernel(report: Report, add_kernel):
    if (msg := _is_kernel(add_kernel)):
        return report.fail(f"add_kernel {msg}")
    rng = fresh_rng(report)  # values, and block sizes no statement shows, drawn fresh on every run
    for n in sizes([1, 1000, 4099], [1 << 20 | 3]):
        for seed in (0, 1):
            block = 128 if seed == 0 else int(rng.choice([32, 64, 256]))
            x, y = _rand(rng, n), _rand(rng, n)
            grid = (n + block - 1) // block
            what = f"n={n}, seed {seed} (grid {grid} x block {block})"
            try:
                out, guard = _launch(add_kernel, grid, block, [x, y], (n,))
            except Exception as exc:
                report.fail(f"{what}: {_oob_hint(exc)}")
                return
            if (guard != np.float32(POISON)).any():
                report.fail(f"{what}: wrote past the end of out (index >= {n}): add the bounds check `if i < out.size:`")
                return
            written = out != np.float32(POISON)
            if n > block and written[:block].all() and not written[block:].any():
                report.fail(f"{what}: only elements 0-{block - 1} were written: every block wrote the same "
                            "elements; the global index is cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x")
                return
            if not written.all() and block != 128:
                report.fail(f"{what}: {int((~written).sum())} of {n} elements never written: the grader launches "
                            f"blocks of {block} threads here; use cuda.blockDim.x (or cuda.grid(1)), not the 128 of "
                            "the example")
                return
            truth = x.astype(np.float64) + y.astype(np.float64)
            passed, line = compare(out, truth, x + y, what=what)
            if not passed:
                mistakes = [(x + x, "out[i] = x[i] + x[i]: add y[i], not x[i] twice"),
                            (y + y, "out[i] = y[i] + y[i]: add x[i], not y[i] twice"),
                            (x - y, "that is x - y: out[i] = x[i] + y[i]"), (x * y, "that is x * y: out[i] = x[i] + y[i]"),
                            (x, "out holds x alone: out[i] = x[i] + y[i]")]
                hint = next((h for wrong, h in mistakes if np.allclose(out, wrong, rtol=1e-6, atol=0)), None)
                line += f": {hint}" if hint else ""
            if not report.expect(passed, line, line):
                return


@exercise("01.2", "grid size for n elements", names=("grid_size",), time_limit_s=10)
def grade_grid_size(report: Report, grid_size):
    rng = fresh_rng(report)

    def block() -> int:
        return int(rng.choice([32, 64, 96, 128, 192, 256, 384, 512, 1000, 1024]))

    def blocks(low, high) -> int:
        return int(rng.integers(low, high))

    # Fresh every run, on both sides of every boundary: a partial last block first (floor division fails
    # it, a "+ 1" passes), then an exact multiple (a "+ 1" fails it), fewer elements than one block, a
    # block of one thread, and n past 2^53, where float division rounds.
    b = [block() for _ in range(5)]
    cases = [(blocks(2, 5000) * b[0] + int(rng.integers(1, b[0])), b[0]), (blocks(1, 5000) * b[1], b[1]),
             (int(rng.integers(1, b[2])), b[2]), (blocks(1, 5000) * b[3] - 1, b[3]), (blocks(1, 10**6), 1),
             ((1 << 53) + 2 * blocks(0, 10**6) + 1, 1), ((1 << 54) + b[4] * blocks(0, 10**6) + 1, b[4])]
    for n, block in cases:
        want = -(-n // block)
        got = call(report, f"grid_size({n}, {block})", grid_size, n, block)
        if not isinstance(got, (int, np.integer)):
            report.fail(f"grid_size({n}, {block}) returned {got!r} of type {type(got).__name__}: "
                        "a launch needs a whole number of blocks (an int)")
            return
        if got == want:
            report.ok(f"grid_size({n}, {block}) = {want}")
            continue
        if n > 1 << 52:  # checked first: here a rounded float is off by one either way
            hint = "float division rounds large n; use integer ceil-div (n + block - 1) // block"
        elif got == n // block:
            hint = "floor division drops the last, partial block"
        elif got == n // block + 1:
            hint = "one block too many when n is a multiple of the block size"
        else:
            hint = "the grid needs ceil(n / block) blocks"
        report.fail(f"grid_size({n}, {block}) returned {got}, expected {want}: {hint}")
        return


@exercise("01.3", "grid-stride loop", names=("axpy_kernel",))
def grade_axpy(report: Report, axpy_kernel):
    if (msg := _is_kernel(axpy_kernel)):
        return report.fail(f"axpy_kernel {msg}")
    from numba import cuda

    # (n, grid, block): fewer threads than elements, more threads than elements, exactly one wave; then blocks of
    # 16 threads, fewer than any block a kernel may take as its own (32, 64...). Such a kernel leaves elements
    # untouched there, on a GPU as in the simulator; where its threads overlap instead (blocks of 64), they race
    # on y[i] += ..., and a GPU may lose any of their updates, every one included, which leaves y right.
    cases = [(1000, 2, 32), (10, 4, 32), (4099, 3, 64), (2053, 5, 16)]
    cases += [(1 << 20 | 5, 132, 256)] if world().gpu else []
    rng = fresh_rng(report)  # a and the values drawn fresh on every run
    for n, grid, block in cases:
        a = np.float32(rng.uniform(0.5, 2.0))
        # |a * x| >= 0.25 while |y| <= 1e3 * a few: every update visibly changes y
        x = (rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
        y0 = _rand(rng, n)
        what = f"n={n} with {grid} x {block} threads"
        try:
            # x and y live at the front of larger buffers with guard tails: an update past n, y[n] += a * x[n],
            # turns y's guard value 7 into 7 + a, which shows (a poison value would absorb a small update)
            d_xfull = cuda.to_device(np.concatenate([x, np.ones(GUARD, np.float32)]))
            d_full = cuda.to_device(np.concatenate([y0, np.full(GUARD, 7.0, np.float32)]))
            axpy_kernel[grid, block](a, d_xfull[:n], d_full[:n])
            cuda.synchronize()
            full = d_full.copy_to_host()
            y, guard = full[:n], full[n:]
        except Exception as exc:
            report.fail(f"{what}: {_oob_hint(exc, 'for i in range(start, y.size, stride):')}")
            return
        if (guard != np.float32(7.0)).any():
            report.fail(f"{what}: wrote past the end of y (index >= {n}): the loop must run while i < y.size")
            return
        truth = y0.astype(np.float64) + np.float64(a) * x.astype(np.float64)
        own = _own_block(y, y0, a, x, grid, block)
        if own is not None:  # a block of its own written in: the first launches' 32...
            report.fail(f"{what}: this is what a kernel that takes blocks to be {own} threads computes: the "
                        f"grader launches blocks of {block} threads here; use cuda.blockDim.x (or cuda.grid(1) "
                        "and cuda.gridsize(1)), not a number of your own")
            return
        untouched = y == y0
        threads = grid * block
        if n > threads and untouched[threads:].all():
            report.fail(f"{what}: elements {threads}..{n - 1} were not updated: loop over "
                        "i, i + cuda.gridsize(1), ... until n")
            return
        if untouched.any():
            first = int(np.flatnonzero(untouched)[0])
            report.fail(f"{what}: {int(untouched.sum())} elements were not updated (first at index {first}): "
                        "the loop must run while i < y.size")
            return
        doubled = np.isclose(y, y0 + 2 * a * x, rtol=1e-5, atol=0) & ~np.isclose(y, truth, rtol=1e-5, atol=0)
        if doubled.any():
            report.fail(f"{what}: {int(doubled.sum())} elements were updated twice: the stride must be the whole "
                        "grid (cuda.gridsize(1)), so each element belongs to exactly one thread")
            return
        passed, line = compare(y, truth, y0 + a * x, what=what)
        if not passed and np.allclose(y, a * x, rtol=1e-6, atol=0):
            line += ": y holds a * x alone: add to it, y[i] += a * x[i] (y's old value is part of the result)"
        elif not passed and np.allclose(y, y0 + (c := float(np.median((y - y0) / x))) * x, rtol=1e-5, atol=0):
            line += (f": y[i] grew by {c:.4g} * x[i] where the launch passed a = {a:.4g}: use the argument a, not a "
                     "number of your own (the grader draws it on every run)")
        if not report.expect(passed, line, line):
            return


def _own_block(y, y0, a, x, grid: int, block: int) -> int | None:
    """The block size, among those a kernel might write in (32, 64, 128, 256), that a kernel taking it as its own
    computes ``y`` with under this launch, or None (also for the right result, each element updated once).

    Each element must have been updated a whole number of times: as often as such a kernel's threads reach it
    (``_updates_with_block``), or fewer, down to once, where several reach it: those threads race on
    y[i] += a * x[i], and on a GPU an update is lost when two read y[i] before either writes (numba's simulator
    never loses one). An element none reaches must be untouched."""
    ax = np.float64(a) * x.astype(np.float64)
    times = np.rint((y.astype(np.float64) - y0) / ax)
    if (np.abs(y - (y0 + times * ax)) > 1e-5 * (np.abs(y0) + times * np.abs(ax))).any():  # float32's rounding
        return None
    if (times == 1).all():  # the right result: every element updated once
        return None
    for own in (32, 64, 128, 256):
        if own != block:
            most = _updates_with_block(y.size, grid, block, own)
            if ((times <= most) & (times >= np.minimum(most, 1))).all():
                return own
    return None


def _updates_with_block(n: int, grid: int, block: int, own: int) -> np.ndarray:
    """How often each of ``n`` elements is updated by a grid-stride loop launched as ``grid`` x ``block`` threads
    whose kernel takes a block to be ``own`` threads (start blockIdx * own + threadIdx, stride own * gridDim)."""
    counts = np.zeros(n)
    for b in range(grid):
        for t in range(block):
            counts[b * own + t:n:own * grid] += 1
    return counts


@exercise("01.4", "2D matrix add", names=("matrix_add_kernel",))
def grade_matrix_add(report: Report, matrix_add_kernel):
    if (msg := _is_kernel(matrix_add_kernel)):
        return report.fail(f"matrix_add_kernel {msg}")
    rng = fresh_rng(report)  # values, and block shapes no statement shows, drawn fresh on every run
    shapes = [(1, 1), (37, 53), (8, 130), (130, 8)] + ([(1000, 1003)] if world().gpu else [])
    for i, (rows, cols) in enumerate(shapes):
        # 16 threads along x (columns), 8 along y (rows); then other shapes of block
        block = (16, 8) if i < 2 else [(8, 16), (32, 4), (4, 32)][int(rng.integers(3))]
        a, b = _rand(rng, (rows, cols)), _rand(rng, (rows, cols))
        grid = ((cols + block[0] - 1) // block[0], (rows + block[1] - 1) // block[1])
        what = f"{rows}x{cols} matrix, grid {grid} x block {block}"
        try:
            out, guard = _launch(matrix_add_kernel, grid, block, [a, b], (rows, cols))
        except Exception as exc:
            report.fail(f"{what}: {_oob_hint(exc)} (check both row < rows and col < cols; "
                        "x runs along columns, y along rows)")
            return
        if (guard != np.float32(POISON)).any():
            report.fail(f"{what}: wrote past the end of C: check both row < rows and col < cols")
            return
        truth = a.astype(np.float64) + b.astype(np.float64)
        passed, line = compare(out, truth, a + b, what=what)
        if not passed and "never written" in line and block != (16, 8):
            line += (f": the grader launches blocks of {block} threads here; use cuda.grid(2) (or cuda.blockDim), "
                     "not the (16, 8) of the example")
        elif not passed and "never written" in line and rows != cols:
            line += (": check both bounds, row < rows and col < cols, and that x (the fast index) runs along "
                     "columns and y along rows: col, row = cuda.grid(2)")
        if not report.expect(passed, line, line):
            return


@exercise("01.5", "effective bandwidth from a timing", names=("vector_add_gbps",), time_limit_s=10)
def grade_gbps(report: Report, vector_add_gbps):
    rng = fresh_rng(report)
    # fresh every run; the first case has itemsize > 1, so that a missing itemsize shows there
    cases = [(int(rng.integers(10**6, 10**9)), int(rng.choice([2, 4, 8])), round(float(rng.uniform(0.05, 5)), 4)),
             (int(rng.integers(100, 10**4)), 4, round(float(rng.uniform(0.002, 0.01)), 5)),
             (int(rng.integers(10**5, 10**7)), int(rng.choice([1, 2])), round(float(rng.uniform(0.005, 0.5)), 4)),
             (int(rng.integers(10**8, 10**9)), 8, round(float(rng.uniform(0.5, 5)), 3))]
    for n, itemsize, ms in cases:
        want = 3 * n * itemsize / (ms * 1e-3) / 1e9
        got = number(report, f"vector_add_gbps({n}, {itemsize}, {ms})", vector_add_gbps, n, itemsize, ms)
        if got is None:
            return
        if abs(got - want) <= 1e-6 * want:
            report.ok(f"vector_add_gbps({n}, {itemsize}, {ms}) = {want:.1f} GB/s")
            continue
        ratio = got / want
        hints = [(2 / 3, "you counted two arrays: vector add reads x and y and writes out, three arrays"),
                 (1 / 3, "you counted one array: x and y are read and out is written"),
                 (1e-3, "ms is milliseconds: divide by ms * 1e-3 seconds"),
                 (1e3, "ms is milliseconds, not microseconds"),
                 (1e9 / 2**30, "GB/s means 10^9 bytes per second, not 2^30 (GiB)"),
                 (1 / itemsize, "multiply by the bytes per element (itemsize)")]
        hint = next((h for r, h in hints if abs(ratio - r) <= 1e-3 * r), "bytes moved / seconds / 1e9")
        report.fail(f"vector_add_gbps({n}, {itemsize}, {ms}) returned {got:.4g}, expected {want:.4g}: {hint}")
        return


# ---- 01.6 matrix add at the memory's speed (graded on speed on a GPU) --------------------------------

SPEED_SHAPE = (8192, 8192)  # float32: A, B and C move 768 MB, far more than any L2
SPEED_AT_LEAST = 0.6        # of a device-to-device copy of as many bytes, timed in the same run


# On the CPU numba's simulator runs every launched thread in Python: a correct launch took 62-88 s on two
# cores, more than the default limit leaves on a slower machine.
@exercise("01.6", "matrix add at the memory's speed", names=("matrix_add",), time_limit_s=300)
def grade_matrix_add_speed(report: Report, matrix_add):
    if not callable(matrix_add) or hasattr(matrix_add, "__getitem__"):
        return report.fail("matrix_add should be a plain Python function that launches your kernel "
                           "(kernel[grid, block](A, B, C)), not the kernel itself")
    from numba import cuda

    rng = fresh_rng(report)  # values, and one shape no statement shows, drawn fresh on every run
    # more than 32 rows and 32 columns: more elements than one block has threads (1,024 at most), so that a launcher
    # with a grid of its own, not computed from C's shape, fails here (one drawn at 7 x 20 fitted one block of
    # 32 x 8, and such a launcher passed)
    drawn = (int(rng.integers(33, 129)), int(rng.integers(33, 129)))
    shapes = [(37, 53), (8, 130), (130, 8), drawn] + ([(1000, 1003)] if world().gpu else [])
    for rows, cols in shapes:
        a, b = _rand(rng, (rows, cols)), _rand(rng, (rows, cols))
        what = f"{rows}x{cols} matrix"
        d_a, d_b = cuda.to_device(a), cuda.to_device(b)
        flat = cuda.to_device(poisoned(rows * cols + GUARD))
        d_c = flat[: rows * cols].reshape((rows, cols))
        try:
            matrix_add(d_a, d_b, d_c)
            cuda.synchronize()
        except Exception as exc:
            report.fail(f"{what}: {_oob_hint(exc)}")
            return
        host = flat.copy_to_host()
        if (host[rows * cols:] != np.float32(POISON)).any():
            report.fail(f"{what}: wrote past the end of C: check both row < rows and col < cols")
            return
        truth = a.astype(np.float64) + b.astype(np.float64)
        passed, line = compare(host[: rows * cols].reshape(rows, cols), truth, a + b, what=what)
        if not passed and "never written" in line:
            line += ": the grid must cover every row and every column"
        if not report.expect(passed, line, line):
            return

    if not world().gpu:
        report.not_graded(f"{SPEED_SHAPE[0]}x{SPEED_SHAPE[1]} float32 at {SPEED_AT_LEAST:.0%} of a copy's "
                          "bandwidth: speed needs a GPU (not graded here)")
        return
    import torch

    from . import speed_vs_roof

    rows, cols = SPEED_SHAPE
    ta, tb = (torch.randn(rows, cols, device="cuda") for _ in range(2))
    tc = torch.full_like(ta, POISON)  # poisoned, as above: torch.empty_like would hold whatever memory held
    d_a, d_b, d_c = (cuda.as_cuda_array(t) for t in (ta, tb, tc))
    matrix_add(d_a, d_b, d_c)
    cuda.synchronize()
    if not torch.equal(tc, ta + tb):
        unwritten = int((tc == POISON).sum())
        hint = (f": {unwritten} of {tc.numel()} elements never written: the grid must cover every row and every "
                "column" if unwritten else "")
        return report.fail(f"{rows}x{cols}: the result is wrong at this size, so its speed is not graded{hint}")
    speed_vs_roof(report, f"{rows}x{cols} float32 (A + B read, C written: {3 * ta.nbytes / 1e6:.0f} MB)",
                  lambda: matrix_add(d_a, d_b, d_c), 3 * ta.nbytes, SPEED_AT_LEAST)
