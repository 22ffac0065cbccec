"""The grading harness: everything the graders share, in one place (introduced in chapter 01; the
Triton part in chapter 04). A chapter's grader takes what it needs from here and keeps only its cases,
its comparisons and its messages.

From the modules below it, re-exported here: what a grader reports (``Report``, ``exercise``), how it
calls learner code (``call``, ``guarded``, ``number``, ``explain``), and the speed checks
(``speed_vs_peer``, ``speed_vs_roof``). Its own: random cases (``fresh_rng``, ``rand``, ``sizes``, and
``separating``, a case that tells the known mistakes apart), poisoned outputs, the one tolerance rule
(``tolerance_of``), ``compare`` and ``compare_returned``, naming the typical mistake a wrong result
reproduces under one diagnosis rule (``diagnose``), and for Triton kernels: launching the learner's
kernel and framing its inputs and outputs.

Every input and output of a Triton kernel lives inside a larger buffer: inputs are framed by NaN or a
finite pad (an unmasked read past the data brings it into the result), outputs by poison (a write past
the data shows in the frame, an element never written keeps its poison). In Triton's interpreter,
every load and store is also checked against the tensors a launch was given (``addresses``).
"""
from __future__ import annotations

import functools
import os
import warnings
from contextlib import contextmanager

import numpy as np

from ..world import world
from .addresses import float32_math
from .reporting import (DEFAULT_TIME_LIMIT_S, FAIL, NOT_GRADED, PASS, SEED_VARIABLE, Exercise,  # noqa: F401
                        GradeFailure, Report, exercise)
from .running import (Stop, TimeLimit, as_number, as_tuple, call, explain, guarded, number,  # noqa: F401
                      time_limit, where)
from .speed import speed_vs_peer, speed_vs_roof  # noqa: F401


# ---- random cases (``rand`` and ``sizes``, the values and sizes of inputs, close the file) ------------


def fresh_rng(report: Report) -> np.random.Generator:
    """A generator for this run's cases: drawn fresh on every run, so that a table of answers cannot pass.

    The seed comes from the environment variable ``KC_GRADE_SEED`` when it is set (to draw a failing
    run's cases again: ``os.environ["KC_GRADE_SEED"] = "123456"`` in the notebook), else at random;
    every failing line of the report names it.
    """
    text = os.environ.get(SEED_VARIABLE, "").strip()
    report.seed = int(text) if text.isdigit() else int(np.random.SeedSequence().entropy % 1_000_000)
    return np.random.default_rng(report.seed)


USUAL_EPS = 1e-5  # the eps that statements, PyTorch and most code show


def draw_eps(rng) -> float:
    """An eps for a normalisation's grader, drawn on each run and never near ``USUAL_EPS``: a kernel that
    writes 1e-5 of its own instead of using its eps argument then computes something else, which the cases'
    rows of small variance show."""
    return float(rng.choice([1e-6, 3e-5, 1e-4]) * rng.uniform(1.0, 2.0))


def own_eps_hint(eps: float) -> str:
    return (f"this matches eps = {USUAL_EPS:g} where the launch passed eps = {eps:.3g}: use the eps argument, "
            "not a number of your own (the grader draws it on every run)")


def separating(rng, draw, values, close, tries: int = 1000):
    """A case from ``draw(rng)`` on which ``values(case)``, the answer and then each known mistake's, are
    pairwise apart (none ``close`` to another), so that the hint of a first failing case names the right
    mistake; the last case drawn if ``tries`` draws found none."""
    for _ in range(tries):
        case = draw(rng)
        found = values(case)
        if all(not close(a, b) for i, a in enumerate(found) for b in found[i + 1:]):
            return case
    return case


# ---- comparing outputs ------------------------------------------------------------------------

POISON = -3.0e38  # written into output buffers first: an element still holding it was never written
HALF_POISON = -32768.0  # the poison of float16 and bfloat16 outputs: exact in both, and no result here is that large


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, POISON, dtype=dtype)


