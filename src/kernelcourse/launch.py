"""Launching a compiled Triton kernel without what ``kernel[grid](...)`` repeats on every call (chapter 09).

``kernel[grid](*args)`` runs ``JITFunction.run``: it binds the arguments to the kernel's signature, works
out how each one specialises the compiled code, builds a cache key from that and looks the compiled
kernel up, reads its options and hooks, and only then launches. For a kernel of a few microseconds that
is most of a call. A lean launcher already knows, from its own cache key, everything that decides which
compiled kernel runs; ``direct`` then launches the compiled kernel itself, the call that
``JITFunction.run`` ends in. Where the key does not capture all of Triton's specialisation the result
could come from a kernel compiled for other arguments, so the key is built with ``specialization``:

- a tensor: its dtype (the caller's key holds it) and whether its address is a multiple of 16 bytes;
- an integer: whether it is 1 (compiled in as a constant), a multiple of 16, or too large for 32 bits;
- a float: nothing (Triton does not specialise on floats);
- a tensor descriptor: its dtype and block shape (the caller's key holds them).

The first call of a key goes through ``kernel.run`` (which compiles, or finds the kernel in Triton's own
cache) and keeps the compiled kernel. Launch hooks (a profiler such as Proton sets them) and Triton's
interpreter take the ordinary path every time.

The direct launch is switched on by the environment variable ``KC_DIRECT_LAUNCH=1`` (read at import). Off,
every launch goes through ``kernel.run``, as Triton's own launches do: it is what the lessons were measured
with, and the baseline a direct launch is measured against (``KC_DIRECT_LAUNCH=1 python
tools/launch_cost.py`` against the same command without it).
"""
from __future__ import annotations

import inspect
import os

import triton

__all__ = ["specialization", "direct", "DIRECT"]

DIRECT: dict = {}  # (kernel, key) -> _Compiled
ENABLED = os.environ.get("KC_DIRECT_LAUNCH", "0") == "1"


def specialization(*values) -> tuple:
    """What Triton's compiled code depends on in these argument values, as a hashable tuple (see above)."""
    out = []
    for v in values:
        if isinstance(v, bool) or v is None or isinstance(v, float):
            out.append(None)
        elif isinstance(v, int):
            out.append(1 if v == 1 else (16 if v % 16 == 0 else 0) + (64 if not -(2**31) <= v < 2**31 else 0))
        elif hasattr(v, "data_ptr"):  # a tensor
            out.append(v.data_ptr() % 16 == 0)
        else:  # a tensor descriptor: its dtype and block shape are the caller's key
            out.append(None)
    return tuple(out)


class _Compiled:
    """One compiled kernel, the tail of its arguments (the constexprs, in the signature's order), and the
    driver's functions that give the current device and its stream (the ones ``JITFunction.run`` calls)."""
    __slots__ = ("launcher", "function", "packed", "tail", "device", "stream")

    def __init__(self, compiled, tail: tuple):
        from triton.runtime import driver

        self.launcher = compiled.run       # Triton's launcher for this kernel (loads the binary if not yet)
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.tail = tail
        self.device, self.stream = driver.active.get_current_device, driver.active.get_current_stream


def _tail(kernel, n_args: int, consts: dict) -> tuple:
    """The values of the kernel's parameters after the first ``n_args``, from ``consts`` or their defaults."""
    params = list(inspect.signature(kernel.fn).parameters.values())[n_args:]
    return tuple(consts[p.name] if p.name in consts else p.default for p in params)


def _set(hook) -> bool:
    """Whether a launch hook is set: None or an empty chain of hooks (Triton 3.5 and newer) is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is None or _set(runtime.launch_enter_hook) or _set(runtime.launch_exit_hook)


def direct(kernel, key: tuple, grid: tuple, args: tuple, consts: dict) -> None:
    """``kernel[grid](*args, **consts)`` on a GPU, the compiled kernel launched directly once ``key`` has run.

    ``kernel`` is a ``triton.jit`` function (not an autotuner); ``args`` are its leading arguments, in
    order; ``consts`` its constexprs and launch options (num_warps, num_stages); ``key`` must determine
    the device, the constexprs and every specialisation (see ``specialization``) of the compiled kernel:
    a compiled kernel is loaded on one GPU.
    """
    entry = DIRECT.get((kernel, key)) if ENABLED else None
    if entry is None or _hooked():
        compiled = kernel.run(*args, grid=grid, warmup=False, **consts)
        if ENABLED and entry is None and compiled is not None and hasattr(compiled, "packed_metadata"):
            DIRECT[(kernel, key)] = _Compiled(compiled, _tail(kernel, len(args), consts))
        return
    g = tuple(grid) + (1, 1)
    entry.launcher(g[0], g[1], g[2], entry.stream(entry.device()), entry.function, entry.packed, None, None, None,
                   *args, *entry.tail)
