"""Chapter 08's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted. Kernels run in Triton's interpreter on the CPU."""
import os
from pathlib import Path

import pytest
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import transformer as T
from kernelcourse.grading import ch08
from tests.helpers import grade, memorised

ROOT = Path(__file__).resolve().parent.parent


class WithMistake:
    """A kernel launched with its MISTAKE constexpr set: what a learner's kernel with that mistake does."""

    def __init__(self, kernel, mistake):
        self.kernel, self.fn, self.mistake = kernel, kernel.fn, mistake

    def __getitem__(self, grid):
        return lambda *args, **meta: self.kernel[grid](*args, MISTAKE=self.mistake, **meta)

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a kernel is launched as kernel[grid](...)")

# ---- 08.1 dX ---------------------------------------------------------------------------------------


def make_dx_kernel(mistake=""):
    @triton.jit
    def layer_norm_dx_kernel(x_ptr, dy_ptr, w_ptr, dx_ptr, n_cols, stride, eps, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        # "block_64", "block_256": the BLOCK of one of the grader's launches written in, the argument ignored
        cols = tl.arange(0, 64 if MISTAKE == "block_64" else 256 if MISTAKE == "block_256" else BLOCK)
        mask = cols < n_cols
        if MISTAKE == "packed":  # rows taken to be n_cols apart, the stride argument ignored
            stride = n_cols
        x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0)
        if MISTAKE == "half_sum":  # the row sum in the input's 16 bits, the rest in float32
            mean = tl.sum(x, axis=0).to(tl.float32) / n_cols
            x = x.to(tl.float32)
        else:
            x = x.to(tl.float32)
            mean = tl.sum(x, axis=0) / n_cols
        dy = tl.load(dy_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if MISTAKE == "padding":
            d = x - mean
        else:
            d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + (1e-5 if MISTAKE == "own_eps" else eps))
        xhat = d * rstd
        g = dy if MISTAKE == "no_w" else dy * w
        if MISTAKE == "padding":
            g = tl.where(mask, g, 0.0)
            xhat = tl.where(mask, xhat, 0.0)
        c1 = tl.sum(xhat * g, axis=0) / n_cols
        c2 = tl.sum(g, axis=0) / n_cols
        if MISTAKE == "no_c2":
            dx = (g - xhat * c1) * rstd
        elif MISTAKE == "no_c1":
            dx = (g - c2) * rstd
        else:
            dx = (g - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + row * stride + cols, dx, mask=mask if MISTAKE != "unmasked_store" else None)
    return WithMistake(layer_norm_dx_kernel, mistake)


@triton.jit
def dx_two_pass(x_ptr, dy_ptr, w_ptr, dx_ptr, n_cols, stride, eps, BLOCK: tl.constexpr):
    # also right: the centred variance summed from x - mean with the padding masked once, and dX's two sums
    # written out in another order (E[x²] - mean² is not: it loses the variance to cancellation)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / n_cols
    rstd = tl.rsqrt(var + eps)
    g = dy * w
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    dx = rstd * g - rstd / n_cols * (tl.sum(g, axis=0) + xhat * tl.sum(g * xhat, axis=0))
    tl.store(dx_ptr + row * stride + cols, dx, mask=mask)


def test_08_1_accepts_correct():
    for k in (make_dx_kernel(), dx_two_pass):
        passed, text = grade("08.1", layer_norm_dx_kernel=k)
        assert passed, text


@pytest.mark.parametrize("mistake, hint", [
    ("no_w", "multiply dy by the weight"),
    ("no_c1", "x̂ * mean(x̂ * g) term is missing"),
    ("no_c2", "mean(g) term is missing"),
    ("padding", "is not 0 in the padding"),
    ("half_sum", "in float16 their sum loses the digits x - mean needs: convert what you load with .to(tl.float32)"),
    ("own_eps", "use the eps argument"),
])
def test_08_1_rejects_mistakes(mistake, hint):
    passed, text = grade("08.1", layer_norm_dx_kernel=make_dx_kernel(mistake))
    assert not passed and hint in text, text


@pytest.mark.parametrize("mistake", ["block_64", "block_256"])
def test_08_1_rejects_a_block_of_its_own(mistake):
    """A kernel that covers the columns of one of the grader's launches (64 or 256 written in, BLOCK ignored): right
    on rows that fit, and rows longer than 1,024 (BLOCK 2048) show it on the CPU too."""
    passed, text = grade("08.1", layer_norm_dx_kernel=make_dx_kernel(mistake))
    assert not passed and "were never written: a program covers the BLOCK columns the launch passes" in text, text


