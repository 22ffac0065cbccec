"""kernelcourse.attention_backward (chapter 07): the backward references agree with autograd, the
Triton kernels and the differentiable ``attention`` agree with a float64 truth (in Triton's
interpreter on the CPU, at small sizes), and bad input raises a ValueError that says what is wrong."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import kernelcourse as kc
from kernelcourse import attention as A
from kernelcourse import attention_backward as AB
from tests.helpers import H100


def qkv_do(B, H, n_q, n_k, d, dtype=torch.float32, logit_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n_q, d, generator=g) * math.sqrt(logit_scale)
    k = torch.randn(B, H, n_k, d, generator=g) * math.sqrt(logit_scale)
    v = torch.randn(B, H, n_k, d, generator=g)
    do = torch.randn(B, H, n_q, d, generator=g)
    return tuple(t.to(kc.world().device, dtype) for t in (q, k, v, do))


def autograd64(q, k, v, do, causal=False, sm_scale=None):
    """The gradients autograd finds through the float64 reference: the truth."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    A.attention_ref(q, k, v, causal=causal, sm_scale=sm_scale).backward(do.double())
    return q.grad, k.grad, v.grad


def torch_error(q, k, v, do, truth, causal=False):
    """PyTorch's own error at the inputs' precision: autograd through the reference computed in that dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    A.attention_ref(q, k, v, causal=causal, compute_dtype=q.dtype).backward(do)
    return [(t.grad.double() - g).abs().max().item() for t, g in zip((q, k, v), truth)]


def assert_close_to(got, truth, tols, what):
    for name, g, t, tol in zip(("dq", "dk", "dv"), got, truth, tols):
        err = (g.double() - t).abs().max().item()
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN or Inf"
        assert err <= tol, f"{what}: {name} max error {err:.3g} > {tol:.3g}"


# ---- the references ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_q, n_k", [(33, 33), (20, 47), (47, 20), (1, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_formulas_match_autograd(n_q, n_k, causal):
    q, k, v, do = qkv_do(2, 2, n_q, n_k, 16, dtype=torch.float64, logit_scale=30.0)
    got = AB.attention_backward_ref(q, k, v, do, causal=causal, sm_scale=0.3)
    truth = autograd64(q, k, v, do, causal=causal, sm_scale=0.3)
    assert_close_to(got, truth, [1e-10] * 3, "formulas")


@pytest.mark.parametrize("n_q, n_k, bm, bn", [(50, 50, 16, 16), (37, 70, 16, 32), (70, 37, 32, 8), (1, 9, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_reference_matches_and_never_holds_n_by_n(n_q, n_k, bm, bn, causal):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    q, k, v, do = qkv_do(1, 2, n_q, n_k, 16, logit_scale=300.0 if not causal else 1.0)
    o, lse = A.attention_ref(q, k, v, causal=causal, return_lse=True)

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.shape[-2] * t.shape[-1] if t.ndim >= 2 else t.numel())
            return out

    with Largest():
        got = AB.tiled_attention_backward_ref(q, k, v, o, lse, do, causal=causal, block_m=bm, block_n=bn)
    truth = autograd64(q, k, v, do, causal=causal)
    scale = max(t.abs().max().item() for t in truth)
    assert_close_to(got, truth, [1e-4 * scale] * 3, "tiled")
    if n_q * n_k > max(n_q, n_k) * 16:
        assert Largest.largest < n_q * n_k, "the tiled backward made an N_Q x N_K tensor"


def test_backward_flops_are_what_the_tiled_backward_computes():
    """The algorithm's backward, counted by PyTorch's FLOP counter on the tile-by-tile reference (which
    recomputes S = QKᵀ, as every FlashAttention backward does): five matmuls against the forward's two."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, do = qkv_do(2, 3, 64, 128, 16, seed=1)
    o, lse = A.attention_ref(q, k, v, return_lse=True)
    with FlopCounterMode(display=False) as counter:
        AB.tiled_attention_backward_ref(q, k, v, o, lse, do, block_m=32, block_n=32)
    assert AB.attention_backward_flops(2, 3, 64, 128, 16) == counter.get_total_flops()
    assert AB.attention_backward_flops(2, 3, 64, 128, 16, causal=True) == counter.get_total_flops() / 2


