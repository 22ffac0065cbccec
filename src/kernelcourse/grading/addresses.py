"""Address checks for Triton kernels graded in the interpreter (introduced in chapter 04).

On a GPU, a load whose lanes point past the end of a tensor reads whatever lies there (a wrong
result) or faults (an illegal memory access). In Triton's interpreter on the CPU the same load
usually reads a neighbouring value without complaint, and if that value never reaches a stored
element the kernel passes. While ``checked()`` is active, every ``tl.load`` and ``tl.store`` of a
kernel launched in the interpreter is checked before it runs: each lane its mask lets through must
lie inside one of the tensors the launch was given, else the launch stops with an ``AddressError``
naming the load, the tensor it ran past and the mask it lacks.

``float32_math()`` checks, the same way, that arithmetic a statement asks for in float32 is not done
in float16.

On a GPU the address check is NVIDIA's compute-sanitizer: ``compute-sanitizer --tool memcheck python
my_kernel.py`` reports every out-of-bounds lane of every load and store, with the kernel's name.
"""
from __future__ import annotations

import linecache
import os
import sys
from contextlib import contextmanager

import numpy as np

SANITIZER = "on a GPU, run your script under `compute-sanitizer --tool memcheck python script.py` to check the same"


class AddressError(Exception):
    """A lane of a load or store pointed outside every tensor the kernel was given."""


_launch_tensors: list[tuple[str, int, int]] = []  # (name, first byte, one past the last byte) of this launch


def _extent(t) -> tuple[int, int]:
    """The bytes a tensor (or view) may address: from its first element to one past its last."""
    size = t.element_size()
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    lo = hi = 0
    for n, s in zip(t.shape, t.stride()):
        (lo, hi) = (lo + (n - 1) * s, hi) if s < 0 else (lo, hi + (n - 1) * s)
    return t.data_ptr() + lo * size, t.data_ptr() + (hi + 1) * size


def _tensors(names, args, kwargs):
    found = []

    def visit(name, arg):
        if isinstance(arg, tuple):
            for i, a in enumerate(arg):
                visit(f"{name}[{i}]", a)
        elif hasattr(arg, "data_ptr") and hasattr(arg, "element_size"):
            found.append((name, *_extent(arg)))
        elif hasattr(arg, "base") and hasattr(arg.base, "data_ptr"):  # a tensor descriptor: its base tensor
            visit(name, arg.base)

    for name, arg in zip(names, args):
        visit(name, arg)
    for name, arg in kwargs.items():
        visit(name, arg)
    return found


def _learner_line() -> str:
    """" at line 12 (`x = tl.load(x_ptr + offs)`)": the kernel's source line running the access."""
    import triton

    skip = (os.path.dirname(triton.__file__), os.path.dirname(__file__))
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip):
            text = linecache.getline(filename, frame.f_lineno).strip()
            return f" at line {frame.f_lineno}" + (f" (`{text}`)" if text else "")
        frame = frame.f_back
    return ""


def _check(kind: str, ptrs, mask, itemsize: int, masked: bool) -> None:
    p = np.asarray(ptrs).astype(np.uint64, copy=False).ravel()
    m = np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).ravel() if mask is not None else None
    live = p if m is None else p[m]
    if live.size == 0 or not _launch_tensors:
        return
    inside = np.zeros(live.shape, dtype=bool)
    for _, lo, hi in _launch_tensors:
        inside |= (live >= lo) & (live + itemsize <= hi)
    if inside.all():
        return
    bad = live[~inside]
    first = int(bad[0])
    # name the tensor the lanes ran past: the nearest one that ends at or below them, else the next one
    below = [(first - hi, name) for name, lo, hi in _launch_tensors if lo <= first and hi < first + itemsize]
    above = [(lo - first, name) for name, lo, hi in _launch_tensors if lo > first]
    place = (f"past the end of `{min(below)[1]}`" if below else
             f"before the start of `{min(above)[1]}`" if above else "outside every tensor")
    verb = "reads" if kind == "load" else "writes"
    why = "its mask lets them through" if masked else "it has no mask"
    raise AddressError(f"tl.{kind}{_learner_line()} {verb} {bad.size} lane(s) {place}, outside every tensor "
                       f"the kernel was given ({why}): on a GPU that is a wrong result or an illegal memory "
                       "access; its mask must be False for every lane past the end of the data "
                       "(e.g. `offs < n`; in 2D, rows and columns both)")