def test_08_1_rejects_rows_taken_n_cols_apart():
    """x, dy and dx are views into wider tensors: a kernel that addresses row r at r * n_cols, not r * stride."""
    passed, text = grade("08.1", layer_norm_dx_kernel=make_dx_kernel("packed"))
    assert not passed and "use the row stride" in text, text


def test_08_1_rejects_a_plain_function():
    passed, text = grade("08.1", layer_norm_dx_kernel=lambda *a: None)
    assert not passed and "@triton.jit" in text, text


# ---- 08.2 column sum -------------------------------------------------------------------------------


def make_column_sum(mistake=""):
    @triton.jit
    def column_sum_kernel(part_ptr, out_ptr, n_parts, n_cols, stride, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                          MISTAKE: tl.constexpr):
        pid = tl.program_id(0)
        if MISTAKE == "packed":  # rows taken to be n_cols apart, the stride argument ignored
            stride = n_cols
        if MISTAKE == "fixed_block":  # 32 columns a program, whatever BLOCK_N the launch passes
            cols = pid * 32 + tl.arange(0, 32)
            cmask = cols < n_cols
            acc = tl.zeros((BLOCK_P, 32), dtype=tl.float32)
        else:
            cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < n_cols
            acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        if MISTAKE == "one_step":
            rows = tl.arange(0, BLOCK_P)
            acc += tl.load(part_ptr + rows[:, None] * stride + cols[None, :],
                           mask=(rows < n_parts)[:, None] & cmask[None, :], other=0.0)
        else:
            for p0 in range(0, n_parts, BLOCK_P):
                rows = p0 + tl.arange(0, BLOCK_P)
                m = cmask[None, :] if MISTAKE == "no_row_mask" else (rows < n_parts)[:, None] & cmask[None, :]
                tile = tl.load(part_ptr + rows[:, None] * stride + cols[None, :], mask=m, other=0.0)
                if MISTAKE == "overwrite":
                    acc = tile
                else:
                    acc += tile
        tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cmask)
    return WithMistake(column_sum_kernel, mistake)