# ---- the Triton kernels, through the autograd Function ------------------------------------------

# (B, H, N_Q, N_K, d, causal, logit scale): ragged sizes (not multiples of the 16-wide tiles),
# N_Q < N_K and N_Q > N_K under the causal mask, scores of about ±1000, one query; and whole tiles of
# queries (the dK/dV kernel's EVEN_M variant), causal or not, with N_K whole or ragged.
CASES = [(1, 2, 37, 37, 16, False, 1.0), (1, 2, 37, 37, 16, True, 1.0), (1, 1, 20, 45, 32, True, 1.0),
         (1, 1, 45, 20, 32, True, 1.0), (2, 1, 33, 50, 16, False, 300.0), (1, 1, 40, 40, 16, True, 300.0),
         (1, 1, 1, 23, 16, False, 1.0), (1, 1, 64, 64, 64, False, 1.0), (2, 3, 37, 37, 16, True, 1.0),
         (1, 2, 48, 48, 16, True, 1.0), (1, 1, 32, 53, 32, True, 1.0), (1, 1, 64, 29, 16, True, 1.0)]


@pytest.mark.parametrize("B, H, n_q, n_k, d, causal, ls", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_gradients_against_float64(B, H, n_q, n_k, d, causal, ls, dtype):
    if dtype == torch.float32 and kc.world().gpu:
        pytest.skip("tl.dot rounds float32 to TF32 on a GPU: the half-precision cases grade it there")
    q, k, v, do = qkv_do(B, H, n_q, n_k, d, dtype=dtype, logit_scale=ls, seed=n_q + n_k)
    truth = autograd64(q, k, v, do, causal=causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = AB.attention(*leaves, causal=causal)
    o.backward(do)
    got = [t.grad for t in leaves]
    assert all(g.dtype == dtype for g in got)
    eps = torch.finfo(dtype).eps
    # A floor of 64 rounding steps of the largest gradient. In float32 the inputs are exact, and what is
    # left is the rounding of the exponent s - lse, which the backward recomputes: about eps · max|s|
    # (≈ 1e-4 for scores of ±1000), a relative error of P that PyTorch, reusing its own P, does not make.
    s_max = (q.double() @ k.double().transpose(-2, -1)).abs().max().item() / math.sqrt(d)
    rel = 64 * eps if dtype != torch.float32 else 4 * eps * max(16.0, s_max)
    tols = [2 * e + rel * t.abs().max().item() for e, t in zip(torch_error(q, k, v, do, truth, causal), truth)]
    assert_close_to(got, truth, tols, f"{(B, H, n_q, n_k, d)} causal={causal} {dtype}")


@triton.jit
def _record_tile_and_head(out_ptr, GROUP: tl.constexpr):
    tile, head = AB.tile_and_head(GROUP)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + 2 * pid, tile)
    tl.store(out_ptr + 2 * pid + 1, head.to(tl.int32))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_tile_and_head_visits_each_tile_once_in_grouped_order(group):
    tiles, heads = 5, 7                                 # 7 heads: the last group is partial
    out = torch.full((tiles * heads, 2), -1, dtype=torch.int32, device=kc.world().device)
    _record_tile_and_head[(tiles, heads)](out, GROUP=group)
    got = [tuple(r) for r in out.tolist()]              # (tile, head) of each program, in launch order
    assert sorted(got) == [(t, h) for t in range(tiles) for h in range(heads)], got
    want = []
    for first in range(0, heads, group):
        in_group = range(first, min(first + group, heads))
        want += [(t, h) for t in range(tiles) for h in in_group]
    assert got == want


# Compiled for an H100 (sm_90), on any machine: Triton ships ptxas, and with TRITON_DUMP_PTXAS_LOG it prints
# what ptxas said while compiling. The script runs in a fresh process, since this one may have set Triton's
# interpreter (under which kernels are not compiled), with an empty cache, so that ptxas runs.
_PTXAS_SCRIPT = r"""
import json, os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
import kernelcourse.attention_backward as AB

try:
    ptxas = get_ptxas(90)  # Triton 3.5 and newer pick a ptxas per architecture
except TypeError:
    ptxas = get_ptxas()    # Triton 3.4: one ptxas
if not os.path.exists(ptxas.path):
    sys.exit("no ptxas")
if not hasattr(triton.knobs.nvidia, "dump_ptxas_log"):
    sys.exit("no ptxas log")  # TRITON_DUMP_PTXAS_LOG came with Triton 3.5
fn = getattr(AB, sys.argv[3])
while not isinstance(fn, triton.runtime.JITFunction):  # under triton.heuristics
    fn = fn.fn
names = list(fn.arg_names)
consts = json.loads(sys.argv[1])
sig = {}
for n in names:
    if n in consts:
        sig[n] = "constexpr"
    elif n.endswith("_ptr"):
        sig[n] = "*fp32" if n in ("lse_ptr", "delta_ptr") else "*fp16"
    else:
        sig[n] = "fp32" if n == "sm_scale" else "i32"
# as a launch with contiguous tensors and N divisible by 16 specialises it: pointers, strides, N_Q, N_K
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if sig[n].startswith("*") or n.startswith("stride") or n in ("N_Q", "N_K")}
src = ASTSource(fn, sig, {(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
warps, stages = json.loads(sys.argv[2])
triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
"""


@pytest.mark.parametrize("kernel, d, block_m, block_n, warps, stages, causal, even_m, kv_group", [
    ("attention_bwd_dkdv_kernel", 128, 64, 64, 4, 2, True, False, 1), ("attention_bwd_dkdv_kernel", 128, 64, 128, 8, 3, True, False, 1),
    ("attention_bwd_dkdv_kernel", 128, 64, 64, 4, 2, False, False, 1), ("attention_bwd_dkdv_kernel", 64, 64, 64, 4, 2, True, False, 1),
    ("attention_bwd_dkdv_kernel", 64, 32, 64, 4, 3, True, True, 1), ("attention_bwd_dkdv_kernel", 64, 32, 64, 4, 3, False, True, 1),
    ("attention_bwd_dkdv_kernel", 128, 64, 128, 8, 3, False, True, 1),
    ("attention_bwd_dq_kernel", 128, 128, 64, 8, 3, True, None, 1), ("attention_bwd_dq_kernel", 128, 128, 64, 8, 3, False, None, 1),
    # grouped-query attention: the dK/dV kernel loops over the 4 query heads of each key head
    ("attention_bwd_dkdv_kernel", 64, 64, 64, 4, 2, True, False, 4), ("attention_bwd_dkdv_kernel", 128, 64, 128, 8, 3, False, True, 4),
    ("attention_bwd_dq_kernel", 64, 64, 64, 4, 3, True, None, 4)])
def test_backward_kernels_compiled_for_hopper_keep_their_matmuls_asynchronous(tmp_path, kernel, d, block_m, block_n,
                                                                              warps, stages, causal, even_m, kv_group):
    """Hopper's matmuls (wgmma) run asynchronously: the next is issued before the last has finished. When
    ptxas cannot prove that safe it waits after each one and warns (C7515, C7512), and the kernel loses
    a tenth of its speed or more. The dK/dV kernel's loop order keeps that from happening with a causal
    mask, and EVEN_M (no loop for a partial query tile where there is none) without one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path))
    consts = {"HEAD_DIM": d, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal, "KV_GROUP": kv_group}
    if even_m is not None:
        consts["EVEN_M"] = even_m
    run = subprocess.run([sys.executable, "-c", _PTXAS_SCRIPT, json.dumps(consts), json.dumps([warps, stages]), kernel],
                         capture_output=True, text=True, env=env, timeout=300)
    if run.returncode != 0 and run.stderr.strip().endswith("no ptxas"):
        pytest.skip("this Triton has no ptxas")
    if run.returncode != 0 and run.stderr.strip().endswith("no ptxas log"):
        pytest.skip("this Triton does not print ptxas's log (TRITON_DUMP_PTXAS_LOG, Triton 3.5 and newer)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Used" in run.stdout, run.stdout[-2000:]               # ptxas ran and reported its registers
    assert "serialized" not in run.stdout, run.stdout[-2000:]


# On a GPU, tl.dot multiplies float32 tiles in TF32 (10-bit mantissa), the interpreter exactly: the
# float32 tests below allow TF32's error there, and scores of ±30 only in the interpreter.
TF32 = kc.world().gpu
F32_TOL = 2e-2 if TF32 else 1e-4  # float32 inputs: TF32 products on a GPU, exact ones in the interpreter


def test_backward_kernels_match_the_tiled_reference_with_other_tiles():
    q, k, v, do = qkv_do(1, 2, 45, 39, 32, logit_scale=1.0 if TF32 else 30.0, seed=3)
    o, lse = A.flash_attention(q, k, v, causal=True)
    got = AB.flash_attention_backward(q, k, v, o, lse, do, causal=True, sm_scale=None,
                                      dkdv_config={"BLOCK_M": 32, "BLOCK_N": 16}, dq_config={"BLOCK_M": 16, "BLOCK_N": 32})
    ref = AB.tiled_attention_backward_ref(q, k, v, o, lse, do, causal=True)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize("resident, configs", [("kv", AB.DKDV_CONFIGS), ("q", AB.DQ_CONFIGS)], ids=["dkdv", "dq"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_pruning_on_a_large_gpu_keeps_the_chosen_tiles(monkeypatch, resident, configs, d):
    monkeypatch.setattr(AB, "_device_properties", lambda: H100)
    kept = {AB._key(c) for c in AB._pruner(resident)(configs, {"N_Q": 4096, "N_K": 4096, "HEAD_DIM": d})}
    assert kept == AB._TRIED[resident][d], "every chosen tile is a candidate and fits an H100"


def test_sm_scale_and_noncontiguous_inputs():
    q, k, v, do = qkv_do(1, 2, 30, 30, 16, seed=5)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)          # same values, (B, N, H, d) memory
    leaves = [t.clone().requires_grad_() for t in (qt, k, v)]
    AB.attention(*leaves, causal=False, sm_scale=0.5).backward(do)
    truth = autograd64(q, k, v, do, sm_scale=0.5)
    assert_close_to([t.grad for t in leaves], truth, [F32_TOL * t.abs().max().item() for t in truth], "sm_scale")


@pytest.mark.parametrize("version", sorted(A.VERSIONS))
def test_heads_of_a_fused_projection_are_read_in_place(version, monkeypatch):
    """q, k, v as a transformer block makes them, views of one (B, N, 3, H, d) projection: the forward's
    output is laid out as (B, N, H, d), so merging its heads is a view, and the backward reads every
    input through its strides, with no copy, and gets the float64 truth's gradients. Whichever version of
    chapter 06 the GPU runs (v2 before Hopper: a GPU's own, or KC_MAX_CAPABILITY=8.0 on an H100)."""
    monkeypatch.setattr(A, "default_version", lambda capability: version)
    monkeypatch.setattr(A, "_plans", {})
    B, H, N, d = 2, 2, 37, 16
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, N, 3, H, d, generator=g).to(kc.world().device).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    o = AB.attention(q, k, v, causal=True)
    assert o.transpose(1, 2).is_contiguous(), "o is not laid out as (B, N, H, d)"
    do = torch.randn(B, N, H * d, generator=g).to(qkv.device).view(B, N, H, d).transpose(1, 2)
    assert AB._rows_readable(q) == (q,) and AB._rows_readable(k, v) == (k, v)
    assert all(a is b for a, b in zip(AB._rows_readable(o, do), (o, do)))
    o.backward(do)
    truth = autograd64(q, k, v, do, causal=True)
    got = qkv.grad.permute(2, 0, 3, 1, 4).unbind(0)
    assert_close_to(got, truth, [F32_TOL * t.abs().max().item() for t in truth], "fused projection")


def test_inputs_of_different_layouts_are_copied_and_still_right():
    q, k, v, do = qkv_do(1, 2, 21, 26, 16, seed=8)
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)      # k and v no longer share strides
    dot = do.transpose(1, 2).contiguous().transpose(1, 2)    # do's layout is not o's
    kk, vv = AB._rows_readable(k, vt)
    assert kk.is_contiguous() and vv.is_contiguous()
    leaves = [t.clone().requires_grad_() for t in (q, k, vt)]
    AB.attention(*leaves, causal=False).backward(dot)
    truth = autograd64(q, k, v, do)
    assert_close_to([t.grad for t in leaves], truth, [F32_TOL * t.abs().max().item() for t in truth], "layouts")