def _sixteen_bit(values: np.ndarray) -> bool:
    """True when every value is exactly a float16, or every value exactly a bfloat16: an output read from a
    16-bit buffer, as it is or widened (a bfloat16 tensor reaches NumPy only through ``.float()``)."""
    if values.dtype == np.float16:
        return True
    if values.dtype not in (np.float32, np.float64):
        return False
    finite = values[np.isfinite(values)]
    as32 = finite.astype(np.float32)
    if not np.array_equal(as32, finite):
        return False
    with np.errstate(over="ignore"):
        if np.array_equal(as32.astype(np.float16).astype(np.float32), as32):
            return True
    return not (as32.view(np.uint32) & 0xFFFF).any()  # bfloat16: the upper half of a float32


def never_written(got, truth=None) -> np.ndarray:
    """Where ``got`` still holds the poison its buffer was filled with: POISON (in got's own dtype, so -inf in
    float16), or HALF_POISON in a 16-bit output, read as float16 or widened to float32 by ``.float()`` before
    the comparison (a grader compares bfloat16 outputs, and often float16 ones, that way). A value of
    -32768 in a 16-bit output is the poison, not a result, unless ``truth`` is itself about that there.

    Recognised here, once, for every grader: a widened 16-bit output holds -32768, never POISON, where it was
    never written; tested for POISON alone, it read as a wrong value, and the hints for elements never
    written (a BLOCK_M of the kernel's own, say) went missing on a GPU, where the attention graders use float16.
    """
    got = np.asarray(got)
    with np.errstate(over="ignore"):
        marks = got == np.asarray(POISON, dtype=got.dtype)
    if not np.issubdtype(got.dtype, np.floating):
        return marks
    half = got == HALF_POISON
    if half.any() and _sixteen_bit(got):
        if truth is not None:
            half &= ~np.isclose(np.asarray(truth, dtype=np.float64), HALF_POISON, rtol=2.0 ** -7, atol=0.0)
        marks = marks | half
    return marks


def _index(flat_i: int, shape) -> str:
    idx = np.unravel_index(flat_i, shape)
    return str(int(idx[0])) if len(shape) == 1 else str(tuple(int(i) for i in idx))


