"""What the compiler makes of a kernel on each GPU (introduced in chapter 05).

The same ``tl.dot`` becomes different instructions on different GPUs. Compiled by Triton for

- a Hopper GPU (H100, compute capability 9.0): ``wgmma``, Hopper's warpgroup matrix multiply on the
  tensor cores, asynchronous;
- an Ampere or Ada GPU (A100 8.0, L4 8.9): ``mma.sync``, a warp-wide matrix multiply on the tensor cores;
- a Turing GPU (the T4, 7.5): scalar ``fma``, one multiply-add per thread per instruction on the CUDA
  cores. Triton uses tensor cores from compute capability 8.0 on; older GPUs have them, but Triton's
  ``tl.dot`` does not reach them there (cuBLAS and PyTorch's attention do).

This module compiles a ``@triton.jit`` kernel for any of those GPUs on any machine, a CPU included
(Triton's compiler and its ``ptxas`` run without a GPU), counts the instructions that tell the three
apart, and reads the same from a kernel just compiled on the reader's own GPU. The speed checks use it to
pick a peer that runs on the same kind of unit as the learner's kernel (``speed_peer``).

It imports nothing from the course but ``world``, and Triton only when asked to compile.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from .world import own_capability

__all__ = ["Target", "COLAB_GPUS", "UNITS", "count_instructions", "unit_of_counts", "unit_of_ptx", "Lowering",
           "compile_for", "lowerings", "counts_on_this_gpu", "unit_on_this_gpu", "scalar_products", "speed_peer",
           "target_for"]


@dataclass(frozen=True)
class Target:
    gpu: str               # the GPU Colab offers with this compute capability
    cc: int                # compute capability as Triton writes it: 75 for 7.5
    smem_per_block: int    # bytes of shared memory one block may use (the opt-in maximum)
    datasheet: str         # its row in kernelcourse.roofline.DATASHEET (peak FLOP/s per unit)
    bf16: bool             # bfloat16 arithmetic

    @property
    def sm(self) -> str:
        return f"sm_{self.cc}"

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.cc, 10)


# The GPUs of Colab, oldest first. Shared memory per block is what CUDA lets one block opt in to
# (cudaDevAttrMaxSharedMemoryPerBlockOptin, which Triton reports as max_shared_mem).
COLAB_GPUS: dict[int, Target] = {
    75: Target("T4", 75, 64 * 1024, "T4", bf16=False),
    80: Target("A100", 80, 163 * 1024, "A100 80GB SXM", bf16=True),
    89: Target("L4", 89, 99 * 1024, "L4", bf16=True),
    90: Target("H100", 90, 227 * 1024, "H100 SXM", bf16=True),
}

# What each lowering of tl.dot runs on, in words.
UNITS = {
    "wgmma": "tensor cores (wgmma, Hopper's warpgroup matrix multiply)",
    "mma": "tensor cores (mma.sync, a warp's matrix multiply)",
    "fma": "CUDA cores (scalar fma, one multiply-add per thread)",
}

_PATTERNS = {
    "fma": re.compile(r"^\s*(?:@%p\d+\s+)?fma\.rn\.f(?:32|16x2|16)\b", re.M),
    "mma": re.compile(r"^\s*(?:@%p\d+\s+)?mma\.sync\b", re.M),
    "wgmma": re.compile(r"^\s*(?:@%p\d+\s+)?wgmma\.mma_async\b", re.M),
}


def count_instructions(ptx: str) -> dict[str, int]:
    """How many scalar ``fma``, ``mma.sync`` and ``wgmma.mma_async`` instructions a kernel's PTX holds."""
    return {unit: len(p.findall(ptx)) for unit, p in _PATTERNS.items()}


def unit_of_counts(counts: dict[str, int]) -> str:
    """The unit a kernel's ``tl.dot`` runs on: "wgmma", "mma" or "fma" (no tensor-core instruction)."""
    if counts.get("wgmma"):
        return "wgmma"
    if counts.get("mma"):
        return "mma"
    return "fma"


def unit_of_ptx(ptx: str) -> str:
    return unit_of_counts(count_instructions(ptx))


