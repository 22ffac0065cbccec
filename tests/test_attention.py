"""kernelcourse.attention (chapter 06): the references agree with each other and with PyTorch's SDPA,
and the Triton kernel, in each of its versions, agrees with them (in Triton's interpreter on the CPU,
at small sizes; on a GPU with the autotuner). v2, the pointer-based version that GPUs without TMA run,
is tested on every GPU by forcing it with ``version=2``."""
import math

import pytest
import torch
import torch.nn.functional as F

import kernelcourse as kc
from kernelcourse import attention as A
from tests.helpers import H100


def qkv(B, H, n_q, n_k, d, dtype=torch.float32, logit_scale=1.0, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n_q, d, generator=g) * math.sqrt(logit_scale)
    k = torch.randn(B, H, n_k, d, generator=g) * math.sqrt(logit_scale)
    v = torch.randn(B, H, n_k, d, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def truth(q, k, v, causal=False, sm_scale=None):
    return A.attention_ref(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale, return_lse=True)


# ---- the references ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_q, n_k", [(33, 33), (20, 47), (47, 20), (1, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_sdpa(n_q, n_k, causal):
    q, k, v = qkv(2, 3, n_q, n_k, 16)
    o, lse = A.attention_ref(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal), rtol=1e-5, atol=1e-5)
    s = q @ k.transpose(-2, -1) / 4.0
    if causal:  # top-left: query i sees keys j <= i
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).tril().logical_not(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-5, atol=1e-5)


def test_reference_in_half_precision_computes_in_half():
    q, k, v = qkv(1, 2, 64, 64, 32, dtype=torch.float16, logit_scale=4.0)
    exact, _ = truth(q, k, v)
    err32 = (A.attention_ref(q, k, v).double() - exact).abs().max()
    err16 = (A.attention_ref(q, k, v, compute_dtype=torch.float16).double() - exact).abs().max()
    assert err16 > err32  # the naive half-precision computation rounds the scores and probabilities


def test_online_softmax_with_large_logits():
    x = torch.randn(4, 300) * 400  # exp() of these overflows float32 without the max
    torch.testing.assert_close(A.online_softmax(x, 37), torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-6)


def test_merge_is_order_free_and_matches_the_whole():
    s = torch.randn(3, 60, dtype=torch.float64) * 50
    v = torch.randn(60, 8, dtype=torch.float64)
    parts = [A.softmax_state(s[:, a:b], v[a:b]) for a, b in ((0, 7), (7, 31), (31, 60))]
    whole = A.softmax_state(s, v)
    left = A.online_softmax_merge(A.online_softmax_merge(parts[0], parts[1]), parts[2])
    right = A.online_softmax_merge(parts[2], A.online_softmax_merge(parts[1], parts[0]))
    for got in (left, right):
        for g, w in zip(got, whole):
            torch.testing.assert_close(g, w)


def test_merge_with_an_empty_state():
    s = torch.randn(2, 10) * 100
    s[1] = float("-inf")  # row 1 of this block is entirely masked
    v = torch.randn(10, 4)
    empty = A.softmax_state(s, v)
    assert torch.isneginf(empty[0][1]) and empty[1][1] == 0 and not empty[2].isnan().any()
    other = A.softmax_state(torch.randn(2, 5), torch.randn(5, 4))
    m, l, acc = A.online_softmax_merge(empty, other)
    torch.testing.assert_close(m[1], other[0][1])
    torch.testing.assert_close(acc[1] / l[1], other[2][1] / other[1][1])
    nothing = (torch.tensor([-math.inf]), torch.zeros(1), torch.zeros(1, 4))
    both_empty = A.online_softmax_merge(nothing, nothing)
    assert torch.isneginf(both_empty[0]).all() and not both_empty[2].isnan().any()


