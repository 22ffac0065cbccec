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
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

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

    @property
    def has_bf16(self) -> bool:
        """bfloat16 arithmetic on this GPU: compute capability 8.0 (Ampere) and newer; not the T4, not
        Triton's interpreter."""
        return self.gpu and self.capability is not None and tuple(self.capability) >= (8, 0)


_current: World | None = None


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "not installed"


# What a stamp, a recorded result and the setup banner record. Each of these can change a result the
# course shows: numpy (chapter 01 broke on numpy 2.5), the compilers (triton, numba-cuda, nvcc), the
# libraries timed as peers (torch, CuPy) and, on a GPU, the driver that JIT-compiles PTX.
VERSION_KEYS = ("python", "numpy", "torch", "triton", "numba", "numba-cuda", "cupy", "cuda", "nvcc", "driver")


def versions() -> dict:
    """Versions that can change a result, read without importing triton or numba (chapter 01 shows them)."""
    import numpy
    import torch

    return {
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numba": _version("numba"),
        "numba-cuda": _version("numba-cuda"),
        "cupy": next((v for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if (v := _version(d)) != "not installed"),
                     "not installed"),
        "cuda": torch.version.cuda or "none",
        "nvcc": _nvcc_version(),
        "driver": _driver_version(),
    }


def nvcc() -> str | None:
    """The path of CUDA's compiler nvcc on this machine, or None (``kc.cuda_cpp`` compiles with it)."""
    import shutil

    return shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.exists()), None)


def _nvcc_version() -> str:
    exe = nvcc()
    if exe is None:
        return "not installed"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"release ([\d.]+)", out)
    return match.group(1) if match else "unknown"


def _driver_version() -> str:
    """The NVIDIA driver's version, e.g. "580.95.05" ("none" on a machine without one; Linux only)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "none"
    match = re.search(r"Kernel Module(?: for \w+)?\s+([\d.]+)", text)
    return match.group(1) if match else "unknown"


def _release(version: str) -> tuple[int, ...]:
    """(2, 5, 2) from "2.5.2", (0, 30, 4) from "0.30.4", (2, 6, 0) from "2.6.0rc1", to compare releases."""
    return tuple(int(m.group()) for part in version.split("+")[0].split(".")[:3] if (m := re.match(r"\d+", part)))


# numba-cuda up to 0.30.4, the newest release as of November 2026, registers its GPU version of
# np.row_stack whenever numpy >= 2.0 (numba_cuda/numba/cuda/np/arrayobj.py: `if numpy_version >= (2, 0):
# overload(np.row_stack)(...)`). numpy 2.5 removed np.row_stack, so on a real GPU the first @cuda.jit
# kernel fails to compile with "module 'numpy' has no attribute 'row_stack'". numba 0.68.1 fixed the
# same line in numba itself (`and numpy_version < (2, 5)`). Until a numba-cuda release does too,
# setup() imports that one module with a stand-in np.row_stack and removes the stand-in right after:
# numpy is left as it was (code that calls np.row_stack still fails, as numpy 2.5 means it to), the
# stand-in is only registered, never called, and nothing else in numba changes.
# Remove this when the course can require a numba-cuda release that checks for numpy < 2.5; raise the
# bound below if a newer release still breaks (tests/test_package.py checks the installed one).
NUMBA_CUDA_ROW_STACK_LAST_BROKEN = (0, 30, 4)


def numba_cuda_needs_row_stack() -> bool:
    """True when this numba-cuda would ask numpy for np.row_stack, and this numpy has none."""
    import numpy

    version = _version("numba-cuda")
    return (not hasattr(numpy, "row_stack") and version != "not installed"
            and _release(version) <= NUMBA_CUDA_ROW_STACK_LAST_BROKEN)


def _import_numba_cuda_with_row_stack() -> None:
    """Import numba-cuda's array module with np.row_stack present for that import only (see above)."""
    import numpy

    if "numba.cuda.np.arrayobj" in sys.modules:
        return

    def row_stack(tup, *, dtype=None, casting="same_kind"):  # registered by numba-cuda, never called
        return numpy.vstack(tup, dtype=dtype, casting=casting)

    numpy.row_stack = row_stack
    try:
        import numba.cuda.np.arrayobj  # noqa: F401
    except ModuleNotFoundError as exc:
        # numba-cuda is installed but not in use: its .pth redirect of numba.cuda was not read (its
        # site-packages joined the path as a plain folder), so numba's own CUDA target runs, which
        # never registers row_stack. Nothing to do.
        if exc.name is None or not exc.name.startswith("numba.cuda"):
            raise
    finally:
        del numpy.row_stack


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
    too_old = has_gpu and choice == "auto" and _too_old_to_serve()
    gpu = (has_gpu and not too_old) if choice == "auto" else choice == "gpu"
    if gpu:
        _leave_simulation()
        if numba_cuda_needs_row_stack():
            _import_numba_cuda_with_row_stack()
        props = torch.cuda.get_device_properties(0)
        w = World(True, "cuda", props.name, device_capability(0), versions())
        _limit_shared_memory()
    else:
        _enter_simulation()
        w = World(False, "cpu", "CPU", None, versions())
    _current = w
    # Small teaching launches trip numba's occupancy warning; it is true and beside the point here.
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization.*")
    # The autograd engine runs a GPU backward on a thread of its own; the first cuBLAS call there makes the
    # GPU's primary context current on that thread, and PyTorch says so once. Nothing is wrong.
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    if not quiet:
        if too_old:
            print(too_old)
        print(banner(w))
        if problem := _known_problem(w):
            print(f"Warning: {problem}")
    return w