def target_for(capability) -> Target | None:
    """The Colab GPU whose compiled code a GPU of this capability ((8, 6) or 86) shares, if any: the newest
    target at or below it within the same major version."""
    cc = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else int(capability)
    same_major = [t for t in COLAB_GPUS.values() if t.cc // 10 == cc // 10 and t.cc <= cc]
    return max(same_major, key=lambda t: t.cc) if same_major else None


# ---- compiling for a target on any machine ---------------------------------------------------------


@dataclass(frozen=True)
class Lowering:
    """What Triton made of one kernel for one target."""
    cc: int
    counts: dict           # {"fma": n, "mma": n, "wgmma": n} in its PTX
    shared: int            # bytes of shared memory one block of it uses
    num_warps: int

    @property
    def unit(self) -> str:
        return unit_of_counts(self.counts)

    @property
    def fits(self) -> bool:
        """Whether its shared memory fits the target's budget per block (for the targets in COLAB_GPUS)."""
        return self.shared <= COLAB_GPUS[self.cc].smem_per_block if self.cc in COLAB_GPUS else True


def _jit_function(kernel):
    """The JITFunction (or, under Triton's interpreter, the InterpretedFunction) under any autotune or
    heuristics wrappers."""
    import triton

    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction) and hasattr(fn, "fn"):
        if type(fn).__name__ == "InterpretedFunction":
            return fn
        fn = fn.fn
    return fn


def _signature(fn, constexprs: dict, types: dict | None, dtype: str) -> dict:
    """Every argument's type: constexprs by value; ``types`` where given; else ``*dtype`` for names
    ending in _ptr, ``tensordesc`` for names ending in _desc (give those in ``types``), i32 for the rest."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif types and name in types:
            sig[name] = types[name]
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig


def _compile_here(fn, cc: int, constexprs: dict, types: dict | None, dtype: str, num_warps: int,
                  num_stages: int, ints: dict | None = None) -> Lowering:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    ints = dict(ints or {})
    # as a launch specialises them: an integer equal to 1 is compiled in as a constant
    constants = {**constexprs, **{n: 1 for n, v in ints.items() if v == 1}}
    sig = _signature(fn, constants, types, dtype)
    # and pointers (16-byte aligned) and the integers that are multiples of 16 are marked divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n in ints and ints[n] != 1 and ints[n] % 16 == 0)}
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in constants.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return Lowering(cc, count_instructions(compiled.asm["ptx"]), int(compiled.metadata.shared), num_warps)


_SUBPROCESS = r"""
import importlib, json, sys
import kernelcourse.targets as T
# a module that calls kc.setup() on import must not switch Triton's interpreter on here: kernels compile
sys.modules["kernelcourse.world"]._enter_simulation = lambda: None
jobs = json.loads(sys.argv[1])
out = []
for module, name, cc, constexprs, types, dtype, warps, stages, ints in jobs:
    fn = T._jit_function(getattr(importlib.import_module(module), name))
    try:
        low = T._compile_here(fn, cc, constexprs, types, dtype, warps, stages, ints)
        out.append({"cc": low.cc, "counts": low.counts, "shared": low.shared, "num_warps": low.num_warps})
    except Exception as exc:  # noqa: BLE001 - reported back to the caller with the job that failed
        out.append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
