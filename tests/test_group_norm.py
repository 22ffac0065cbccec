"""Chapter 04's fused GroupNorm + SiLU (kernelcourse.kernels.group_norm_silu) against a float64 truth, on
awkward shapes: channels per group and H * W that are not multiples of the chunk, odd H * W, a large mean,
several chunk sizes. Kernels run in Triton's interpreter on the CPU."""
import pytest
import torch

import kernelcourse as kc
from kernelcourse import kernels as K

DEV = kc.world().device


@pytest.mark.parametrize("shape, groups", [((2, 6, 5, 7), 3), ((1, 10, 33, 31), 5), ((2, 64, 8, 8), 32),
                                           ((3, 4, 1, 1), 2), ((1, 12, 9), 4)])
@pytest.mark.parametrize("block", [None, 64, 256])
def test_matches_float64(shape, groups, block):
    g = torch.Generator().manual_seed(sum(shape) + groups)
    x = (torch.randn(*shape, generator=g) * 3 + 100.0).to(DEV)  # a mean far from 0
    w = torch.randn(shape[1], generator=g).to(DEV)
    b = torch.randn(shape[1], generator=g).to(DEV)
    y = K.group_norm_silu(x, groups, w, b, BLOCK=block)
    truth = K.group_norm_silu_ref(x.double(), groups, w.double(), b.double())
    ref = K.group_norm_silu_ref(x, groups, w, b)
    assert y.shape == x.shape and y.dtype == x.dtype
    err, ref_err = (y.double() - truth).abs().max().item(), (ref.double() - truth).abs().max().item()
    assert err <= max(2 * ref_err, 1e-5), (err, ref_err)


def test_float16_keeps_the_statistics_in_float32():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 8, 20, 21, generator=g) + 300.0).to(DEV).half()  # a sum of fp16 values would overflow
    w, b = torch.randn(8, generator=g).to(DEV).half(), torch.randn(8, generator=g).to(DEV).half()
    y = K.group_norm_silu(x, 4, w, b, BLOCK=128)
    truth = K.group_norm_silu_ref(x.double(), 4, w.double(), b.double())
    assert torch.isfinite(y).all()
    assert (y.double() - truth).abs().max().item() < 2e-2


@pytest.mark.parametrize("shape, groups, split, block", [((2, 6, 5, 7), 3, 3, 16), ((1, 10, 33, 31), 5, 4, 64),
                                                         ((2, 64, 8, 8), 32, 2, 32), ((3, 4, 1, 1), 2, 5, 16)])
def test_split_version_matches_float64(shape, groups, split, block):
    g = torch.Generator().manual_seed(sum(shape) * split)
    x = (torch.randn(*shape, generator=g) * 3 - 50.0).to(DEV)
    w, b = torch.randn(shape[1], generator=g).to(DEV), torch.randn(shape[1], generator=g).to(DEV)
    y = K.group_norm_silu(x, groups, w, b, BLOCK=block, split=split)
    truth = K.group_norm_silu_ref(x.double(), groups, w.double(), b.double())
    ref = K.group_norm_silu_ref(x, groups, w, b)
    err, ref_err = (y.double() - truth).abs().max().item(), (ref.double() - truth).abs().max().item()
    assert err <= max(2 * ref_err, 1e-5), (err, ref_err)


def test_the_split_is_asked_for_below_a_program_per_sm_and_cut_into_whole_chunks(monkeypatch):
    """On a GPU of 132 SMs: 256 groups already give every SM a program (one kernel); 64 groups of 40,960
    values ask for 9 tiles (about four programs per SM), which whole chunks of 1024 values make 8 tiles."""
    from kernelcourse import kernels

    monkeypatch.setattr(kernels, "world", lambda: type("W", (), {"gpu": True})())
    monkeypatch.setattr(kernels, "gpu_properties", lambda: {"multiprocessor_count": 132})
    assert kernels.group_norm_split(256, 10240) == 1
    assert kernels.group_norm_split(131, 10240) == 5
    assert kernels.group_norm_split(64, 40960) == 9
    assert kernels.group_norm_tiles(40960, 9, 1024) == (5120, 8)
    assert kernels.group_norm_tiles(70, 5, 1024) == (1024, 1)         # a group smaller than a chunk: one tile
