"""What Triton makes of the course's tl.dot kernels on each GPU the course supports, checked on any
machine: kernelcourse.targets compiles them for a T4 (sm_75), an A100 (sm_80), an L4 (sm_89) and an H100
(sm_90) with Triton's compiler and ptxas, no GPU needed. Every kernel must run its tl.dot on the unit
expected there (scalar FMA on the T4, mma.sync on Ampere and Ada, wgmma on Hopper), and the autotune
candidates the pruners keep for a GPU must fit its shared memory. The speed checks' choice of peer is
tested with the instruction counts stubbed, one lowering at a time."""
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
import triton
import triton.language as tl

import kernelcourse.attention as A
import kernelcourse.attention_backward as AB
import kernelcourse.kernels as K
from kernelcourse import targets as T

ROOT = Path(__file__).resolve().parent.parent
CCS = (75, 80, 89, 90)
EXPECTED = {75: "fma", 80: "mma", 89: "mma", 90: "wgmma"}
FULL = os.environ.get("KC_TARGETS_FULL") == "1"
FP32 = {"sm_scale": "fp32", "qk_scale": "fp32", "lse_ptr": "*fp32", "delta_ptr": "*fp32"}


# ---- no compiler needed ------------------------------------------------------------------------


def test_instruction_counts_and_the_unit_they_mean():
    ptx = "\n".join(["\tfma.rn.f32 \t%f1, %f2, %f3, %f1;", "\t@%p1 fma.rn.f32 %f4, %f5, %f6, %f4;",
                     "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};",
                     "\twgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;",
                     "\twgmma.fence.sync.aligned;", "// fma.rn.f32 in a comment"])
    assert T.count_instructions(ptx) == {"fma": 2, "mma": 1, "wgmma": 1}
    assert T.unit_of_counts({"fma": 9, "mma": 4, "wgmma": 1}) == "wgmma"
    assert T.unit_of_counts({"fma": 9, "mma": 4, "wgmma": 0}) == "mma"
    assert T.unit_of_counts({"fma": 9, "mma": 0, "wgmma": 0}) == "fma"


def test_each_colab_gpu_has_its_target_and_budget():
    assert [T.target_for(c).gpu for c in ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))] == ["T4", "A100", "A100", "L4", "H100"]
    assert T.target_for((7, 0)) is None and T.target_for((12, 0)) is None
    assert T.COLAB_GPUS[75].smem_per_block == 64 * 1024 and T.COLAB_GPUS[90].smem_per_block == 227 * 1024
    assert not T.COLAB_GPUS[75].bf16 and all(T.COLAB_GPUS[c].bf16 for c in (80, 89, 90))
    from kernelcourse.roofline import DATASHEET

    rows = {r["gpu"] for r in DATASHEET}
    assert {t.datasheet for t in T.COLAB_GPUS.values()} <= rows, "each target's peaks are in chapter 02's table"


class _Compiled:
    asm = {"ptx": "stubbed"}


@pytest.mark.parametrize("counts, unit", [({"fma": 0, "mma": 0, "wgmma": 2}, "wgmma"),
                                          ({"fma": 0, "mma": 16, "wgmma": 0}, "mma"),
                                          ({"fma": 1024, "mma": 0, "wgmma": 0}, "fma")])