print(json.dumps(out))
"""


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction" or os.environ.get("TRITON_INTERPRET") == "1"


def lowerings(jobs: list[dict]) -> list[Lowering]:
    """Compile several (kernel, target) jobs, each a dict of ``compile_for``'s arguments. Where Triton's
    interpreter is on (the CPU world), kernels are not compiled in this process: the jobs run in a few
    child processes without the interpreter (the kernels must be importable from their module)."""
    fns = [_jit_function(j["kernel"]) for j in jobs]
    norm = [dict(cc=int(j["cc"]), constexprs=dict(j.get("constexprs", {})), types=j.get("types"),
                 dtype=j.get("dtype", "fp16"), num_warps=int(j.get("num_warps", 4)),
                 num_stages=int(j.get("num_stages", 3)), ints=dict(j.get("ints") or {})) for j in jobs]
    if not any(_interpreted(fn) for fn in fns):
        return [_compile_here(fn, n["cc"], n["constexprs"], n["types"], n["dtype"], n["num_warps"], n["num_stages"],
                              n["ints"]) for fn, n in zip(fns, norm)]
    payload = []
    for fn, n in zip(fns, norm):
        module, name = fn.fn.__module__, fn.fn.__name__
        if module == "__main__" or not module:
            raise ValueError(f"{name} is defined in this notebook, and Triton's interpreter is on here: only a "
                             "kernel of an importable module (kc.kernels.matmul_kernel, say) can be compiled for "
                             "another GPU from this process")
        payload.append([module, name, n["cc"], n["constexprs"], n["types"], n["dtype"], n["num_warps"], n["num_stages"],
                        n["ints"]])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # what this process imports from, the child does too: this package first, then this process's path
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, [src, *sys.path, env.get("PYTHONPATH")])))
    # the jobs dealt out to a few child processes at once (compiling is single-threaded)
    n = max(1, min(len(payload), os.cpu_count() or 1, 4))
    procs = [subprocess.Popen([sys.executable, "-c", _SUBPROCESS, json.dumps(payload[i::n])], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(n)]
    results: list = [None] * len(payload)
    outputs = [p.communicate(timeout=1800) for p in procs]
    for i, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"compiling for other GPUs failed: {stderr.strip()[-2000:]}")
        results[i::n] = json.loads(stdout.strip().splitlines()[-1])
    out = []
    for job, res in zip(payload, results):
        if "error" in res:
            raise RuntimeError(f"{job[1]} for sm_{job[2]}: {res['error']}")
        out.append(Lowering(res["cc"], res["counts"], res["shared"], res["num_warps"]))
    return out


def compile_for(kernel, cc: int, constexprs: dict, *, types: dict | None = None, dtype: str = "fp16",
                num_warps: int = 4, num_stages: int = 3, ints: dict | None = None) -> Lowering:
    """Compile ``kernel`` for compute capability ``cc`` (75, 80, 89, 90, ...) on this machine, GPU or not.

    ``constexprs`` gives every ``tl.constexpr`` argument; pointers (names ending in ``_ptr``) point to
    ``dtype``, other arguments are 32-bit integers unless ``types`` says otherwise (e.g.
    ``{"sm_scale": "fp32", "lse_ptr": "*fp32"}``). ``ints`` gives integer arguments the values of a launch
    (``{"M": 4096, "stride_ak": 1}``) to specialise them as that launch would: a 1 compiled in, a multiple
    of 16 known as one. A contiguous tensor's last stride is 1, and knowing it lets Triton load whole
    vectors and pipeline the loads: without ``ints`` the code is the one for any strides.
    """
    return lowerings([dict(kernel=kernel, cc=cc, constexprs=constexprs, types=types, dtype=dtype,
                           num_warps=num_warps, num_stages=num_stages, ints=ints)])[0]


# ---- the reader's own GPU ----------------------------------------------------------------------


def _ptx_of(compiled) -> str | None:
    asm = getattr(compiled, "asm", None)
    return asm.get("ptx") if isinstance(asm, dict) else None


def counts_on_this_gpu(kernel_or_compiled) -> dict[str, int] | None:
    """``count_instructions`` of a kernel compiled on this GPU: pass what a launch returned (``compiled =
    kernel[grid](...)``: Triton returns the compiled kernel) or the kernel itself, whose most recently
    compiled variant is read. None when nothing was compiled (in Triton's interpreter, say)."""
    ptx = _ptx_of(kernel_or_compiled)
    if ptx is None:
        fn = _jit_function(kernel_or_compiled)
        for caches in reversed(list(getattr(fn, "device_caches", {}).values())):
            kernels = list(caches[0].values()) if caches and isinstance(caches[0], dict) else []
            if kernels:
                ptx = _ptx_of(kernels[-1])
                break
    return None if ptx is None else count_instructions(ptx)


def unit_on_this_gpu(kernel_or_compiled) -> str | None:
    """The unit ``tl.dot`` ran on in a kernel compiled on this GPU: "wgmma", "mma" or "fma"; None when
    nothing was compiled (``counts_on_this_gpu``)."""
    counts = counts_on_this_gpu(kernel_or_compiled)
    return None if counts is None else unit_of_counts(counts)


# A block product written as a multiply and a tl.sum costs each thread BLOCK_M * BLOCK_N * K / threads scalar
# FMAs (1,024 for 32 x 64 x 64 on 128 threads): far more than the elementwise arithmetic around tl.dot
# (16 in the course's dK/dV kernel). Triton rewrites some such sums into tensor-core instructions and leaves
# the others, so a kernel can hold both; one with this many FMAs per tensor-core instruction did products
# on the CUDA cores.
SCALAR_PRODUCT_FMAS = 512
USE_TL_DOT = "write each block product with tl.dot, not as a multiply and a tl.sum"  # what such a kernel is told
FMAS_PER_TENSOR_CORE_OP = 8


def scalar_products(counts: dict[str, int]) -> bool:
    """True when a kernel's PTX (``count_instructions``) holds block products done in scalar FMA, beside or
    instead of tensor-core instructions."""
    fma, tc = counts.get("fma", 0), counts.get("mma", 0) + counts.get("wgmma", 0)
    return fma >= SCALAR_PRODUCT_FMAS and fma >= FMAS_PER_TENSOR_CORE_OP * tc


# ---- speed checks: a peer on the same kind of unit ------------------------------------------------


def speed_peer(compiled, tensor_cores: tuple, cuda_cores: tuple, capability: tuple[int, int] | None = None) -> tuple:
    """The peer a speed check times the learner's kernel against: ``(name, fn, at_least, why)``.

    ``compiled`` is what the learner's launch returned (or the kernel). ``tensor_cores`` and
    ``cuda_cores`` are ``(name, fn, at_least)``: the usual peer (cuBLAS, SDPA), which runs on tensor
    cores on every GPU the course supports, and a peer that runs on CUDA cores. Where Triton put the
    learner's ``tl.dot`` on tensor cores (mma or wgmma), the first; where this GPU's Triton cannot (a T4,
    compute capability below 8.0; ``capability`` is the GPU's, torch's by default), the second: timing FMA
    against tensor cores would fail correct work for what the compiler did, not the learner. A kernel that
    compiled to FMA alone on a GPU where tl.dot has tensor cores wrote its products some other way (a
    multiply and tl.sum): the usual peer, and ``why`` says to use tl.dot; so too where Triton turned some of
    such products into tensor-core code and left the others in scalar FMA (``scalar_products``).

    ``why`` is what the speed line should say about the choice, or "" where there is nothing to say.
    """
    counts = counts_on_this_gpu(compiled)
    unit = None if counts is None else unit_of_counts(counts)
    if unit in ("wgmma", "mma") and scalar_products(counts):
        name, fn, at_least = tensor_cores
        why = (f"your kernel compiled to {counts['fma']:,} scalar FMA instructions beside "
               f"{counts['mma'] + counts['wgmma']} on the tensor cores (Triton turned some of its block products "
               f"into tensor-core code, not the others): {USE_TL_DOT}")
        return name, fn, at_least, why
    if unit in (None, "wgmma", "mma"):
        name, fn, at_least = tensor_cores
        return name, fn, at_least, ""
    capability = capability or own_capability()
    if capability is not None and capability >= (8, 0):
        name, fn, at_least = tensor_cores
        why = ("your kernel compiled to scalar FMA alone, on the CUDA cores, though Triton puts tl.dot on this "
               f"GPU's tensor cores: {USE_TL_DOT}")
        return name, fn, at_least, why
    name, fn, at_least = cuda_cores
    why = ("on this GPU Triton compiles tl.dot to scalar FMA on the CUDA cores (it uses tensor cores from "
           f"compute capability 8.0 on), while {tensor_cores[0]} uses tensor cores: so the peer is {name}, "
           "on CUDA cores too")
    return name, fn, at_least, why