@triton.jit
def column_sum_rowwise(part_ptr, out_ptr, n_parts, n_cols, stride, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # also right: one row at a time into a 1D accumulator (slower, as correct)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, n_parts):
        acc += tl.load(part_ptr + i * stride + cols, mask=cmask, other=0.0)
    tl.store(out_ptr + cols, acc, mask=cmask)


def test_08_2_accepts_correct():
    for k in (make_column_sum(), column_sum_rowwise, T.column_sum_kernel):
        passed, text = grade("08.2", column_sum_kernel=k)
        assert passed, text


@pytest.mark.parametrize("mistake, hint", [
    ("one_step", "only the first BLOCK_P rows"),
    # in the interpreter, the address check names the load that reads past the partial sums
    ("no_row_mask", "mask the loads with rows < n_parts" if kc.world().gpu else
     "past the end of `part_ptr`, outside every tensor the kernel was given (its mask lets them through)"),
    ("overwrite", "add to it (acc += ...)"),
    ("fixed_block", "use the BLOCK_N and BLOCK_P the launch passes"),
])
def test_08_2_rejects_mistakes(mistake, hint):
    passed, text = grade("08.2", column_sum_kernel=make_column_sum(mistake))
    assert not passed and hint in text, text


def test_08_2_rejects_rows_taken_n_cols_apart():
    """part is a view into a wider tensor: a kernel that addresses row r at r * n_cols, not r * stride, adds up the
    wrong elements (the ends of the rows, finite here, among them); it was told NaN came from rows past n_parts."""
    passed, text = grade("08.2", column_sum_kernel=make_column_sum("packed"))
    assert not passed and "address row r at part_ptr + r * stride" in text and "rows past n_parts" not in text, text


# ---- 08.3 FLOPs and bytes ----------------------------------------------------------------------------


def flops_ok(B, N, d, causal):
    per_token = 2 * (d * 3 * d + d * d + 2 * d * 4 * d)
    scores = N * (N + 1) / 2 if False else N * N / 2 if causal else N * N
    return B * N * per_token + 2 * 2 * B * scores * d


def bytes_ok(B, N, d, itemsize):
    weights = d * 3 * d + d * d + d * 4 * d + 4 * d * d
    return itemsize * (weights + B * N * d + B * N * d)


def test_08_3_accepts_correct():
    passed, text = grade("08.3", block_flops=flops_ok, block_min_bytes=bytes_ok)
    assert passed, text
    passed, text = grade("08.3", block_flops=T.block_flops, block_min_bytes=T.block_min_bytes)
    assert passed, text


@pytest.mark.parametrize("flops, nbytes, hint", [
    (lambda B, N, d, c: flops_ok(B, N, d, c) / 2, bytes_ok, "each multiply-add is 2 FLOPs"),
    (lambda B, N, d, c: 24 * B * N * d * d, bytes_ok, "attention's two products"),
    (lambda B, N, d, c: 24 * B * N * d * d + 4 * B * N * N * d, bytes_ok, "only half the scores"),
    (flops_ok, lambda B, N, d, s: 12 * d * d * s, "the input is read and the output written once"),
    (flops_ok, lambda B, N, d, s: 12 * d * d + 2 * B * N * d, "multiply the element count by itemsize"),
])
def test_08_3_rejects_mistakes(flops, nbytes, hint):
    passed, text = grade("08.3", block_flops=flops, block_min_bytes=nbytes)
    assert not passed and hint in text, text


def test_08_3_cases_are_fresh_every_run(monkeypatch):
    """A table of one run's answers (the shapes the statement shows among them) fails the next run."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    flops, flops_table = memorised(flops_ok)
    nbytes, bytes_table = memorised(bytes_ok)
    assert grade("08.3", block_flops=flops, block_min_bytes=nbytes)[0]
    passed, text = grade("08.3", block_flops=flops_table, block_min_bytes=bytes_table)
    assert not passed and "KC_GRADE_SEED=" in text, text


# ---- 08.4 reading a trace ------------------------------------------------------------------------------


def dominant_ok(events):
    totals = {}
    for e in events:
        if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset"):
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    name = max(totals, key=totals.get)
    return name, totals[name] / sum(totals.values())


def idle_ok(events):
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset"))
    merged = [list(iv[0])]
    for s, t in iv[1:]:
        if s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    busy = sum(t - s for s, t in merged)
    span = merged[-1][1] - merged[0][0]
    return 1 - busy / span


def test_08_4_accepts_correct():
    passed, text = grade("08.4", dominant_kernel=dominant_ok, idle_share=idle_ok)
    assert passed, text
    passed, text = grade("08.4", dominant_kernel=lambda ev: (T.by_kernel(ev)[0]["kernel"], T.by_kernel(ev)[0]["share"]),
                         idle_share=lambda ev: T.gpu_idle(ev)["idle_share"])
    assert passed, text


def longest_call(events):
    e = max((e for e in events if e["cat"] == "kernel"), key=lambda e: e["dur"])
    return e["name"], dominant_ok(events)[1]


def idle_naive(events):
    gpu = [e for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    return 1 - sum(e["dur"] for e in gpu) / span


def all_events(events):
    totals = {}
    for e in events:
        totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    name = max(totals, key=totals.get)
    return name, totals[name] / sum(totals.values())


@pytest.mark.parametrize("dominant, idle, hint", [
    (longest_call, idle_ok, "longest single call"),
    (all_events, idle_ok, "only GPU events"),
    (dominant_ok, idle_naive, "merge the intervals"),
    (lambda ev: (dominant_ok(ev)[0], 100 * dominant_ok(ev)[1]), idle_ok, "between 0 and 1"),
    (lambda ev: None, idle_ok, "returned None: did you forget `return`?"),
    (lambda ev: dominant_ok(ev)[0], idle_ok, "return a tuple of 2 values"),
    (lambda ev: ev[10**6], idle_ok, "IndexError"),
])
def test_08_4_rejects_mistakes(dominant, idle, hint):
    passed, text = grade("08.4", dominant_kernel=dominant, idle_share=idle)
    assert not passed and hint in text, text


def idle_from_zero(events):
    # right busy time (intervals merged), but the span measured from time 0, not from the first kernel's start
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, covered_to = 0.0, iv[0][0]
    for s, t in iv:
        busy += max(0.0, t - max(s, covered_to))
        covered_to = max(covered_to, t)
    return 1 - busy / covered_to


def test_08_4_rejects_a_span_measured_from_0():
    passed, text = grade("08.4", dominant_kernel=dominant_ok, idle_share=idle_from_zero)
    assert not passed and "the span runs from the first kernel's start, not from 0" in text, text


def test_08_4_draws_its_synthetic_trace_on_every_run(monkeypatch):
    """Answers copied from one run (a table keyed by the trace, what a learner who pasted the grader's
    numbers submits) fail the next: the synthetic trace is drawn afresh. It was fixed, and a three-entry table
    passed."""
    import json

    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    dominant, dominant_table = memorised(lambda key: dominant_ok(json.loads(key)), default=("small_add_kernel", 0.5))
    idle, idle_table = memorised(lambda key: idle_ok(json.loads(key)), default=0.5)
    key = lambda events: json.dumps(events, sort_keys=True)  # noqa: E731
    assert grade("08.4", dominant_kernel=lambda ev: dominant(key(ev)), idle_share=lambda ev: idle(key(ev)))[0]
    passed, text = grade("08.4", dominant_kernel=lambda ev: dominant_table(key(ev)),
                         idle_share=lambda ev: idle_table(key(ev)))
    assert not passed and "the synthetic trace" in text and "KC_GRADE_SEED=" in text, text


def test_synthetic_trace_answers():
    ev = ch08.synthetic_trace()
    assert T.by_kernel(ev)[0]["kernel"] == "small_add_kernel"
    g = T.gpu_idle(ev)
    assert g["busy_us"] == 6 * 20 + 130 and g["span_us"] == 420 - 100


def test_drawn_synthetic_traces_keep_what_they_teach():
    """Whatever the draw: many short calls beat the longest single call, the copy overlaps the gemm's end, the first
    kernel starts after 0, and counted with the CPU's events a name that is no kernel would win."""
    import numpy as np

    for seed in range(200):
        ev = ch08.synthetic_trace(np.random.default_rng(seed))
        kernels = {e["name"]: e for e in ev if e["cat"] == "kernel"}
        assert T.by_kernel(ev)[0]["kernel"] == "small_add_kernel" == dominant_ok(ev)[0]
        assert longest_call(ev)[0] == "big_gemm_kernel"
        gemm, copy = kernels["big_gemm_kernel"], kernels["side_stream_copy"]
        assert gemm["ts"] < copy["ts"] < gemm["ts"] + gemm["dur"] < copy["ts"] + copy["dur"]
        assert min(e["ts"] for e in ev if e["cat"] == "kernel") > 0
        assert all_events(ev)[0] in ("forward", "cudaLaunchKernel")
        assert abs(idle_ok(ev) - T.gpu_idle(ev)["idle_share"]) < 1e-9
        assert abs(idle_naive(ev) - idle_ok(ev)) > 1e-2 and abs(idle_from_zero(ev) - idle_ok(ev)) > 1e-2


# ---- 08.5 fused backward ---------------------------------------------------------------------------------


def make_fused(mistake=""):
    @triton.jit
    def layer_norm_backward_kernel(h_ptr, dy_ptr, dres_ptr, w_ptr, dx_ptr, part_ptr, n_rows, n_cols, stride, eps,
                                   ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, HAS_DRES: tl.constexpr,
                                   MISTAKE: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, 256 if MISTAKE == "block_256" else BLOCK)  # "block_256": a BLOCK of its own
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros_like(w)
        db = tl.zeros_like(w)
        part = part_ptr + pid * 2 * n_cols + cols  # this program's partial dW, then its partial dB
        rs = n_cols if MISTAKE == "packed" else stride  # "packed": rows taken to be n_cols apart
        # "rows_3": the ROWS_PER_PROGRAM of the grader's first launch (7 rows on 3 programs) written in
        for i in range(3 if MISTAKE == "rows_3" else ROWS_PER_PROGRAM):
            row = (pid * (3 if MISTAKE == "rows_3" else ROWS_PER_PROGRAM) + i).to(tl.int64)
            m = mask if MISTAKE == "no_row_mask" else mask & (row < n_rows)  # "no_row_mask": the last rows run past
            h = tl.load(h_ptr + row * rs + cols, mask=m, other=0.0)
            if MISTAKE == "half_sum":  # the row sum in the input's 16 bits, the rest in float32
                mean = tl.sum(h, axis=0).to(tl.float32) / n_cols
                h = h.to(tl.float32)
            else:
                h = h.to(tl.float32)
                mean = tl.sum(h, axis=0) / n_cols
            dy = tl.load(dy_ptr + row * rs + cols, mask=m, other=0.0).to(tl.float32)
            d = tl.where(mask, h - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + (1e-5 if MISTAKE == "own_eps" else eps))
            xhat = d * rstd
            g = dy * w
            dx = (g - (xhat * tl.sum(xhat * g, axis=0) / n_cols + tl.sum(g, axis=0) / n_cols)) * rstd
            if HAS_DRES and MISTAKE != "no_dres":
                dx += tl.load(dres_ptr + row * rs + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * rs + cols, dx, mask=m)
            if MISTAKE == "last_row":
                dw = dy * xhat
                db = dy
            elif MISTAKE == "partials_through_memory":  # right, but each row waits on a load of the last one's store
                if i == 0:
                    tl.store(part, dy * xhat, mask=mask)
                    tl.store(part + n_cols, dy, mask=mask)
                else:
                    tl.store(part, tl.load(part, mask=mask) + dy * xhat, mask=mask)
                    tl.store(part + n_cols, tl.load(part + n_cols, mask=mask) + dy, mask=mask)
            else:
                dw += dy * xhat
                db += dy
        if MISTAKE != "partials_through_memory" and MISTAKE != "no_partials":  # "no_partials": dX only
            tl.store(part, dw, mask=mask)
            tl.store(part + n_cols, db, mask=mask)
    return WithMistake(layer_norm_backward_kernel, mistake)


def test_08_5_accepts_correct():
    for k in (make_fused(), T.layer_norm_backward_kernel):
        passed, text = grade("08.5", layer_norm_backward_kernel=k)
        assert passed and "never read back" in text, text
        if not kc.world().gpu:
            assert "speed needs a GPU" in text, text


@pytest.mark.parametrize("mistake, hint", [
    ("no_dres", "add dres"),
    ("last_row", "add up all of its rows"),
    ("half_sum", "in float16 their sums lose the digits x - mean"),
    ("own_eps", "use the eps argument"),
    ("packed", "not r * n_cols"),
    ("no_partials", "does every program store its partial dW and dB"),
])
def test_08_5_rejects_mistakes(mistake, hint):
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused(mistake))
    assert not passed and hint in text, text