# Triton's interpreter up to 3.6 turns one-element arrays into Python numbers, which numpy 2.4 made an
# error ("only 0-dimensional arrays can be converted to Python scalars"): on the CPU, Triton kernels
# (chapters 04-06) fail. Chapters 01-03 and every GPU are unaffected. Numpy 2.5 and numba-cuda 0.30.4 are
# made to work together above, so that pair needs no warning.
TRITON_INTERPRETER_NUMPY_2_4_FIXED_IN = (3, 7)  # 3.7.1 and 3.8.0 checked


def _known_problem(w: World) -> str | None:
    """A version combination that cannot run the course, with exactly what to run about it."""
    import numpy

    triton = _version("triton")
    if (not w.gpu and triton != "not installed" and _release(numpy.__version__) >= (2, 4)
            and _release(triton) < TRITON_INTERPRETER_NUMPY_2_4_FIXED_IN):
        return (f"numpy {numpy.__version__} breaks the interpreter of Triton {triton}, which runs Triton kernels "
                "on the CPU (chapters 04-06). Run  %pip install \"numpy>=2,<2.4\"  in a cell, restart the kernel "
                "(on Colab: Runtime > Restart session), then run the notebook again from the top.")
    return _older_than_supported()


_said_fp16 = False


def low_precision_dtype(w: World | None = None):
    """The 16-bit dtype the course computes in where a chapter says "bf16" (chapters 07-09).

    bfloat16 on a GPU that has it; float16 on an older GPU such as the T4 (said once); float32 in the CPU
    world, whose interpreter has no bfloat16 and where only correctness is checked.
    """
    global _said_fp16
    import torch

    w = w or world()
    if not w.gpu:
        return torch.float32
    if w.has_bf16:
        return torch.bfloat16
    if not _said_fp16:
        _said_fp16 = True
        print(f"Note: {w.name} (compute capability {w.capability[0]}.{w.capability[1]}) has no bfloat16; "
              "the course computes in float16 here instead, and compares every method in float16 too.")
    return torch.float16


def world() -> World:
    """The world ``setup()`` picked (calls it quietly if no notebook cell has yet)."""
    return _current if _current is not None else setup(quiet=True)