@contextmanager
def checked():
    """Check every load and store of Triton kernels launched in the interpreter while this is active.

    Does nothing where Triton is not running in its interpreter (on a GPU, use compute-sanitizer).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # no Triton: nothing to check
        yield
        return
    cls, grid = ti.InterpreterBuilder, ti.GridExecutor
    saved = {name: getattr(cls, name) for name in ("create_load", "create_store", "create_masked_load",
                                                     "create_masked_store")}
    saved_init = grid._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        _launch_tensors[:] = _tensors(self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    def itemsize(ptrs) -> int:
        return np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize

    def create_load(self, ptr, *args, **kwargs):
        _check("load", ptr.data, None, itemsize(ptr), masked=False)
        return saved["create_load"](self, ptr, *args, **kwargs)

    def create_store(self, ptr, *args, **kwargs):
        _check("store", ptr.data, None, itemsize(ptr), masked=False)
        return saved["create_store"](self, ptr, *args, **kwargs)

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        _check("load", ptrs.data, mask.data, itemsize(ptrs), masked=True)
        return saved["create_masked_load"](self, ptrs, mask, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check("store", ptrs.data, mask.data, itemsize(ptrs), masked=True)
        return saved["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

    cls.create_load, cls.create_store = create_load, create_store
    cls.create_masked_load, cls.create_masked_store = create_masked_load, create_masked_store
    grid._init_args_hst = init_args
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
        grid._init_args_hst = saved_init
        _launch_tensors.clear()


@contextmanager
def traffic():
    """Count, while active, the lanes that the ``tl.load`` and ``tl.store`` calls of kernels launched in the
    interpreter move, per kernel and argument: yields a ``Counter`` of ``(kernel name, argument name, "load"
    or "store") -> lanes`` (masked-off lanes not counted), filled as kernels run. Yields None where Triton
    is not running in its interpreter.

    What a grader reads it for: memory traffic a correct kernel never makes (a load of its own partial
    sums, say), visible here whatever the speed of the machine.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield None
        return
    from collections import Counter

    from triton.runtime import interpreter as ti

    counts: Counter = Counter()
    tensors: list[tuple[str, int, int]] = []
    kernel = [""]  # the name of the kernel running
    cls, grid = ti.InterpreterBuilder, ti.GridExecutor
    saved = {name: getattr(cls, name) for name in ("create_load", "create_store", "create_masked_load",
                                                     "create_masked_store")}
    saved_init = grid._init_args_hst

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = saved_init(self, args_dev, kwargs)
        tensors[:] = _tensors(self.arg_names, args_hst, kwargs_hst)
        kernel[0] = getattr(self.fn, "__name__", "")
        return args_hst, kwargs_hst

    def count(kind, ptrs, mask):
        p = np.asarray(ptrs).astype(np.uint64, copy=False).ravel()
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask, dtype=bool), np.shape(ptrs)).ravel()]
        for name, lo, hi in tensors:
            n = int(((p >= lo) & (p < hi)).sum())
            if n:
                counts[(kernel[0], name, kind)] += n

    def create_load(self, ptr, *args, **kwargs):
        count("load", ptr.data, None)
        return saved["create_load"](self, ptr, *args, **kwargs)

    def create_store(self, ptr, *args, **kwargs):
        count("store", ptr.data, None)
        return saved["create_store"](self, ptr, *args, **kwargs)

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        count("load", ptrs.data, mask.data)
        return saved["create_masked_load"](self, ptrs, mask, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        count("store", ptrs.data, mask.data)
        return saved["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

    cls.create_load, cls.create_store = create_load, create_store
    cls.create_masked_load, cls.create_masked_store = create_masked_load, create_masked_store
    grid._init_args_hst = init_args
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(cls, name, fn)
        grid._init_args_hst = saved_init


def compiled_function(kernel):
    """The JITFunction (or, in the interpreter, the InterpretedFunction) that launching ``kernel`` runs: under
    autotune or heuristics wrappers, or inside a wrapper that binds constexprs and keeps it as ``.kernel``."""
    from ..targets import _jit_function

    fn = _jit_function(kernel)
    if not hasattr(fn, "arg_names"):  # a plain function under a wrapper (JITFunction.kernel is None: not that)
        inner = getattr(kernel, "kernel", None)
        fn = _jit_function(inner) if inner is not None else fn
    return fn


def loads_in_compiled(kernel, arg: str) -> int | None:
    """How many ``tl.load`` calls, in the code Triton compiled for ``kernel`` on this GPU (every variant it
    compiled: its Triton IR, where branches on constexprs are already gone), read through a pointer made
    from argument ``arg``. None when nothing was compiled (in the interpreter, or before a launch)."""
    fn = compiled_function(kernel)
    texts = []
    for caches in list(getattr(fn, "device_caches", {}).values()):
        kernels = caches[0].values() if caches and isinstance(caches[0], dict) else []
        texts += [k.asm.get("ttir") for k in kernels if isinstance(getattr(k, "asm", None), dict)]
    texts = [t for t in texts if t]
    return max(loads_through(t, arg) for t in texts) if texts else None


def loads_through(ttir: str, arg: str) -> int:
    """The ``tt.load`` operations of Triton IR text ``ttir`` whose pointer derives from argument ``arg``
    (through ``tt.addptr``, ``tt.splat``, ``tt.broadcast``, ``tt.expand_dims``, ``tt.reshape``, and the
    loop variables of ``scf.for`` it starts)."""
    import re

    derived = {f"%{arg}"}
    assign = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)? = tt\.(addptr|splat|broadcast|expand_dims|reshape|advance)\s+(%[\w.$-]+)")
    loop_var = re.compile(r"(%[\w.$-]+) = (%[\w.$-]+)")
    lines = ttir.splitlines()
    for _ in range(len(lines)):  # to a fixed point: an scf.for can carry a pointer made below its line
        before = len(derived)
        for line in lines:
            m = assign.match(line)
            if m and m.group(3) in derived:
                derived.add(m.group(1))
            if "scf.for" in line and "iter_args(" in line:
                for var, init in loop_var.findall(line.split("iter_args(", 1)[1]):
                    if init in derived:
                        derived.add(var)
        if len(derived) == before:
            break
    load = re.compile(r"= tt\.load (%[\w.$-]+)")
    return sum(1 for line in lines for m in [load.search(line)] if m and m.group(1) in derived)


# ---- float32 math ----------------------------------------------------------------------------------

MATH = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "sqrt": "tl.sqrt",
        "precise_sqrt": "tl.sqrt_rn", "rsqrt": "tl.rsqrt", "erf": "tl.erf", "fadd": "+", "fsub": "-",
        "fmul": "*", "fdiv": "/", "precise_divf": "tl.div_rn", "fma": "tl.fma"}