@pytest.mark.parametrize("mistake, hint", [
    ("rows_3", "the number the launch passes"),  # 3 rows a program, the grader's first launch's: rows are skipped
    ("block_256", "a program covers the BLOCK columns the launch passes"),  # right on rows of up to 256
])
def test_08_5_rejects_launch_parameters_of_its_own(mistake, hint):
    """On the CPU no case had more than 256 columns, so block_256 passed, and only the drawn ones could have more than
    3 rows a program, so rows_3 passed on some runs and failed on others with the stride check's hint. A case of 10
    to 16 rows a program and more than 1,024 columns now shows both, each with its hint."""
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused(mistake))
    assert not passed and hint in text, text


class ReusedMemory:
    """``torch`` as ``T.layer_norm_backward`` finds it on a GPU: ``torch.empty`` hands back the memory that a tensor
    of the same size held before (PyTorch's caching allocator), with what was left in it."""

    def __init__(self):
        import torch

        self.torch, self.blocks = torch, {}

    def __getattr__(self, name):
        return getattr(self.torch, name)

    def _reused(self, shape, dtype, device):
        key = (tuple(shape), dtype, str(device))
        if key not in self.blocks:
            self.blocks[key] = self.torch.empty(shape, dtype=dtype, device=device)
        return self.blocks[key]

    def empty_like(self, t, **kwargs):
        return self.torch.empty_like(t, **kwargs) if kwargs else self._reused(t.shape, t.dtype, t.device)

    def empty(self, shape, *, device=None, dtype=None):
        return self._reused(shape if isinstance(shape, tuple) else (shape,), dtype, device)