def exact_f32(x) -> np.ndarray:
    """Values rounded to float32 and back, in float64: exactly what learner code given float32 gets
    (the truth is computed from these)."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def tolerance_of(truth, reference, rtol_floor: float) -> float:
    """The graders' one tolerance rule: twice the worst error of ``reference`` (the same computation by
    PyTorch or NumPy at the output's precision) against the float64 ``truth``, and at least
    ``rtol_floor`` times the largest value of the truth."""
    truth = np.asarray(truth, dtype=np.float64)
    if not truth.size:
        return 0.0
    tol = rtol_floor * float(np.max(np.abs(truth)))
    if reference is not None:
        tol = max(tol, 2 * float(np.max(np.abs(np.asarray(reference, np.float64) - truth))))
    return tol


def compare(got, truth, reference=None, *, what: str, rtol_floor: float | None = None,
            dtype=None) -> tuple[bool, str]:
    """Compare ``got`` with a float64 ``truth``.

    The tolerance is twice the worst error of ``reference`` (the same computation done by PyTorch or
    NumPy at the output's precision), with a floor of one rounding step of the output dtype. ``dtype``,
    when given, is the dtype the output must have. Returns (passed, one line saying why).
    """
    got = np.asarray(got)
    truth = np.asarray(truth, dtype=np.float64)
    if got.shape != truth.shape:
        return False, f"{what}: shape {got.shape}, expected {truth.shape}"
    if dtype is not None and got.dtype != np.dtype(dtype):
        return False, f"{what}: dtype {got.dtype}, expected {np.dtype(dtype)}"
    g = got.astype(np.float64)
    unwritten = never_written(got, truth)
    if unwritten.all() and unwritten.size > 1:
        return False, f"{what}: no element of the output was written (is the kernel body still a stub?)"
    if unwritten.any():
        idx = np.flatnonzero(unwritten)
        return False, (f"{what}: {idx.size} of {got.size} elements never written "
                       f"(first at index {_index(idx[0], got.shape)})")
    bad = ~np.isfinite(g) & np.isfinite(truth)
    if bad.any():
        idx = np.flatnonzero(bad)
        return False, f"{what}: {idx.size} elements are NaN or Inf (first at index {_index(idx[0], got.shape)})"
    eps = float(np.finfo(got.dtype).eps) if np.issubdtype(got.dtype, np.floating) else 0.0
    tol = tolerance_of(truth, reference, rtol_floor if rtol_floor is not None else eps)
    err = np.abs(g - truth)
    worst = int(np.argmax(err)) if err.size else 0
    if err.size and err.flat[worst] > tol:
        return False, (f"{what}: max error {err.flat[worst]:.3g} at index {_index(worst, got.shape)} "
                       f"(expected {truth.flat[worst]:.6g}, got {g.flat[worst]:.6g}; tolerance {tol:.2g})")
    return True, f"{what}: all {got.size} elements match (max error {float(err.max()) if err.size else 0:.2g})"



def compare_returned(got, truth, reference, what: str, rtol_floor: float) -> tuple[bool, str]:
    """compare() of whatever learner code returned (a tensor of any device or dtype, an array, a
    number): a result that is not numbers says so; integers are compared as floats."""
    got = to_numpy(got)
    if got.dtype == object or not np.issubdtype(got.dtype, np.number):
        return False, f"{what}: got {type(got).__name__} of {got.dtype}, expected numbers"
    if not np.issubdtype(got.dtype, np.floating):
        got = got.astype(np.float64)
    return compare(got, truth, reference, what=what, rtol_floor=rtol_floor)


# ---- Triton kernels ----------------------------------------------------------------------------------

GUARD = 1024  # elements of frame after 1D data: at least the largest block a grader launches
NAN = float("nan")
LOG2E = 1.4426950408889634  # log2(e): a kernel computes exp(x) as exp2(x · log2 e)
LN2 = 0.6931471805599453  # ln(2): log(x) = log2(x) · ln 2
PAD = 0.5  # the frame of row-wise inputs: finite, so that reading it gives a wrong value the grader can name


def not_a_kernel(obj, name: str) -> str | None:
    """None if ``obj`` can be launched as ``obj[grid](...)``, else a line saying what to do."""
    if callable(obj) and hasattr(obj, "__getitem__") and hasattr(obj, "fn"):
        return None
    if callable(obj):
        return f"{name} is a plain Python function: decorate it with @triton.jit so it can be launched as {name}[grid](...)"
    return f"{name} is not a kernel (got {type(obj).__name__}): define it with @triton.jit"


def in_float32(grade):
    """A grader whose statement asks for float32 math: in the interpreter, a math function of the
    learner's kernel that gets float16 stops the launch (the interpreter would hide the lost precision)."""
    @functools.wraps(grade)
    def graded(report, **objects):
        with float32_math():
            return grade(report, **objects)
    return graded


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def framed(data: np.ndarray, dtype: str, fill: float, pad_rows: int = 0, pad_cols: int = 0):
    """``data`` on the device inside a larger tensor filled with ``fill``: returns (full, view).

    1D data gets ``GUARD`` elements after it; 2D data gets ``pad_cols`` extra columns (so its row
    stride is larger than its width) and ``pad_rows`` extra rows below; 3D data (heads, rows, cols)
    gets ``pad_rows`` extra rows below each head.
    """
    import torch

    dev, dt = world().device, torch_dtype(dtype)
    with np.errstate(over="ignore"):
        fill = float(np.asarray(fill, dtype=np.float16 if dtype == "fp16" else np.float32))  # poison -> -inf in fp16
    if data.ndim == 1:
        full = torch.full((data.size + GUARD,), fill, dtype=dt, device=dev)
        view = full[: data.size]
    elif data.ndim == 3:
        heads, rows, cols = data.shape
        full = torch.full((heads, rows + pad_rows, cols), fill, dtype=dt, device=dev)
        view = full[:, :rows]
    else:
        rows, cols = data.shape
        full = torch.full((rows + pad_rows, cols + pad_cols), fill, dtype=dt, device=dev)
        view = full[:rows, :cols]
    view.copy_(torch.from_numpy(data).to(dt))
    return full, view


def host(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def exact(t) -> np.ndarray:
    """The values a tensor holds, exactly, in float64 (the truth is computed from these)."""
    return host(t).astype(np.float64)


def launch(report: Report, what: str, kernel, grid, *args, **meta) -> bool:
    """Launch the learner's kernel; on an error, record one line that says what went wrong."""
    try:
        kernel[grid](*args, **meta)
        if world().gpu:
            import torch

            torch.cuda.synchronize()
        return True
    except Exception as exc:
        text = str(exc)
        if "Expected dtype ['fp32', 'fp64']" in text:
            hint = ("a math function (tl.erf, tl.exp, tl.sqrt...) got float16: convert what you load with "
                    "x.to(tl.float32) and compute in float32")
        elif "dot" in text and ("dtype" in text or "type" in text):
            hint = f"{explain(exc)}: both operands of tl.dot need one dtype; cast one with .to(other.dtype)"
        elif "unexpected keyword" in text or "missing" in text and "argument" in text:
            hint = f"{explain(exc)}; keep the kernel's signature as the exercise gives it"
        else:
            hint = explain(exc)
        report.fail(f"{what}: {hint}")
        return False


def outside_writes(full_before_fill: float, full, view_mask: np.ndarray) -> int:
    """How many elements of ``full`` outside the data (where ``view_mask`` is False) were changed."""
    h = host(full)
    poison = np.asarray(full_before_fill, dtype=h.dtype)
    return int(((h != poison) & ~view_mask).sum())


def nothing_written(got: np.ndarray) -> bool:
    """True when every element of the output still holds the poison (``never_written``): the kernel stored
    nothing."""
    return bool(np.all(never_written(got)))


STUB = "no element of the output was written (is the kernel body still a stub?)"


def data_mask(shape, rows: int, cols: int | None = None) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    if cols is None:
        m[:rows] = True
    else:
        m[:rows, :cols] = True
    return m


def rounding_floor(dtype) -> float:
    """The least tolerance, relative to the largest value: a few rounding steps of the output dtype.

    A kernel of several float32 operations is a few units in the last place from the truth, as is
    PyTorch, but not always at the same elements; on a GPU, Triton's exp, sqrt and division use the
    fast hardware approximations, good to about two units.
    """
    return float(np.finfo(dtype).eps) * (8 if np.dtype(dtype) == np.float32 else 2)


def tolerance(truth: np.ndarray, reference: np.ndarray, dtype) -> float:
    """compare()'s tolerance (the one rule, ``tolerance_of``) with rounding_floor() of the output dtype."""
    return tolerance_of(truth, reference, rounding_floor(dtype))


def to_numpy(x) -> np.ndarray:
    """A learner's result as a NumPy array (tensors of any device and dtype, arrays, numbers)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


@contextmanager
def unwritten_as_nan():
    """While inside, every tensor that torch.empty and its kin (empty_like, new_empty, empty_strided) make is
    filled with NaN: where a learner's launcher allocates its own output, an element its kernel never writes
    holds NaN, on the CPU and on any GPU (chapter 09).

    Why not trust, or poison, the memory itself: torch.empty gives whatever its allocator hands back, and
    PyTorch's caching allocator on a GPU hands back the block of a tensor freed a moment ago, holding its
    values. A grader's drawn input computed once before (a run repeated with KC_GRADE_SEED) left the right
    answer there, and a kernel that never wrote the last block passed; poisoning a block and freeing it just
    before the call relies on the allocator choosing that block next, which it need not. This is PyTorch's
    documented switch for the purpose (torch.utils.deterministic.fill_uninitialized_memory, which acts while
    deterministic algorithms are on; warn_only keeps learner code that uses a nondeterministic op running).
    """
    import torch

    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    det = torch.utils.deterministic
    fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():  # the switch is the grader's: its warnings are not the learner's to read
            warnings.filterwarnings("ignore", message=".*determinis", category=UserWarning)
            yield
    finally:
        det.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def largest_made(fn, *args):
    """Run fn(*args) and return (result, numel and shape of the largest tensor any op made): how a
    grader checks that learner code never holds a whole row or an N x N matrix (chapters 06-07)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel, self.shape = 0, ()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.shape = t.numel(), tuple(t.shape)
            return out

    with Largest() as mode:
        result = fn(*args)
    return result, mode.numel, mode.shape


def reproduces(got, wrong, truth=None, tol: float = 0.0) -> float | None:
    """How closely ``got`` reproduces the wrong result ``wrong`` (the largest difference), or None when it
    does not: the one diagnosis rule of the Triton graders.

    ``got`` reproduces ``wrong`` when it has NaN and Inf exactly where ``wrong`` does, and its finite
    elements are within ``2 * tol`` of it or, when ``truth`` is given, closer to it than a quarter of
    its distance from the truth (a mistake that barely changes the result on this input reproduces
    nothing; one that makes NaN or Inf where the truth has none is reproduced by the same NaN and Inf).
    """
    if wrong is None:
        return None
    g = np.asarray(to_numpy(got), dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.asarray(wrong, dtype=np.float64)
    if w.shape != g.shape or not np.array_equal(np.isfinite(g), np.isfinite(w)):
        return None
    finite = np.isfinite(g)
    if not finite.any():
        return 0.0
    distance = float(np.max(np.abs(g[finite] - w[finite])))
    if distance <= 2 * tol + 1e-12:
        return distance
    if truth is None:
        return None
    t = np.asarray(truth, dtype=np.float64)
    if t.shape != w.shape or not np.array_equal(np.isfinite(w), np.isfinite(t)):
        return distance  # the mistake makes NaN or Inf where the truth has none, and so did got
    apart = float(np.max(np.abs(w[finite] - t[finite])))
    scale = max(1e-30, float(np.max(np.abs(t[finite]))))
    return distance if apart > 1e-5 * scale and distance <= 0.25 * apart else None


def diagnose(got, mistakes, tol: float = 0.0, truth=None, first: bool = False) -> str | None:
    """The hint of the typical mistake, among ``mistakes`` (hint, wrong result or None), that ``got``
    reproduces most closely (``reproduces``), or None. With ``first``, the first one listed that it
    reproduces: for lists whose mistakes can give nearly the same result, the likelier listed first."""
    best, best_distance = None, np.inf
    for hint, wrong in mistakes:
        distance = reproduces(got, wrong, truth, tol)
        if distance is not None and first:
            return hint
        if distance is not None and distance < best_distance:
            best, best_distance = hint, distance
    return best


def compare_rows(got, truth, reference, what: str, mistakes_of=None, nonfinite: str = "") -> tuple[bool, str]:
    """compare() row by row (each row with its own scale), one line for the whole case.

    ``mistakes_of(i)`` lists (hint, wrong row i) to name a typical mistake in the first bad row;
    ``nonfinite`` is the hint for NaN or Inf in a row when no listed mistake explains them.
    """
    worst = 0.0
    for i in range(truth.shape[0]):
        ok, line = compare(got[i], truth[i], reference[i], what=f"{what}, row {i}", rtol_floor=rounding_floor(got.dtype))
        if not ok:
            hint = None
            if mistakes_of is not None and "never written" not in line and "stub" not in line:
                hint = diagnose(got[i], mistakes_of(i), tolerance(truth[i], reference[i], got.dtype))
            if hint is None and "NaN or Inf" in line:
                hint = nonfinite
            if hint:
                line += f": {hint}"
            return False, line
        worst = max(worst, float(np.max(np.abs(got[i].astype(np.float64) - truth[i]))) if truth[i].size else 0.0)
    return True, f"{what}: all {got.size} elements match (max error {worst:.2g})"


def rand(rng, shape, scales=(1.0, 3.0)):
    """Normal values with mixed scales (one scale: that scale), never exactly zero."""
    x = rng.standard_normal(shape) * (scales[0] if len(scales) == 1 else rng.choice(scales, size=shape))
    return np.where(np.abs(x) < 1e-3, 1e-3 + np.abs(x), x)


def sizes(cpu: list, gpu_extra: list) -> list:
    # The interpreter runs programs one after another in Python: small sizes on the CPU.
    return cpu + (gpu_extra if world().gpu else [])