def host_cpu() -> str:
    """The host's CPU model and how many logical cores this process may use: the CPU sets what a kernel
    launch costs, so a call timed from Python depends on it as much as on the GPU (chapters 08 and 09)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1] for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    name = " ".join(name.split()) or platform.processor() or platform.machine() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} · {cores} logical cores"


def banner(w: World) -> str:
    v = w.versions
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if w.gpu:
        import torch

        props = torch.cuda.get_device_properties(0)
        where = (f"GPU: {w.name} · compute capability {w.capability[0]}.{w.capability[1]} · "
                 f"{props.multi_processor_count} SMs · {props.total_memory / 2**30:.0f} GiB")
        if _env_capability():
            where += f" (run as compute capability {w.capability[0]}.{w.capability[1]}: KC_MAX_CAPABILITY)"
        where += f"\nHost CPU: {host_cpu()}"
        note = "Kernels compile and run on this GPU; timings are measured now."
    else:
        where = "CPU (no CUDA GPU): Triton runs in its interpreter, CUDA kernels in numba's simulator"
        note = "Kernels run for correctness only; timing cells show results recorded on a GPU."
    versions_line = " · ".join(f"{k} {v[k]}" for k in ("python", "numpy", "torch", "triton", "numba", "numba-cuda",
                                                         "cuda"))
    return f"{where}\n{versions_line}\n{note}\nRun on {stamp}"


# ---- GPUs the course does not serve, and running as an older GPU (tools/gpu_check.py --pre-hopper) -----

OLDEST_CAPABILITY = (7, 5)  # the T4: Triton compiles for compute capability 7.5 and newer


def _too_old_to_serve() -> str | None:
    """One sentence for a GPU older than the course supports, or None. Triton does not compile for it, so
    the notebooks run in the CPU world there, as on a machine without a GPU."""
    import torch

    props = torch.cuda.get_device_properties(0)
    if (props.major, props.minor) >= OLDEST_CAPABILITY:
        return None
    return (f"This GPU, {props.name} (compute capability {props.major}.{props.minor}), is older than the course "
            "supports (7.5, the T4, and newer: Triton compiles for nothing older), so the notebooks run as on a "
            "machine without a GPU: Triton kernels in its interpreter, CUDA kernels in numba's simulator, timings "
            "recorded on a GPU. On Colab, pick a T4 or newer GPU under Runtime > Change runtime type.")


def _env_capability() -> tuple[int, int] | None:
    """``KC_MAX_CAPABILITY`` (e.g. "8.0"): the course treats the GPU as one of at most this compute capability."""
    text = os.environ.get("KC_MAX_CAPABILITY", "").strip()
    if not text:
        return None
    match = re.fullmatch(r"(\d+)\.(\d)", text)
    if not match:
        raise ValueError(f"KC_MAX_CAPABILITY={text!r}: write a compute capability such as 8.0")
    return int(match.group(1)), int(match.group(2))


def own_capability(device=None) -> tuple[int, int] | None:
    """The GPU's own compute capability, as torch reads it, whatever ``KC_MAX_CAPABILITY`` says (what Triton
    compiles for); None without CUDA."""
    import torch

    return tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else None


def device_capability(device=None) -> tuple[int, int]:
    """The GPU's compute capability as the course's choices should see it: torch's, or less where
    ``KC_MAX_CAPABILITY`` says so. ``tools/gpu_check.py --pre-hopper`` sets 8.0 (with Triton's
    ``DISABLE_MMA_V3=1``), so that an H100 takes the paths an A100 or an L4 takes: the attention versions
    that load through pointers, Ampere's mma.sync, float16 or bfloat16 as there."""
    import torch

    real = tuple(torch.cuda.get_device_capability(device))
    limit = _env_capability()
    return min(real, limit) if limit else real


def _triton_flag(name: str) -> bool:
    """A switch that Triton's compiler reads from the environment, as it reads it (getBoolEnv: 1, true, on)."""
    return os.environ.get(name, "").lower() in ("1", "true", "on")


