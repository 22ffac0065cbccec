"""The grading harness's comparison: what it calls an element never written, whatever dtype the output was read
in. The graders' tests run on the CPU, where some cases (the attention graders' float16 ones) never run; these
check the mechanism those cases rely on a GPU."""
import numpy as np
import torch

from kernelcourse.grading.harness import HALF_POISON, POISON, compare, never_written, nothing_written


def _attention_like(rng, shape=(2, 40, 16)):
    truth = rng.standard_normal(shape)
    return truth, truth.astype(np.float16)


def test_half_poison_widened_to_float32_reads_as_never_written():
    """A float16 output poisoned with HALF_POISON and converted with .float() before compare(), as the attention
    graders do on a GPU: the rows a kernel never wrote are named as such, not as a max error of 3.3e4."""
    truth, out = _attention_like(np.random.default_rng(0))
    out[0, 32:] = HALF_POISON  # a BLOCK_M of 32 where the launch passed a larger one: rows 32.. never written
    got = torch.from_numpy(out).float().numpy()
    ok, line = compare(got, truth, rtol_floor=4e-3, what="fp16")
    assert not ok and "never written (first at index (0, 32, 0))" in line and f"{8 * 16} of" in line, line
    # the same verdict for the float16 array itself
    assert compare(out, truth, rtol_floor=4e-3, what="fp16")[1] == line


def test_half_poison_in_a_bfloat16_output_reads_as_never_written():
    truth = np.random.default_rng(1).standard_normal(64)
    t = torch.from_numpy(truth).to(torch.bfloat16)
    t[10:] = HALF_POISON
    ok, line = compare(t.float().numpy(), truth, rtol_floor=1e-2, what="bf16")
    assert not ok and "54 of 64 elements never written (first at index 10)" in line, line
    assert nothing_written(torch.full((3,), HALF_POISON, dtype=torch.bfloat16).float().numpy())


def test_half_poison_is_not_read_as_poison_where_it_cannot_be():
    # float32 results that are not 16-bit values: -32768 there is a (wrong) result, not the poison
    rng = np.random.default_rng(2)
    truth = rng.standard_normal(50)
    got = truth.astype(np.float32)
    got[5] = HALF_POISON
    ok, line = compare(got, truth, what="fp32")
    assert not ok and "max error" in line and "never written" not in line, line
    # a 16-bit output whose truth is itself about -32768 there: a result
    truth16 = np.array([1.0, -32768.0, 2.0])
    assert not never_written(truth16.astype(np.float16), truth16).any()
    assert compare(truth16.astype(np.float16).astype(np.float32), truth16, what="near")[0]


def test_poison_still_reads_as_never_written_in_each_dtype():
    truth = np.arange(1.0, 9.0)
    for dtype in (np.float32, np.float64):
        got = truth.astype(dtype)
        got[3] = POISON
        assert "1 of 8 elements never written (first at index 3)" in compare(got, truth, what="t")[1]
    with np.errstate(over="ignore"):
        half = truth.astype(np.float16)
        half[3] = np.float16(POISON)  # -inf: what framed() fills a float16 output with
    assert "never written" in compare(half, truth, what="t")[1]


def test_unwritten_as_nan_fills_what_torch_empty_makes_and_restores_the_switches():
    import warnings

    from kernelcourse.grading.harness import unwritten_as_nan

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with unwritten_as_nan():
            made = [torch.empty(5), torch.empty_like(torch.ones(3, 2)), torch.ones(2).new_empty(4)]
            # what warn_only says of a nondeterministic op in learner code is the grader's switch, not theirs
            warnings.warn("scatter_add does not have a deterministic implementation", UserWarning)
    assert all(torch.isnan(t).all() for t in made)
    assert not seen
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before