@pytest.mark.parametrize("mistake, hint", [
    ("rows_3", "the number the launch passes"),
    ("block_256", "a program covers the BLOCK columns the launch passes"),
])
def test_08_5_names_launch_parameters_of_its_own_where_memory_holds_the_answer(monkeypatch, mistake, hint):
    """On a GPU the launcher's torch.empty hands back memory freed before. Graded in the test's process after a
    correct kernel had the same cases (the suite draws from one seed), dX already held the right values in the rows
    and columns the wrong kernel skips: dX passed, and dW failed with no hint (H200, 2026). The grader fills dX
    and the partial sums before each launch, so what a kernel leaves unwritten shows, whatever memory held."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # as on a GPU: what one grading leaves, the next one finds
    monkeypatch.setattr(T, "torch", ReusedMemory())
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused())
    assert passed, text
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused(mistake))
    assert not passed and hint in text, text


@pytest.mark.skipif(kc.world().gpu, reason="the address check runs in Triton's interpreter")
def test_08_5_rejects_rows_past_n_rows_unmasked():
    """The last program's rows run past n_rows: a kernel that masks columns only reads and writes past h and dx."""
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused("no_row_mask"))
    assert not passed and "past the end of `h_ptr`" in text and "its mask must be False" in text, text


def test_08_5_rejects_partial_sums_kept_in_memory_on_every_machine():
    """A kernel that loads and stores its partial sums for every row computes the right numbers, and a speed
    check alone does not tell it apart run after run (about 0.8x PyTorch's speed on an H100, against the 0.9x
    asked for; on 2026-11-25 it cleared 0.9x). The grader finds its loads of `part` instead: counted as
    Triton's interpreter runs it on the CPU, read from the code Triton compiled for it on a GPU."""
    passed, text = grade("08.5", layer_norm_backward_kernel=make_fused("partials_through_memory"))
    assert not passed and "never reads" in text and "keep each program's partial dW and dB in registers" in text, text
    assert "LayerNorm backward at 16384 x 2048" not in text, text  # rejected before any timing