def pre_hopper_emulation(capability: tuple[int, int] | None = None) -> str | None:
    """Why the speed of Triton's tl.dot here is not a GPU's own, or None: on a Hopper GPU (compute capability
    9.x; ``capability`` is the GPU's own, KC_MAX_CAPABILITY aside, torch's by default) with Triton's
    ``DISABLE_MMA_V3`` set, as ``tools/gpu_check.py --pre-hopper`` and ``--as-t4`` set it.

    There Triton compiles tl.dot to Ampere's mma.sync instead of Hopper's wgmma, so that the course's
    kernels take the path of the GPUs before Hopper; the flag reaches only what Triton compiles. cuBLAS and
    SDPA's attention kernels were compiled ahead of time and run as they do on Hopper: a speed check of a
    Triton kernel against one of them compares a held-back kernel with an unhindered one, which is neither
    what a Hopper GPU nor what an A100, an L4 or a T4 measures. (On a Blackwell GPU the flag changes
    nothing: Triton's tl.dot is tcgen05 there.)
    """
    if not _triton_flag("DISABLE_MMA_V3"):
        return None
    capability = capability or own_capability()
    if capability is None or capability[0] != 9:
        return None
    return (f"DISABLE_MMA_V3 (gpu_check --pre-hopper or --as-t4) holds Triton's tl.dot to Ampere's mma.sync on "
            f"this Hopper GPU (compute capability {capability[0]}.{capability[1]}), while library code runs as "
            f"built for Hopper")


_gpu_properties: dict[int, dict] = {}


def gpu_properties(device_index: int | None = None) -> dict:
    """Triton's properties of a GPU (``max_shared_mem``: bytes of shared memory per block, as
    ``KC_MAX_SHARED_MEM`` may lower it; ``multiprocessor_count``: its SMs), asked once per GPU: the
    launchers read them on every call, and a driver query is not free."""
    import torch

    index = torch.cuda.current_device() if device_index is None else device_index
    if index not in _gpu_properties:
        import triton

        _gpu_properties[index] = triton.runtime.driver.active.utils.get_device_properties(index)
    return _gpu_properties[index]


def shared_memory_limit() -> int | None:
    """``KC_MAX_SHARED_MEM``: bytes of shared memory per block the course's GPU world allows (None: the GPU's)."""
    text = os.environ.get("KC_MAX_SHARED_MEM", "").strip()
    return int(text) if text else None


def _limit_shared_memory() -> None:
    """Under ``KC_MAX_SHARED_MEM``, Triton reports at most that much shared memory per block, so that its own
    launch check (OutOfResources) and every autotune pruner that reads it treat a kernel as on a smaller GPU."""
    limit = shared_memory_limit()
    if limit is None:
        return
    import triton

    utils = triton.runtime.driver.active.utils
    real = getattr(utils.get_device_properties, "__wrapped__", utils.get_device_properties)

    def get_device_properties(device):
        props = dict(real(device))
        props["max_shared_mem"] = min(props["max_shared_mem"], limit)
        return props

    get_device_properties.__wrapped__ = real
    utils.get_device_properties = get_device_properties


# ---- the oldest releases the course runs on -----------------------------------------------------------
# The oldest torch and triton the course is checked on (the `test-oldest` CI job, `make test-oldest`).
# Colab's GPU image ships newer ones; a local install or an old Colab image may not.
OLDEST = {"torch": (2, 8), "triton": (3, 4)}


def _older_than_supported() -> str | None:
    """What to run when torch or triton is older than the course supports (None when both are recent)."""
    import torch

    found = {"torch": torch.__version__, "triton": _version("triton")}
    old = [f"{name} {v}" for name, v in found.items()
           if v != "not installed" and _release(v)[:2] < OLDEST[name]]
    if not old:
        return None
    floor = " and ".join(f"{name} {'.'.join(map(str, OLDEST[name]))}" for name in OLDEST)
    return (f"{' and '.join(old)} is older than the course supports ({floor} or newer): some kernels will not "
            "compile or will fail. On Colab, pick the latest runtime version (Runtime > Change runtime type), whose "
            "PyTorch and Triton are recent; on your own machine, run  pip install --upgrade torch triton  (or "
            "`make install`, which installs what requirements.txt pins), then restart the kernel.")