def test_a_speed_check_picks_a_peer_on_the_unit_its_kernel_runs_on(monkeypatch, counts, unit):
    monkeypatch.setattr(T, "count_instructions", lambda ptx: counts)
    cublas = ("cuBLAS fp16 (torch.matmul)", lambda: "cublas", 0.5)
    sgemm = ("cuBLAS fp32 SGEMM", lambda: "sgemm", 0.4)
    name, fn, at_least, why = T.speed_peer(_Compiled(), tensor_cores=cublas, cuda_cores=sgemm, capability=(7, 5))
    if unit == "fma":  # a T4: Triton has no tensor cores for tl.dot there
        assert (name, fn(), at_least) == ("cuBLAS fp32 SGEMM", "sgemm", 0.4)
        assert "CUDA cores" in why and "cuBLAS fp16" in why, why
    else:  # tensor cores on both sides: nothing to explain
        assert (name, fn(), at_least, why) == ("cuBLAS fp16 (torch.matmul)", "cublas", 0.5, "")


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
def test_a_kernel_of_scalar_fma_where_tl_dot_has_tensor_cores_meets_the_usual_peer_and_is_told_why(
        monkeypatch, capability):
    """Products written as a multiply and tl.sum compile to FMA on any GPU: on one where Triton puts tl.dot on
    tensor cores that is the learner's choice, not the compiler's, so the usual peer stays and the line says so."""
    monkeypatch.setattr(T, "count_instructions", lambda ptx: {"fma": 4096, "mma": 0, "wgmma": 0})
    name, fn, at_least, why = T.speed_peer(_Compiled(), tensor_cores=("SDPA", lambda: "sdpa", 0.6),
                                           cuda_cores=("the course's kernel", lambda: "course", 0.6),
                                           capability=capability)
    assert (name, fn()) == ("SDPA", "sdpa") and "tl.dot" in why and "tl.sum" in why, why


@pytest.mark.parametrize("counts, capability", [({"fma": 2064, "mma": 0, "wgmma": 8}, (9, 0)),
                                                ({"fma": 2064, "mma": 64, "wgmma": 0}, (8, 0))])
def test_a_kernel_with_some_products_in_scalar_fma_is_told_to_use_tl_dot(monkeypatch, counts, capability):
    """Triton turns some block products written as a multiply and tl.sum into tensor-core code and leaves the
    others: 07.5's tl.sum kernel compiles to these counts (2,064 FMAs beside 8 wgmma on Hopper, 64 mma.sync on
    Ampere) and ran 1,000 times slower than SDPA on an H200. The usual peer stays, and the line says why."""
    monkeypatch.setattr(T, "count_instructions", lambda ptx: counts)
    name, fn, at_least, why = T.speed_peer(_Compiled(), tensor_cores=("SDPA", lambda: "sdpa", 0.6),
                                           cuda_cores=("the course's kernel", lambda: "course", 0.6),
                                           capability=capability)
    assert (name, fn()) == ("SDPA", "sdpa") and "2,064 scalar FMA" in why and "with tl.dot" in why, why


@pytest.mark.parametrize("counts", [{"fma": 16, "mma": 0, "wgmma": 12}, {"fma": 32, "mma": 96, "wgmma": 0},
                                    {"fma": 600, "mma": 0, "wgmma": 80}])
def test_elementwise_fma_beside_tl_dot_says_nothing(monkeypatch, counts):
    """The course's dK/dV kernels compile to 16 or 32 FMAs beside their tl.dot (Hopper, Ampere): an epilogue's
    arithmetic, not a product. Nothing to explain on their speed line."""
    monkeypatch.setattr(T, "count_instructions", lambda ptx: counts)
    assert not T.scalar_products(counts)
    assert T.speed_peer(_Compiled(), tensor_cores=("SDPA", None, 0.6), cuda_cores=("v1", None, 0.6),
                        capability=(9, 0))[3] == ""


def test_a_kernel_never_compiled_keeps_the_usual_peer():
    """In the interpreter nothing is compiled: the usual peer (and the check is not graded there anyway)."""
    name, *_ = T.speed_peer(object(), tensor_cores=("SDPA", None, 0.6), cuda_cores=("v1", None, 0.6))
    assert name == "SDPA"


def test_the_unit_is_read_from_the_last_kernel_compiled_on_this_gpu():
    class Fake(triton.runtime.JITFunction):
        def __init__(self, ptx):  # noqa: D401 - a stand-in with one compiled variant per device
            self.device_caches = {0: ({"key": type("C", (), {"asm": {"ptx": ptx}})()}, None, None, None, None)}

    assert T.unit_on_this_gpu(Fake("\tmma.sync.aligned.m16n8k16 x;")) == "mma"
    assert T.unit_on_this_gpu(Fake("\tfma.rn.f32 %f1, %f2, %f3, %f1;")) == "fma"
    assert T.unit_on_this_gpu(type("C", (), {"asm": {"ptx": "\twgmma.mma_async.sync x;"}})()) == "wgmma"


# ---- compiled for each target ----------------------------------------------------------------------