def test_saves_no_n_by_n_tensor():
    q, k, v, do = qkv_do(1, 1, 48, 40, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = AB.attention(*leaves, causal=True)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5
    assert all(t.numel() <= 48 * 16 + 40 * 16 for t in saved), [tuple(t.shape) for t in saved]


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make, words", [
    (lambda q, k, v: (q[0], k, v), "4-dimensional"),
    (lambda q, k, v: (q, k.half(), v), "share one dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), "dtype torch.int64"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "float16, bfloat16 or float32"),
    (lambda q, k, v: (q, k, v[:, :, :-1]), "same shape"),
    (lambda q, k, v: (q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)), "H=2"),  # 3 key heads
    (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), "head dim d=12"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), "d=16"),
    (lambda q, k, v: (q.cpu().numpy(), k, v), "torch.Tensor"),
    (lambda q, k, v: (q[:, :, :0], k, v), "empty"),
])
def test_bad_input_raises_value_error(make, words):
    q, k, v, _ = qkv_do(1, 2, 8, 8, 16)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        AB.attention(*make(q, k, v))


@pytest.mark.parametrize("scale, words", [
    (float("nan"), "sm_scale must be a finite number or None, got nan"),
    (float("inf"), "sm_scale must be a finite number or None, got inf"),
    ("0.5", "sm_scale must be a finite number or None, got '0.5'"),
    (0.0, "sm_scale must be > 0, got 0.0: the kernels take each row's maximum score before scaling it"),
    (0, "sm_scale must be > 0, got 0:"),
    (-0.25, "sm_scale must be > 0, got -0.25:"),
])
def test_bad_sm_scale_raises(scale, words):
    """A scale of zero or below is refused, not computed wrongly: the unmasked path takes each row's maximum
    before scaling, which is the maximum after scaling only for a positive scale."""
    q, k, v, _ = qkv_do(1, 1, 8, 8, 16)
    with pytest.raises(ValueError, match=re.escape(words)):
        AB.attention(q, k, v, sm_scale=scale)


def test_tensors_on_another_device_are_refused(monkeypatch):
    """A tensor on another device than the one the kernels run on gets a message that says where to move it.
    On a GPU a CPU tensor is passed; on the CPU the kernels are made to look as if they ran on a GPU."""
    import dataclasses

    q, k, v, _ = qkv_do(1, 1, 8, 8, 16)
    w = kc.world()
    if w.gpu:
        q = q.cpu()
    else:
        monkeypatch.setattr(A, "world", lambda: dataclasses.replace(w, gpu=True, device="cuda"))
    words = re.escape("q is on cpu, but the kernels run on cuda here") + r".*q\.to\('cuda'\)"
    with pytest.raises(ValueError, match=words):
        AB.attention(q, k, v)
