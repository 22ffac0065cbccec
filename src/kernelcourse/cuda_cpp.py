"""CUDA C++ from a notebook (introduced in chapter 01).

``compile(source)`` builds a complete CUDA C++ program with nvcc wherever nvcc exists (a GPU machine,
Colab, or a CPU machine with the CUDA toolkit) and ``run()`` runs it where a GPU exists. On a GPU,
``raw_kernel(source, name)`` compiles one ``extern "C"`` kernel through CuPy for launching on torch
tensors, so the same source is timed beside PyTorch.
"""
from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .world import nvcc, world  # noqa: F401  (nvcc: where the compiler is, found by the world)


def default_arch() -> str:
    # On the CPU, check against the free Colab GPU (T4, sm_75) so what compiles here runs there.
    return world().sm if world().gpu else "sm_75"


@dataclass
class Build:
    ok: bool
    binary: Path | None
    log: str  # nvcc's messages, including the per-kernel register and shared-memory report


def compile(source: str, name: str = "prog", arch: str | None = None, flags: tuple[str, ...] = ()) -> Build:
    """Compile a whole program with ``nvcc -O3 -arch=<arch> --resource-usage``; None if nvcc is absent."""
    exe = nvcc()
    if exe is None:
        return Build(False, None, "nvcc not found: the source is shown but not compiled here")
    out = Path(tempfile.mkdtemp(prefix="kc-")) / name
    src = out.with_suffix(".cu")
    src.write_text(source)
    cmd = [exe, "-O3", f"-arch={arch or default_arch()}", "--resource-usage", *flags, str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = (proc.stdout + proc.stderr).replace(str(src), f"{name}.cu")
    return Build(proc.returncode == 0, out if proc.returncode == 0 else None, log)


def run(build: Build, *args: str, timeout: float = 120) -> str:
    """Run a compiled program on this machine's GPU and return what it printed."""
    if not (build.ok and world().gpu):
        raise RuntimeError("running a CUDA program needs a successful build and a GPU")
    proc = subprocess.run([str(build.binary), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the program failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def raw_kernel(source: str, name: str):
    """A CuPy ``RawKernel`` for the ``extern "C"`` kernel ``name`` in ``source`` (GPU only)."""
    if not world().gpu:
        raise RuntimeError("launching CUDA C++ kernels needs a GPU")
    import cupy

    return cupy.RawKernel(source, name)  # NVRTC optimises fully by default


def launcher(kernel, grid: int, block: int, *args):
    """A no-argument function that launches a CuPy kernel on torch CUDA tensors and scalars.

    Tensors are shared with CuPy through DLPack (no copy) once, here, so that timing the returned
    function measures the launch and the kernel rather than the conversion.
    """
    import cupy
    import numpy as np
    import torch

    # CuPy and PyTorch both launch on the device's default stream unless told otherwise, so the
    # kernel is ordered after the PyTorch work that produced its inputs.
    assert torch.cuda.current_stream().cuda_stream == 0, "launcher() expects PyTorch's default stream"
    converted = tuple(cupy.from_dlpack(a) if isinstance(a, torch.Tensor)
                      else np.int64(a) if isinstance(a, int)  # sizes are long long in the course's kernels
                      else a for a in args)
    return lambda: kernel((grid,), (block,), converted)