@triton.jit
def ln_backward_reading_back(h_ptr, dy_ptr, dres_ptr, w_ptr, dx_ptr, part_ptr, n_rows, n_cols, stride, eps,
                             ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr, HAS_DRES: tl.constexpr):
    # a learner's kernel as written, no wrapper: right numbers, partial sums added up in memory row by row
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    part = part_ptr + pid * 2 * n_cols + cols
    tl.store(part, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)
    tl.store(part + n_cols, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)
    for i in range(ROWS_PER_PROGRAM):
        row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
        m = mask & (row < n_rows)
        h = tl.load(h_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(h, axis=0) / n_cols
        d = tl.where(mask, h - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
        xhat = d * rstd
        g = dy * w
        dx = (g - (xhat * tl.sum(xhat * g, axis=0) / n_cols + tl.sum(g, axis=0) / n_cols)) * rstd
        if HAS_DRES:
            dx += tl.load(dres_ptr + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride + cols, dx, mask=m)
        tl.store(part, tl.load(part, mask=mask) + dy * xhat, mask=mask)
        tl.store(part + n_cols, tl.load(part + n_cols, mask=mask) + dy, mask=mask)


def test_08_5_rejects_a_plain_kernel_that_reads_its_partial_sums_back():
    passed, text = grade("08.5", layer_norm_backward_kernel=ln_backward_reading_back)
    assert not passed and "never reads" in text and "`part_ptr`" in text, text


def test_08_5_reads_the_loads_from_every_variant_compiled_on_a_gpu():
    """On a GPU the check reads the Triton IR of what the checks above compiled: from a JITFunction's
    device caches (whose ``.kernel`` is None), or from the kernel a wrapper launches."""
    from kernelcourse.grading.addresses import compiled_function, loads_in_compiled

    reads = "%p = tt.addptr %part_ptr, %o : !tt.ptr<f32>, i32\n%q = tt.splat %p : !tt.ptr<f32> -> tensor<64x!tt.ptr<f32>>\n" \
            "%r = tt.addptr %q, %cols : tensor<64x!tt.ptr<f32>>, tensor<64xi32>\n%v = tt.load %r, %mask : tensor<64x!tt.ptr<f32>>"
    keeps = reads.replace("%v = tt.load %r", "tt.store %r, %acc")

    class Compiled:
        def __init__(self, ttir):
            self.asm = {"ttir": ttir, "ptx": ""}

    class Jit:  # what a launch leaves in a JITFunction
        kernel = None
        arg_names = ["h_ptr", "dy_ptr", "dres_ptr", "w_ptr", "dx_ptr", "part_ptr"]

        def __init__(self, *ttirs):
            self.device_caches = {0: ({i: Compiled(t) for i, t in enumerate(ttirs)}, None, None, None)}

    class Wrapper:  # binds a constexpr, keeps the kernel it launches
        def __init__(self, kernel):
            self.kernel, self.fn = kernel, (lambda: None)

    assert loads_in_compiled(Jit(keeps, reads), "part_ptr") == 1 and loads_in_compiled(Jit(keeps), "part_ptr") == 0
    assert loads_in_compiled(Wrapper(Jit(reads)), "part_ptr") == 1 and loads_in_compiled(Jit(), "part_ptr") is None
    assert compiled_function(Wrapper(Jit())).arg_names[5] == "part_ptr"


def test_08_5_counts_loads_of_the_partial_sums_in_compiled_code():
    """The GPU's side of the check above, on this machine: Triton IR compiled for sm_90 (no GPU needed) of the
    course's kernel, the correct alternative and the one that reads its partial sums back."""
    import subprocess
    import sys

    script = """
import sys
import kernelcourse.targets as T
sys.modules["kernelcourse.world"]._enter_simulation = lambda: None  # compile here: no interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelcourse import transformer as TR
from kernelcourse.grading.addresses import loads_through
import tests.test_grading_ch08 as t8

def ttir(fn, cons):
    sig = T._signature(fn, cons, {"eps": "fp32", "part_ptr": "*fp32"}, "fp16")
    names = list(fn.arg_names)
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in cons.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttir"]

base = dict(ROWS_PER_PROGRAM=4, BLOCK=64, HAS_DRES=True)
print(loads_through(ttir(TR.layer_norm_backward_kernel, base), "part_ptr"),
      loads_through(ttir(TR.layer_norm_backward_kernel, base), "h_ptr"),
      *(loads_through(ttir(t8.make_fused(m).kernel, {**base, "MISTAKE": m}), "part_ptr")
        for m in ("", "partials_through_memory")))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    course, h_loads, alternative, read_back = map(int, out.stdout.split()[-4:])
    assert (course, alternative) == (0, 0) and h_loads == 1 and read_back == 2


# ---- 08.6 fused cross-entropy ----------------------------------------------------------------------


@triton.jit
def ce_kernel(logits_ptr, grad_ptr, target_ptr, loss_ptr, n_cols, stride_x, stride_g, ignore_index, n_valid,
              BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    # the max first, then the sum (two sweeps before the gradient's): a correct alternative to the online
    # log-sum-exp, and, with MISTAKE set, the typical wrong versions
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * stride_x
    g_row = grad_ptr + row * stride_g
    cols = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    m = -float("inf")
    if MISTAKE == "no_max":
        m = 0.0
    else:
        for start in range(0, n_cols, 1024 if MISTAKE == "step_1024" else BLOCK):
            if MISTAKE == "unmasked":
                x = tl.load(x_row + start + cols).to(tl.float32)
            else:
                x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(x, axis=0))
    d = 0.0
    for start in range(0, n_cols, 1024 if MISTAKE == "step_1024" else BLOCK):
        if MISTAKE == "unmasked":
            x = tl.load(x_row + start + cols).to(tl.float32)
        else:
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf")).to(tl.float32)
        d += tl.sum(tl.exp(x - m), axis=0)
    x_target = tl.load(x_row + target, mask=valid, other=0.0).to(tl.float32)
    if MISTAKE == "lse_first":  # correct too: log-sum-exp, then minus the target's logit (m + log d rounds at |m|)
        tl.store(loss_ptr + row, tl.where(valid, (m + tl.log(d)) - x_target, 0.0))
    elif MISTAKE == "skip_ignored_loss" or MISTAKE == "skip_ignored_row":  # an ignored row's loss never stored
        tl.store(loss_ptr + row, (m - x_target) + tl.log(d), mask=valid)
    else:
        tl.store(loss_ptr + row, tl.where(valid, (m - x_target) + tl.log(d), 0.0))
    scale = tl.where(valid, 1.0 / n_valid, 0.0)
    if MISTAKE == "grad_not_divided":
        scale = tl.where(valid, 1.0, 0.0)
    for start in range(0, n_cols, 1024 if MISTAKE == "step_1024" else BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - m) / d
        g = tl.where(start + cols == target, p - 1.0, p) * scale
        if MISTAKE == "skip_ignored_grad" or MISTAKE == "skip_ignored_row":  # an ignored row's gradient never stored
            mask = mask & valid
        tl.store(g_row + start + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


def ce_launcher(mistake=""):
    def cross_entropy_fwd_bwd(logits, target, ignore_index=-100, BLOCK=1024):
        import torch

        n_rows, n_cols = logits.shape
        n_valid = n_rows if mistake == "count_all_rows" else int((target != ignore_index).sum())
        grad = torch.empty_like(logits)
        loss = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
        stride_x = n_cols if mistake == "packed" else logits.stride(0)  # "packed": rows taken to be n_cols apart
        ce_kernel[(n_rows,)](logits, grad, target, loss, n_cols, stride_x, grad.stride(0), ignore_index,
                             n_valid, BLOCK=BLOCK, MISTAKE=mistake)
        return loss.sum() / n_valid, grad
    return cross_entropy_fwd_bwd


def test_08_6_accepts_correct():
    from kernelcourse import losses

    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher())
    assert passed, text
    # the log-sum-exp formed first, m + log d, rounds in float32 at the scale of the logits near 1000
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher("lse_first"))
    assert passed, text
    passed, text = grade("08.6", cross_entropy_fwd_bwd=lambda logits, target, ignore_index, BLOCK:
                         losses.cross_entropy_forward_backward(logits, target, ignore_index, BLOCK=BLOCK))
    assert passed, text


@pytest.mark.parametrize("mistake, hint", [
    ("no_max", "exp() overflows for logits near 1000"),
    ("count_all_rows", "the mean is over the rows that are not ignored"),
    ("grad_not_divided", "the gradient of the mean is divided by the number of rows not ignored"),
    pytest.param("unmasked", "past the end of `logits_ptr`", marks=pytest.mark.skipif(
        kc.world().gpu, reason="the address check runs in Triton's interpreter")),
])
def test_08_6_rejects_wrong(mistake, hint):
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher(mistake))
    assert not passed
    assert hint in text, text


@pytest.mark.parametrize("mistake, hint, not_said", [
    ("skip_ignored_grad", "all in the rows whose target is ignore_index: an ignored row gets no gradient, but its "
                          "zeros must be stored", "loss nan"),
    ("skip_ignored_loss", "store 0 as an ignored row's loss", "and zeros in its row of the gradient"),
    ("skip_ignored_row", "store 0 as an ignored row's loss, and zeros in its row of the gradient", None),
])
def test_08_6_rejects_a_kernel_that_stores_nothing_in_ignored_rows(mistake, hint, not_said):
    """The launcher allocates the gradient and the per-row losses with torch.empty: a kernel that skips an ignored
    row leaves there whatever memory held, zeros as often as not (on a GPU, the right values an earlier grading of
    the same inputs left). The grader makes them NaN, so the skip fails on every run, with the hint for it, not the
    overflow's."""
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher(mistake))
    assert not passed and hint in text, text
    assert "exp() overflows" not in text and (not_said is None or not_said not in text), text


def test_08_6_rejects_a_step_of_its_own():
    """A kernel that loads the BLOCK columns the launch passes but steps over the row by 1024, the launcher's default:
    right at BLOCK=1024, columns skipped at the grader's 256."""
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher("step_1024"))
    assert not passed and "step over the row by the BLOCK the launch passes" in text, text