@pytest.mark.parametrize("n_q, n_k, bm, bn", [(50, 50, 16, 16), (37, 70, 16, 32), (70, 37, 32, 16), (5, 100, 64, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_reference(n_q, n_k, bm, bn, causal):
    q, k, v = qkv(2, 2, n_q, n_k, 16, logit_scale=100.0, seed=n_q)
    o, lse = A.tiled_attention_ref(q, k, v, causal=causal, block_m=bm, block_n=bn)
    o64, lse64 = truth(q, k, v, causal)
    torch.testing.assert_close(o.double(), o64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-4)


def test_tiled_reference_never_makes_the_score_matrix():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    q, k, v = qkv(1, 1, 256, 256, 16)
    with Largest():
        A.tiled_attention_ref(q, k, v, block_m=32, block_n=32)
    assert Largest.numel < 256 * 256


def test_flops_are_what_the_reference_computes():
    """The count is the reference's matmuls as PyTorch's own FLOP counter sees them; causal keeps half."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(2, 3, n, 16) for n in (37, 53, 53))
    with FlopCounterMode(display=False) as counter:
        A.attention_ref(q, k, v)
    assert A.attention_flops(2, 3, 37, 53, 16) == counter.get_total_flops()
    assert A.attention_flops(2, 3, 37, 53, 16, causal=True) == counter.get_total_flops() / 2


# ---- the Triton kernel, in the interpreter -----------------------------------------------------


@pytest.mark.parametrize("B, H, n_q, n_k, d, causal, config", [
    (1, 2, 64, 64, 16, False, None),                               # whole tiles
    (2, 1, 45, 45, 32, False, None),                               # a partial tile
    (1, 2, 45, 45, 32, True, None),
    (1, 1, 20, 77, 16, True, {"BLOCK_M": 16, "BLOCK_N": 32}),      # N_Q < N_K, BLOCK_N > BLOCK_M
    (1, 1, 77, 20, 16, True, {"BLOCK_M": 32, "BLOCK_N": 16}),      # N_Q > N_K: rows past N_K see every key
    (1, 1, 100, 33, 64, False, {"BLOCK_M": 64, "BLOCK_N": 16}),
    (1, 1, 1, 1, 16, True, None),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("version", [None, 2])   # the default (v4 on Hopper and in the interpreter) and v2
def test_kernel_matches_reference(B, H, n_q, n_k, d, causal, config, dtype, version):
    if kc.world().gpu and dtype == torch.float32:
        pytest.skip("tl.dot on float32 is TF32 on a GPU: the kernel is checked in half precision there")
    q, k, v = qkv(B, H, n_q, n_k, d, dtype=dtype, logit_scale=30.0, seed=n_q + n_k, device=kc.world().device)
    o, lse = A.flash_attention(q, k, v, causal=causal, config=config, version=version)
    o64, lse64 = truth(q, k, v, causal)
    naive = A.attention_ref(q, k, v, causal=causal, compute_dtype=dtype)  # PyTorch at the inputs' precision
    tol = 2 * (naive.double() - o64).abs().max().item() + 8 * torch.finfo(dtype).eps * o64.abs().max().item()
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (B, H, n_q)
    assert (o.double() - o64).abs().max().item() <= tol
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("version", [None, 2])
def test_kernel_strided_inputs_and_scale(version):
    # (B, N, H, d) memory seen as (B, H, N, d), as a projection followed by a transpose gives it
    g = torch.Generator().manual_seed(1)
    dtype = torch.float16 if kc.world().gpu else torch.float32
    q, k, v = (torch.randn(2, 40, 3, 32, generator=g).to(kc.world().device, dtype).transpose(1, 2) for _ in range(3))
    o, lse = A.flash_attention(q, k, v, causal=True, sm_scale=0.3, version=version)
    o64, lse64 = truth(q, k, v, causal=True, sm_scale=0.3)
    tol = 2e-3 if kc.world().gpu else 1e-4
    torch.testing.assert_close(o.double(), o64, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-4)


def test_kernel_with_large_logits():
    if kc.world().gpu:
        pytest.skip("float32 inputs: checked in the interpreter")
    q, k, v = qkv(1, 2, 50, 70, 32, logit_scale=1000.0, seed=3)  # scores of several thousand
    o, lse = A.flash_attention(q, k, v)
    o64, lse64 = truth(q, k, v)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), o64, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("version", sorted(A.VERSIONS))
@pytest.mark.parametrize("n_q, n_k, causal", [(45, 45, True), (20, 77, True), (77, 20, True), (50, 70, False)])
def test_every_version_matches_reference(version, n_q, n_k, causal):
    dtype = torch.float16
    q, k, v = qkv(1, 2, n_q, n_k, 32, dtype=dtype, logit_scale=30.0, seed=version + n_q, device=kc.world().device)
    o, lse = A.flash_attention(q, k, v, causal=causal, version=version)
    o64, lse64 = truth(q, k, v, causal)
    naive = A.attention_ref(q, k, v, causal=causal, compute_dtype=dtype)
    tol = 2 * (naive.double() - o64).abs().max().item() + 8 * torch.finfo(dtype).eps * o64.abs().max().item()
    assert (o.double() - o64).abs().max().item() <= tol, f"version {version}"
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-5, atol=1e-3)


def test_hopper_and_the_interpreter_run_the_final_version_older_gpus_the_pointer_loads():
    assert A.default_version((9, 0)) == A.default_version(None) == A.FINAL
    for capability in ((7, 5), (8, 0), (8, 6), (8, 9)):
        assert A.default_version(capability) == 2, capability


# ---- the causal key range, the dispatch and the tile sizes -----------------------------------------


@pytest.mark.parametrize("bm, bn", [(32, 32), (64, 32), (32, 64), (128, 64), (16, 128)])
def test_causal_key_range_classifies_every_tile(bm, bn):
    """Against brute force: keys below n_full are seen by every query of the tile, keys from n_end on by
    none, and every tile between has a key that some query does not see (or that lies past n_k)."""
    for n_k in (1, 63, 64, 200, 257):
        for q0 in range(0, 300, bm):
            n_full, n_end = A.causal_key_range.fn(q0, n_k, bm, bn)
            assert n_full % bn == 0 and 0 <= n_full <= n_end <= n_k
            assert all(j <= q0 for j in range(n_full))                   # the first query sees them: all do
            assert n_end == min(n_k, q0 + bm)                            # the last query sees keys < q0 + bm
            # n_full is as large as it can be: the next whole tile would need a mask
            assert n_full + bn > n_k or n_full + bn - 1 > q0


def test_default_version_and_bf16_error():
    assert A.default_version(None) == 4                    # the interpreter
    assert A.default_version((9, 0)) == 4 and A.default_version((10, 0)) == 4
    for old in ((7, 5), (8, 0), (8, 6), (8, 9)):           # T4, A100, A10, L4: no TMA
        assert A.default_version(old) == 2
    A.check_dtype(torch.bfloat16, (8, 0))
    A.check_dtype(torch.float16, (7, 5))
    with pytest.raises(ValueError, match="use float16"):
        A.check_dtype(torch.bfloat16, (7, 5))


def test_pruning_on_a_large_gpu_keeps_the_chosen_tiles(monkeypatch):
    monkeypatch.setattr(A, "_device_properties", lambda: H100)
    kept = {A._key(c) for c in A._prune(A.FWD_CONFIGS, {"N_Q": 4096, "HEAD_DIM": 128})}
    assert kept == A._TRIED[128]
