"""The two worlds a notebook runs in (introduced in chapter 01).

On a machine with a CUDA GPU, kernels compile and run for real. Without one, Triton kernels run in
Triton's interpreter (``TRITON_INTERPRET=1``) and numba CUDA kernels in numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``). Both switches are read when a kernel is defined or numba is imported, so
``setup()`` must run first: it is the first code cell of every notebook.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import sys
import warnings
from dataclasses import dataclass, field

_SIM_VARS = ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")


@dataclass(frozen=True)
class World:
    gpu: bool                      # True when kernels run on a real CUDA GPU
    device: str                    # "cuda" or "cpu": where tensors for kernels live
    name: str                      # GPU name, or "CPU"
    capability: tuple[int, int] | None
    versions: dict = field(default_factory=dict)

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else "none"


_current: World | None = None


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "not installed"


def versions() -> dict:
    """Versions that matter for reproducing a result, read without importing triton or numba."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "numba-cuda": _version("numba-cuda"),
        "cuda": torch.version.cuda or "none",
    }


def _enter_simulation() -> None:
    if "numba" in sys.modules:
        from numba import config

        if not config.ENABLE_CUDASIM:
            raise RuntimeError(
                "numba was imported before kc.setup() and is not in its CUDA simulator. "
                "Restart the kernel and run the setup cell before anything imports numba."
            )
    for var in _SIM_VARS:
        os.environ[var] = "1"


def _leave_simulation() -> None:
    for var in _SIM_VARS:
        if os.environ.pop(var, "0") == "1" and var == "NUMBA_ENABLE_CUDASIM" and "numba" in sys.modules:
            raise RuntimeError("numba was imported in simulator mode; restart the kernel to use the GPU.")


def setup(world: str | None = None, quiet: bool = False) -> World:
    """Pick the world, switch the interpreter and simulator on or off, and print what was picked.

    ``world`` is "auto" (the default: the GPU if torch sees one), "gpu" or "cpu". The environment
    variable ``KC_WORLD`` sets the default, e.g. ``KC_WORLD=cpu`` to try the CPU path on a GPU machine.
    """
    global _current
    choice = (world or os.environ.get("KC_WORLD") or "auto").lower()
    if choice not in ("auto", "gpu", "cpu"):
        raise ValueError(f"world must be 'auto', 'gpu' or 'cpu', not {choice!r}")
    import torch

    has_gpu = torch.cuda.is_available()
    if choice == "gpu" and not has_gpu:
        raise RuntimeError("a GPU world was asked for, but torch sees no CUDA GPU")
    gpu = has_gpu if choice == "auto" else choice == "gpu"
    if gpu:
        _leave_simulation()
        props = torch.cuda.get_device_properties(0)
        w = World(True, "cuda", props.name, (props.major, props.minor), versions())
    else:
        _enter_simulation()
        w = World(False, "cpu", "CPU", None, versions())
    _current = w
    # Small teaching launches trip numba's occupancy warning; it is true and beside the point here.
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization.*")
    if not quiet:
        print(banner(w))
        if problem := _known_problem(w):
            print(f"Warning: {problem}")
    return w


def _known_problem(w: World) -> str | None:
    """Version combinations known to break the course's tools, with what to do about them."""
    import numpy

    major_minor = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if w.versions["numba-cuda"] != "not installed" and major_minor >= (2, 5):
        return (f"numpy {numpy.__version__} breaks numba-cuda {w.versions['numba-cuda']} (its CUDA kernels fail "
                "to compile); install numpy<2.5 (`pip install 'numpy>=2,<2.5'`) and restart the kernel.")
    if not w.gpu and major_minor >= (2, 4) and w.versions["triton"].startswith("3.6"):
        return f"numpy {numpy.__version__} breaks Triton 3.6's interpreter; install numpy<2.4 and restart the kernel."
    return None


def world() -> World:
    """The world ``setup()`` picked (calls it quietly if no notebook cell has yet)."""
    return _current if _current is not None else setup(quiet=True)


def banner(w: World) -> str:
    v = w.versions
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if w.gpu:
        import torch

        props = torch.cuda.get_device_properties(0)
        where = (f"GPU: {w.name} · compute capability {w.capability[0]}.{w.capability[1]} · "
                 f"{props.multi_processor_count} SMs · {props.total_memory / 2**30:.0f} GiB")
        note = "Kernels compile and run on this GPU; timings are measured now."
    else:
        where = "CPU (no CUDA GPU): Triton runs in its interpreter, CUDA kernels in numba's simulator"
        note = "Kernels run for correctness only; timing cells show results recorded on a GPU."
    versions_line = " · ".join(f"{k} {v[k]}" for k in ("python", "torch", "triton", "numba", "numba-cuda", "cuda"))
    return f"{where}\n{versions_line}\n{note}\nRun on {stamp}"