def test_08_6_rejects_rows_taken_n_cols_apart():
    """The logits are a view into a wider tensor: a launcher that passes n_cols for their row stride."""
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_launcher("packed"))
    assert not passed and "pass logits.stride(0) and address row r at r * stride" in text, text


def test_08_6_stub_and_kernel_instead_of_launcher_fail():
    def stub(logits, target, ignore_index=-100, BLOCK=1024):
        raise NotImplementedError

    passed, text = grade("08.6", cross_entropy_fwd_bwd=stub)
    assert not passed and "not written yet" in text, text
    passed, text = grade("08.6", cross_entropy_fwd_bwd=ce_kernel)
    assert not passed and "plain Python function" in text, text


def test_08_6_rejects_pytorch_doing_the_work():
    import torch.nn.functional as F

    def with_pytorch(logits, target, ignore_index=-100, BLOCK=1024):
        x = logits.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(x, target, ignore_index=ignore_index)
        loss.backward()
        return loss.detach(), x.grad

    passed, text = grade("08.6", cross_entropy_fwd_bwd=with_pytorch)
    assert not passed and "tensors as large as the logits" in text, text


def test_08_6_draws_its_values_and_an_ignore_index_on_every_run(monkeypatch):
    """A launcher that fixes ignore_index at a value it saw (-100, PyTorch's default) fails the case whose class id is
    drawn; answers copied from one run answer nothing on the next.

    Graded in the test's process, as on a GPU, so that the table is a dict the grader's calls fill. Its key is a
    few logits and its answers the tensors the launcher returned: no copy as large as the logits, which the
    grader counts as the launcher's own work. Recorded through a file in a child process, each call on a GPU
    copied the logits and the gradient to the host (two tensors as large as the logits, in the grader's count),
    and the recording failed there before it recorded anything."""
    launcher = ce_launcher()
    passed, text = grade("08.6", cross_entropy_fwd_bwd=lambda logits, target, ignore_index, BLOCK:
                         launcher(logits, target, -100, BLOCK))
    assert not passed and "ignore_index=" in text, text

    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    seen = {}
    key = lambda logits: (tuple(logits.shape), str(logits.dtype), str(logits[:, :4].tolist()))  # noqa: E731

    def recording(logits, target, ignore_index, BLOCK):
        seen[key(logits)] = launcher(logits, target, ignore_index, BLOCK)
        return seen[key(logits)]

    def copied(logits, target, ignore_index, BLOCK):
        return seen.get(key(logits), next(iter(seen.values())))

    monkeypatch.setenv("KC_GRADE_SEED", "11")
    passed, text = grade("08.6", cross_entropy_fwd_bwd=recording)
    assert passed, text
    passed, text = grade("08.6", cross_entropy_fwd_bwd=copied)  # the same run's cases: the copy answers them
    assert passed, text
    monkeypatch.setenv("KC_GRADE_SEED", "12")
    passed, text = grade("08.6", cross_entropy_fwd_bwd=copied)
    assert not passed and "loss" in text, text


def test_08_6_rejects_a_gradient_in_another_dtype():
    """float16 logits, a float32 gradient: right values, twice the memory, and not what F.cross_entropy returns."""
    launcher = ce_launcher()

    def float32_grad(logits, target, ignore_index, BLOCK):
        loss, grad = launcher(logits, target, ignore_index, BLOCK)
        return loss, grad.float()

    passed, text = grade("08.6", cross_entropy_fwd_bwd=float32_grad)
    assert not passed and "allocate it in the logits' dtype" in text, text