class PrecisionError(Exception):
    """Arithmetic of a kernel that must compute in float32 got a 16-bit float."""


@contextmanager
def float32_math():
    """While active, arithmetic (+, -, *, /) or a math function (tl.exp, tl.log, tl.sqrt, ...) of a
    kernel launched in the interpreter that gets float16 or bfloat16 stops the launch with a
    ``PrecisionError`` naming the line.

    For exercises whose statement asks for float32 math: the interpreter's float16 results can stay
    within a tolerance that a GPU's would not, so this check looks at the dtype instead.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        from triton.runtime import interpreter as ti
    except Exception:
        yield
        return
    cls = ti.InterpreterBuilder
    saved = {name: getattr(cls, f"create_{name}") for name in MATH}

    def checking(name, original):
        def create(self, arg, *rest):
            if arg.dtype.is_fp16() or arg.dtype.is_bf16():
                raise PrecisionError(
                    f"`{MATH[name]}`{_learner_line()} computes in {arg.dtype}: do the math in float32, as the "
                    "statement asks (convert what you load with x.to(tl.float32), and convert back only when "
                    "storing)")
            return original(self, arg, *rest)
        return create

    for name, original in saved.items():
        setattr(cls, f"create_{name}", checking(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(cls, f"create_{name}", original)


def interpreter_error(exc: BaseException) -> Exception | None:
    """The ``AddressError`` or ``PrecisionError`` behind ``exc`` (the interpreter wraps them), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (AddressError, PrecisionError)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