def _biggest_kept(prune, configs, budget, smem_of):
    """The most demanding candidate (by ``smem_of``) that a pruner keeps on a GPU with ``budget`` bytes of shared
    memory per block: the one to compile, to see whether what the pruner keeps fits that GPU."""
    kept = prune(configs, budget)
    assert kept, "the pruner kept no candidate"
    return max(kept, key=smem_of)


def _solution_kernels(tmp: Path) -> dict:
    """The reference answers that use tl.dot (solutions/*.ipynb), as an importable module."""
    cells = []
    for nb in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(nb, as_version=4).cells:
            if cell.cell_type == "code" and "@triton.jit" in cell.source and "tl.dot" in cell.source:
                cells.append("\n".join(line for line in cell.source.splitlines()
                                        if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")))
    (tmp / "kc_solution_kernels.py").write_text("import triton\nimport triton.language as tl\n\n" + "\n\n".join(cells))
    sys.path.insert(0, str(tmp))
    import importlib

    module = importlib.import_module("kc_solution_kernels")
    return {name: obj for name, obj in vars(module).items() if name.endswith("_kernel")}


# What Triton makes for another GPU depends on Triton alone: compiled on a GPU machine it is what the CPU run
# (make test) checks already, and the minutes of compiling would hold up a GPU that has other checks to run.
SAME_ON_ANY_MACHINE = ("compiled for every target on any machine, as make test does without a GPU: a GPU "
                       "changes nothing in what Triton makes for another one")


def skip_on_a_gpu():
    import kernelcourse as kc

    if kc.world().gpu:
        pytest.skip(SAME_ON_ANY_MACHINE)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every job compiled once, together (one child process where the interpreter is on): {label: Lowering}."""
    skip_on_a_gpu()
    jobs = {}
    mm = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, ACTIVATION="")
    for cc in CCS:
        jobs[("matmul", cc)] = dict(kernel=K.matmul_kernel, cc=cc, constexprs=mm, num_stages=3)
        # chapter 06's first version, pointer loads: any GPU
        jobs[("fwd v1", cc)] = dict(kernel=A.flash_attention_v1_kernel, cc=cc, types=FP32, num_stages=2,
                                    constexprs=dict(HEAD_DIM=32, BLOCK_M=32, BLOCK_N=32, CAUSAL=True))
        smem = T.COLAB_GPUS[cc].smem_per_block
        # d = 128 takes the most shared memory per tile; on a T4 its FMA kernels take minutes to compile, so
        # d = 64 there unless KC_TARGETS_FULL=1 (the course's T4 runs use d = 64)
        d = 128 if cc >= 80 or FULL else 64
        # the forward that flash_attention runs by default there, with the largest tiles its pruner keeps
        version = A.default_version(T.COLAB_GPUS[cc].capability)
        pool = A.FWD_CONFIGS if version in A._DESCRIPTORS else A._POINTER_CONFIGS
        fma = cc < 80  # Triton's tl.dot is scalar FMA there: the pruners estimate shared memory for it
        prune = lambda configs, budget: _with_smem(  # noqa: E731
            budget, lambda: A._prune(configs, {"N_Q": 4096}, HEAD_DIM=d), fma)
        c = _biggest_kept(prune, pool, smem, lambda c: A._smem_estimate(fma)(c, d))
        consts = dict(HEAD_DIM=d, BLOCK_M=c.kwargs["BLOCK_M"], BLOCK_N=c.kwargs["BLOCK_N"], CAUSAL=True)
        types = dict(FP32)
        if version in A._DESCRIPTORS:
            for name, rows in (("q_desc", consts["BLOCK_M"]), ("o_desc", consts["BLOCK_M"]),
                               ("k_desc", consts["BLOCK_N"]), ("v_desc", consts["BLOCK_N"])):
                types[name] = f"tensordesc<fp16[1, 1, {rows}, {d}]>"
        jobs[(f"fwd v{version}, largest kept tiles", cc)] = dict(kernel=A._KERNELS[version], cc=cc, constexprs=consts,
                                                                types=types, num_warps=c.num_warps, num_stages=c.num_stages)
        for which, resident, pool, kernel in (("dkdv", "kv", AB.DKDV_CONFIGS, AB.attention_bwd_dkdv_kernel),
                                              ("dq", "q", AB.DQ_CONFIGS, AB.attention_bwd_dq_kernel)):
            prune = lambda configs, budget, r=resident: _with_smem(  # noqa: E731
                budget, lambda: AB._pruner(r)(configs, {"N_Q": 4096, "N_K": 4096, "HEAD_DIM": d}), fma)
            c = _biggest_kept(prune, pool, smem, lambda c, r=resident: A._smem_estimate(fma)(c, d, r, 2))
            consts = dict(HEAD_DIM=d, BLOCK_M=c.kwargs["BLOCK_M"], BLOCK_N=c.kwargs["BLOCK_N"], CAUSAL=True)
            if which == "dkdv":
                consts["EVEN_M"] = True
            jobs[(f"bwd {which}, largest kept tiles", cc)] = dict(kernel=kernel, cc=cc, constexprs=consts, types=FP32,
                                                                 num_warps=c.num_warps, num_stages=c.num_stages)
    # v3 reads through tensor descriptors: the version an H100 runs by default is v4, above; v3 too
    desc = {n: "tensordesc<fp16[1, 1, 64, 64]>" for n in ("q_desc", "k_desc", "v_desc", "o_desc")}
    jobs[("fwd v3", 90)] = dict(kernel=A.flash_attention_v3_kernel, cc=90, types={**FP32, **desc}, num_stages=3,
                                constexprs=dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=False))
    # the reference answers, with small tiles (the unit does not depend on them; the compile time does)
    solutions = _solution_kernels(tmp_path_factory.mktemp("solutions"))
    tiles = dict(BLOCK_M=32, BLOCK_N=32)
    answers = {"matmul_kernel": dict(tiles, BLOCK_K=32), "linear_leaky_relu_kernel": dict(tiles, BLOCK_K=32),
               "attention_fwd_kernel": dict(tiles, HEAD_DIM=32), "causal_attention_kernel": dict(tiles, HEAD_DIM=32),
               "attention_dkdv_kernel": dict(tiles, HEAD_DIM=32)}
    assert set(solutions) == set(answers), f"reference answers that use tl.dot: {sorted(solutions)}"
    for name, consts in answers.items():
        for cc in CCS:
            jobs[(f"solution {name}", cc)] = dict(kernel=solutions[name], cc=cc, constexprs=consts, types=FP32,
                                                  num_stages=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DISABLE_MMA_V3", raising=False)  # what each GPU gets by default, also under gpu_check --pre-hopper
        return dict(zip(jobs, T.lowerings(list(jobs.values()))))


def _with_smem(budget, fn, fma=False):
    """Run a pruner as on a GPU with ``budget`` bytes of shared memory per block (and, with ``fma``, one
    where Triton's tl.dot is scalar FMA)."""
    saved = A._device_properties, AB._device_properties
    A._device_properties = AB._device_properties = lambda: {"max_shared_mem": budget, "fma_dot": fma}
    try:
        return fn()
    finally:
        A._device_properties, AB._device_properties = saved


def test_the_chapter_matmul_becomes_fma_mma_or_wgmma(compiled):
    """Lesson 05's numbers: a 64 x 64 x 32 fp16 tile in 4 warps is 64·64·32 / 128 = 1024 multiply-adds per
    thread on a T4, 16 mma.sync per warp on Ampere and Ada, 2 wgmma per warpgroup on Hopper."""
    got = {cc: compiled[("matmul", cc)].counts for cc in CCS}
    assert got[75]["fma"] == 1024 and got[75]["mma"] == got[75]["wgmma"] == 0, got
    assert got[80]["mma"] == got[89]["mma"] == 16 and got[80]["wgmma"] == 0, got
    assert got[90]["wgmma"] == 2 and got[90]["mma"] == 0, got


def test_a_contiguous_launch_s_integers_are_specialised_as_a_launch_would():
    """Given the integers of a launch on contiguous 4096 x 4096 fp16 matrices (last strides 1, the rest
    multiples of 16), the matmul's loads are pipelined in shared memory where cp.async exists (sm_80 and
    up); without them the compile is for any strides, unpipelined. With num_stages = 3 a stage is a 64 x 32
    and a 32 x 64 fp16 tile, 8 KB: Hopper's wgmma reads its operands from shared memory while the next
    loads land, so all 3 stages are buffers (24 KB); mma.sync (an A100, an L4, and an H100 under gpu_check
    --pre-hopper's DISABLE_MMA_V3=1) loads the stage it multiplies into registers first, so 2 are (16 KB).
    A T4 (sm_75) has no cp.async: nothing is pipelined either way (Triton 3.4 stages 8.5 KB for any
    strides, 8 KB for the launch's). Compiled for what each GPU gets by default, whatever this process's
    DISABLE_MMA_V3 says, as the fixture above does."""
    import kernelcourse.targets as targets

    tile = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, ACTIVATION="")
    n, stages, stage = 4096, 3, (64 * 32 + 32 * 64) * 2
    ints = dict(M=n, N=n, K=n, stride_am=n, stride_ak=1, stride_bk=n, stride_bn=1, stride_cm=n, stride_cn=1)
    jobs = [dict(kernel=K.matmul_kernel, cc=cc, constexprs=tile, num_warps=4, num_stages=stages, ints=i)
            for cc in (75, 80, 90) for i in (None, ints)]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("DISABLE_MMA_V3", raising=False)
        lows = targets.lowerings(jobs)
    (t4_any, t4_launch), (a100_any, a100_launch), (h100_any, h100_launch) = (
        (lows[i].shared, lows[i + 1].shared) for i in (0, 2, 4))
    assert [lows[i].unit for i in (0, 2, 4)] == ["fma", "mma", "wgmma"], [low.counts for low in lows]
    assert t4_launch <= t4_any <= 9 * 1024, (t4_any, t4_launch)
    assert a100_launch == (stages - 1) * stage > a100_any, (a100_any, a100_launch)
    assert h100_launch == stages * stage > h100_any, (h100_any, h100_launch)


# Candidates a pruner keeps whose compiled kernel does not fit the GPU after all (its estimate is too
# low). The autotuner skips them (Triton raises OutOfResources at launch), so they cost a compile, not a
# crash, as long as a smaller candidate fits. Listed so that a fix, or a new misfit, shows up here.
KNOWN_MISFITS: dict[tuple, str] = {}


@pytest.mark.parametrize("cc", CCS)
def test_every_tl_dot_kernel_runs_on_the_expected_unit_and_fits(compiled, cc):
    labels = [label for label in compiled if label[1] == cc]
    assert len(labels) >= 8
    misfits = set()
    for label in labels:
        low = compiled[label]
        # Hopper's wgmma multiplies 64 rows per warpgroup: a smaller tile (32 x 32) stays on mma.sync there
        small = cc == 90 and (label[0] == "fwd v1" or label[0].startswith("solution"))
        assert low.unit == ("mma" if small else EXPECTED[cc]), f"{label[0]} on sm_{cc}: {low.counts}"
        if not low.fits:
            misfits.add(label)
            assert label in KNOWN_MISFITS, (f"{label[0]} on sm_{cc} takes {low.shared} bytes of shared memory, more "
                                            f"than a {T.COLAB_GPUS[cc].gpu}'s {T.COLAB_GPUS[cc].smem_per_block}")
    fixed = {label for label in KNOWN_MISFITS if label[1] == cc and label in compiled} - misfits
    assert not fixed, f"these fit now: remove them from KNOWN_MISFITS: {sorted(fixed)}"


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
def test_the_pruners_leave_a_tile_for_every_target_and_head_dim(cc, d):
    """Whatever the GPU, head dim and length, each of the three attention kernels has a tile left to run
    (whether the tiles kept fit is what the compiled tests above and below check)."""
    budget = T.COLAB_GPUS[cc].smem_per_block
    version = A.default_version(T.COLAB_GPUS[cc].capability)
    pool = A.FWD_CONFIGS if version in A._DESCRIPTORS else A._POINTER_CONFIGS
    fma = cc < 80
    for n in (40, 1000, 8192):
        assert _with_smem(budget, lambda: A._prune(pool, {"N_Q": n}, HEAD_DIM=d), fma), f"forward, N = {n}"
        for resident, pool_b in (("kv", AB.DKDV_CONFIGS), ("q", AB.DQ_CONFIGS)):
            shape = {"N_Q": n, "N_K": n, "HEAD_DIM": d}
            assert _with_smem(budget, lambda: AB._pruner(resident)(pool_b, shape), fma), f"{resident}, N = {n}"


def _t4_tiles(d: int) -> list[tuple]:
    """(kernel, config, its other constexprs) of every tile the three attention pruners keep on a T4 (64 KB,
    an FMA tl.dot) at head dim ``d``: the forward a T4 runs (version 2), dK/dV and dQ."""
    budget, shape = T.COLAB_GPUS[75].smem_per_block, {"N_Q": 4096, "N_K": 4096, "HEAD_DIM": d}
    pruned = ((A.flash_attention_v2_kernel, lambda: A._prune(A._POINTER_CONFIGS, {"N_Q": 4096}, HEAD_DIM=d), {}),
              (AB.attention_bwd_dkdv_kernel, lambda: AB._pruner("kv")(AB.DKDV_CONFIGS, shape), {"EVEN_M": True}),
              (AB.attention_bwd_dq_kernel, lambda: AB._pruner("q")(AB.DQ_CONFIGS, shape), {}))
    return [(kernel, c, extra) for kernel, prune, extra in pruned for c in _with_smem(budget, prune, True)]


def _t4_lowerings(d: int, tiles: list[tuple]) -> list:
    """Each tile compiled for sm_75 at head dim ``d``, causal."""
    skip_on_a_gpu()
    return T.lowerings([dict(kernel=kernel, cc=75, types=FP32, num_warps=c.num_warps, num_stages=c.num_stages,
                             constexprs=dict(HEAD_DIM=d, BLOCK_M=c.kwargs["BLOCK_M"], BLOCK_N=c.kwargs["BLOCK_N"],
                                             CAUSAL=True, **extra))
                        for kernel, c, extra in tiles])


@pytest.mark.skipif(not FULL, reason="some 40 FMA kernels to compile, minutes: KC_TARGETS_FULL=1")
@pytest.mark.parametrize("d", [32, 64, 128])
def test_every_tile_a_t4_keeps_compiles_to_fit_it(d):
    """The FMA estimate is an upper bound where it matters: every candidate the three pruners keep on a
    T4, compiled for sm_75, fits its 64 KB (the fixture above compiles only the largest, at d = 64)."""
    tiles = _t4_tiles(d)
    misfits = [f"{T._jit_function(kernel).fn.__name__} {A._key(c)}: {low.shared} bytes"
               for (kernel, c, _), low in zip(tiles, _t4_lowerings(d, tiles)) if not low.fits]
    assert not misfits, misfits


def test_at_d_256_a_t4_runs_the_smallest_tiles():
    """d = 256 on a T4: the pruners' estimates (upper bounds) keep the backward's 16 x 16 tiles, and no forward
    tile, so the forward falls back to its smallest, 32 x 32. Compiled for sm_75, each fits the 64 KB."""
    tiles = _t4_tiles(256)
    assert [A._key(c)[:2] for _, c, _ in tiles] == [(32, 32), (16, 16), (16, 16)]
    for low, which in zip(_t4_lowerings(256, tiles), ("forward", "dK/dV", "dQ")):
        assert low.unit == "fma" and low.fits, f"{which} at d = 256 on sm_75: {low.shared} bytes, {low.counts}"


def test_the_pre_hopper_path_on_an_h100_is_ampere_s(tmp_path):
    """gpu_check --pre-hopper sets DISABLE_MMA_V3=1: on an H100 Triton then emits Ampere's mma.sync."""
    import subprocess

    script = ("import json, kernelcourse.targets as T, kernelcourse.kernels as K\n"
              "low = T.compile_for(K.matmul_kernel, 90, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, ACTIVATION=''))\n"
              "print(json.dumps(low.counts))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(DISABLE_MMA_V3="1", TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["mma"] == 16 and counts["wgmma"] == 0, counts


# ---- on a GPU --------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not __import__("kernelcourse").world().gpu, reason="needs a CUDA GPU")


@needs_gpu
def test_the_unit_read_on_this_gpu_is_what_its_target_gets():
    """kc.kernels.matmul_kernel launched here: the unit read from its compiled PTX is the one compiling for
    this GPU's target gives (on an H100 under DISABLE_MMA_V3=1, Ampere's mma.sync)."""
    import torch

    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    c = torch.empty_like(a)
    compiled = K.matmul_kernel[(16,)](a, a, c, 256, 256, 256, 256, 1, 256, 1, 256, 1, BLOCK_M=64, BLOCK_N=64,
                                      BLOCK_K=32, GROUP_M=8, ACTIVATION="", num_warps=4, num_stages=3)
    torch.testing.assert_close(c.float(), a.float() @ a.float(), rtol=2e-2, atol=0.5)
    major, minor = torch.cuda.get_device_capability()
    want = "fma" if major < 8 else "wgmma" if major == 9 and os.environ.get("DISABLE_MMA_V3") != "1" else "mma"
    assert T.unit_on_this_gpu(compiled) == T.unit_on_this_gpu(K.matmul_kernel) == want


@triton.jit
def _fma_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # square sizes, multiples of the tiles: no masks
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, input_precision="ieee")  # fp32: FMA on any GPU
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * N
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


@needs_gpu
def test_a_tl_dot_on_cuda_cores_reaches_the_fraction_of_sgemm_that_05_4_asks():
    """Where Triton runs tl.dot on CUDA cores (a T4), exercise 05.4 asks for SPEED_VS_SGEMM of cuBLAS's
    fp32 SGEMM. On any GPU an fp32 tl.dot with input_precision="ieee" is compiled to the same scalar FMA,
    so this measures, on the GPU at hand, what that lowering reaches with the tiles 05.4's solution picks
    on a T4 (128 x 128 x 32, 4 warps, 3 stages): the fraction asked must be within reach."""
    import torch

    from kernelcourse.bench import do_bench
    from kernelcourse.grading.ch05 import SPEED_VS_SGEMM

    n = 4096
    a, b = (torch.randn(n, n, device="cuda") for _ in range(2))
    c, ref = torch.empty_like(a), torch.empty_like(a)
    launch = lambda: _fma_matmul_kernel[(n // 128, n // 128)](a, b, c, n, n, n, BLOCK_M=128, BLOCK_N=128,  # noqa: E731
                                                               BLOCK_K=32, num_warps=4, num_stages=3)
    compiled = launch()
    assert T.unit_on_this_gpu(compiled) == "fma"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.matmul(a, b, out=ref)
        torch.testing.assert_close(c, ref, rtol=1e-4, atol=1e-3)
        ratio = do_bench(lambda: torch.matmul(a, b, out=ref)) / do_bench(launch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    print(f"an FMA tl.dot at 128 x 128 x 32: {ratio:.2f}x cuBLAS's fp32 SGEMM on {torch.cuda.get_device_name()}")
    assert ratio >= SPEED_VS_SGEMM, f"{ratio:.2f}x SGEMM, and 05.4 asks {SPEED_VS_SGEMM}x on a T4"


@pytest.mark.parametrize("capability, smem", [((7, 5), 65536), ((8, 0), 166912), ((8, 9), 101376), ((9, 0), 232448)])
def test_matmul_autotuner_tries_only_tiles_that_suit_the_gpu(monkeypatch, capability, smem):
    """On a T4 (FMA) no tile above 128 x 128 is compiled; everywhere, every candidate's pipeline fits the
    GPU's shared memory, and at least one candidate is left; an H100 keeps every candidate."""
    import torch

    from kernelcourse import kernels as K

    monkeypatch.setattr(K, "_gpu_facts", lambda: (capability, smem))
    a = torch.empty(2, 2, dtype=torch.float16)
    kept = K._prune_matmul_configs(K.MATMUL_CONFIGS, {"a_ptr": a})
    assert kept
    for c in kept:
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        assert c.num_stages * (m * k + k * n) * 2 <= smem
        if capability < (8, 0):
            assert m * n <= K.FMA_TILE_MAX
    if capability == (9, 0):
        assert kept == K.MATMUL_CONFIGS
    if capability == (7, 5):
        assert len(kept) < len(K.MATMUL_CONFIGS)
