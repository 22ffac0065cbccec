"""Chapter 03's graders: typical wrong answers are rejected with a message that teaches, and
different but correct answers are accepted."""
from fractions import Fraction

import numpy as np

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kernelcourse as kc
from kernelcourse.grading import ch03
from tests.helpers import grade, memorised

# ---- the reference counts agree with the ledger ------------------------------------------------


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 7), (33, 129)])
def test_block_counts_agree_with_the_ledger(rows, cols):
    led = kc.ledger.measure(ch03.scaled_gelu_block, torch.randn(rows, cols), torch.randn(rows, cols),
                            torch.randn(cols))
    assert led.total == (7 * rows * cols + cols) * 4
    assert led.fused_bytes() == (3 * rows * cols + cols) * 4


@pytest.mark.parametrize("k, extra", [(1, 0), (3, 0), (2, 1), (4, 3)])
def test_io_reduction_agrees_with_the_ledger(k, extra):
    n = 1000
    operands = [torch.randn(n) for _ in range(extra)]

    def chain(x, *others):
        for i in range(k):
            x = x * others[i] if i < len(others) else torch.sin(x)
        return x

    led = kc.ledger.measure(chain, torch.randn(n), *operands)
    assert led.total / led.fused_bytes() == pytest.approx((2 * k + extra) / (2 + extra))


# ---- 03.1 bytes of an unfused chain ------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda r, c, s: (7 * r * c + c) * s,
                                lambda r, c, s: s * (3 * r * c) + s * (2 * r * c + c) + s * (2 * r * c),
                                lambda r, c, s: float((7 * r * c + c) * s)])
def test_03_1_accepts_correct(fn):
    passed, text = grade("03.1", block_unfused_bytes=fn)
    assert passed, text
    assert "matches kc.ledger" in text


@pytest.mark.parametrize("fn, hint", [
    (lambda r, c, s: 8 * r * c * s, "broadcast over the rows"),
    (lambda r, c, s: (3 * r * c + c) * s, "that is the fused count"),
    (lambda r, c, s: 7 * r * c * s, "the add reads the bias too"),
    (lambda r, c, s: (4 * r * c + c) * s, "only reads"),
    (lambda r, c, s: 6 * r * c * s, "ops with one input"),
    (lambda r, c, s: 7 * r * c + c, "itemsize"),
    (lambda r, c, s: None, "forget `return`"),
    (lambda r, c, s: "lots", "not a number"),
])
def test_03_1_rejects_wrong(fn, hint):
    passed, text = grade("03.1", block_unfused_bytes=fn)
    assert not passed
    assert hint in text, text


# ---- 03.2 bytes of the fused chain -------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda r, c, s: (3 * r * c + c) * s,
                                lambda r, c, s: (2 * r * c + c) * s + r * c * s])
def test_03_2_accepts_correct(fn):
    passed, text = grade("03.2", block_fused_bytes=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda r, c, s: 2 * r * c * s, "reads every input once"),
    (lambda r, c, s: (4 * r * c + c) * s, "stays in registers"),
    (lambda r, c, s: 4 * r * c * s, "broadcast over the rows"),
    (lambda r, c, s: (7 * r * c + c) * s, "that is the unfused count"),
    (lambda r, c, s: 3 * r * c * s, "reads the bias too"),
])
def test_03_2_rejects_wrong(fn, hint):
    passed, text = grade("03.2", block_fused_bytes=fn)
    assert not passed
    assert hint in text, text


# ---- 03.3 the IO reduction factor --------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda k, e: (2 * k + e) / (2 + e),
                                lambda k, e: Fraction(2 * k + e, 2 + e),
                                lambda k, e: 1 + 2 * (k - 1) / (2 + e)])
def test_03_3_accepts_correct(fn):
    passed, text = grade("03.3", io_reduction=fn)
    assert passed, text


def test_03_3_asks_only_what_the_statement_allows():
    """The statement promises 0 <= extra <= k: an answer that checks it must pass, on any draw."""
    def io_reduction(k, extra):
        assert 1 <= k and 0 <= extra <= k, (k, extra)
        return (2 * k + extra) / (2 + extra)

    for _ in range(5):
        passed, text = grade("03.3", io_reduction=io_reduction)
        assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda k, e: k, "less than k"),
    (lambda k, e: (2 * k + e) / 2, "2 + extra in the denominator"),
    (lambda k, e: 2 * k / (2 + e), "2k + extra in the numerator"),
    (lambda k, e: (2 + e) / (2 * k + e), "that is fused / unfused"),
    (lambda k, e: (2 * k + 2 * e) / (2 + e), "only read, once"),
])
def test_03_3_rejects_wrong(fn, hint):
    passed, text = grade("03.3", io_reduction=fn)
    assert not passed
    assert hint in text, text


# ---- 03.4 LayerNorm forward ------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda r, c, s: (2 * r * c + 2 * c) * s + 8 * r,
                                lambda r, c, s: r * c * s + 2 * c * s + r * c * s + 2 * r * 4])
def test_03_4_accepts_correct(fn):
    passed, text = grade("03.4", layernorm_bytes=fn)
    assert passed, text
    assert "matches kc.ledger" in text


@pytest.mark.parametrize("fn, hint", [
    (lambda r, c, s: (2 * r * c + 2 * c) * s, "writes its statistics"),
    (lambda r, c, s: (2 * r * c + 2 * c) * s + 2 * r * s, "float32, 4 bytes"),
    (lambda r, c, s: (2 * r * c + 2 * c) * s + 8 * r * c, "per row, not per element"),
    (lambda r, c, s: 2 * r * c * s + 8 * r, "reads weight and bias"),
    (lambda r, c, s: (3 * r * c + 2 * c) * s + 8 * r, "x is read once"),
])
def test_03_4_rejects_wrong(fn, hint):
    passed, text = grade("03.4", layernorm_bytes=fn)
    assert not passed
    assert hint in text, text


# ---- 03.5 fusions that save no traffic ---------------------------------------------------------


@pytest.mark.parametrize("answer", [{"B", "C", "E"}, "BCE", ["e", "b", "c"], "B, C, E"])
def test_03_5_accepts_correct(answer):
    passed, text = grade("03.5", no_traffic_saved=lambda: answer)
    assert passed, text


@pytest.mark.parametrize("answer, hint", [
    ({"B", "C", "E", "G"}, "1 of the 7 proposals are judged wrongly; think again about G: " + ch03.QUESTION["G"]),
    ({"C", "E"}, "1 of the 7 proposals are judged wrongly; think again about B: " + ch03.QUESTION["B"]),
    ({"B", "E"}, "think again about C: " + ch03.QUESTION["C"]),
    ({"B", "C"}, "think again about E: " + ch03.QUESTION["E"]),
    ({"B", "C", "D", "E"}, "think again about D: " + ch03.QUESTION["D"]),
    ({"A", "D", "F", "G"}, "7 of the 7 proposals are judged wrongly; think again about A"),
    ({"B", "C", "E", "Z"}, "letters A to G"),
    (42, "return a set of letters"),
])
def test_03_5_rejects_wrong(answer, hint):
    passed, text = grade("03.5", no_traffic_saved=lambda: answer)
    assert not passed
    assert hint in text, text


@pytest.mark.parametrize("answer", [{"B", "C", "E", "G"}, set(), {"A", "B", "C", "D", "E", "F", "G"}])
def test_03_5_a_wrong_try_reveals_no_verdict(answer):
    passed, text = grade("03.5", no_traffic_saved=lambda: answer)
    assert not passed and text.count("✘") == 1 and "✔" not in text, text
    assert not any(why in text for why in ch03.WHY.values()), text


# ---- 03.6 predicted speed-up -------------------------------------------------------------------


def _speedup(rows, cols, s, gbps, launch_us):
    n = rows * cols
    t = [k * launch_us * 1e-6 + b * s / (gbps * 1e9) for k, b in ((3, 7 * n + cols), (1, 3 * n + cols))]
    return t[0] / t[1]


def _speedup_ns(rows, cols, s, gbps, launch_us):  # the same model in nanoseconds (1 GB/s = 1 byte/ns)
    n = rows * cols
    return (3000 * launch_us + (7 * n + cols) * s / gbps) / (1000 * launch_us + (3 * n + cols) * s / gbps)


@pytest.mark.parametrize("fn", [_speedup, _speedup_ns])
def test_03_6_accepts_correct(fn):
    passed, text = grade("03.6", predicted_speedup=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda r, c, s, g, l: (7 * r * c + c) / (3 * r * c + c), "launches dominate"),
    (lambda r, c, s, g, l: 3.0, "bytes dominate"),
    (lambda r, c, s, g, l: 1 / _speedup(r, c, s, g, l), "T_unfused / T_fused"),
    (lambda r, c, s, g, l: _speedup(r, c, s, g * 2**30 / 1e9, l), "10^9 bytes"),
    (lambda r, c, s, g, l: _speedup(r, c, s, g, l * 1e3), "microseconds"),
    (lambda r, c, s, g, l: (l * 1e-6 + (7 * r * c + c) * s / (g * 1e9)) / (l * 1e-6 + (3 * r * c + c) * s / (g * 1e9)),
     "also removes launches"),
])
def test_03_6_rejects_wrong(fn, hint):
    passed, text = grade("03.6", predicted_speedup=fn)
    assert not passed
    assert hint in text, text


# ---- 03.7 the largest intermediate -------------------------------------------------------------


def _largest_with_ledger(fn, *args):
    return kc.ledger.measure(fn, *args).largest_intermediate().nbytes


def _largest_by_hand(fn, *args):
    """Without the ledger: keep every tensor an op makes, drop inputs, outputs and views."""
    kept, out = _kept_and_returned(fn, args)
    skip = {t.untyped_storage().data_ptr() for t in (*out, *args)}
    return max(t.untyped_storage().nbytes() for t in kept if t.untyped_storage().data_ptr() not in skip)


@pytest.mark.parametrize("fn", [_largest_with_ledger, _largest_by_hand])
def test_03_7_accepts_correct(fn):
    passed, text = grade("03.7", largest_intermediate_bytes=fn)
    assert passed, text


def _max_written(fn, *args):
    return max(r.bytes_written for r in kc.ledger.measure(fn, *args).rows)


def _max_output_any_row(fn, *args):
    return max(o.nbytes for r in kc.ledger.measure(fn, *args).rows for o in r.outputs)


def _max_output_work_rows(fn, *args):
    led = kc.ledger.measure(fn, *args)
    return max(o.nbytes for r in led.rows if r.kind != "view" for o in r.outputs)


def _max_written_no_outputs(fn, *args):  # leaves out returned tensors, but sums each row's outputs
    led = kc.ledger.measure(fn, *args)
    inter = led.largest_intermediate()
    row = led.rows[inter.row]
    return row.bytes_written


def _total(fn, *args):
    return kc.ledger.measure(fn, *args).total


@pytest.mark.parametrize("fn, hint", [
    (_max_written, "what fn returns"),
    (_max_output_any_row, "what fn returns"),
    (_max_output_work_rows, "what fn returns"),
    (_max_written_no_outputs, "everything one op wrote"),
    (_total, "total traffic"),
])
def test_03_7_rejects_wrong(fn, hint):
    passed, text = grade("03.7", largest_intermediate_bytes=fn)
    assert not passed
    assert hint in text, text


def test_03_7_views_of_inputs_are_explained():
    def biggest_view(fn, *args):
        led = kc.ledger.measure(fn, *args)
        inter = led.largest_intermediate().nbytes
        views = [o.nbytes for r in led.rows if r.kind == "view" for o in r.outputs]
        return max([inter, *views])

    passed, text = grade("03.7", largest_intermediate_bytes=biggest_view)
    assert not passed
    assert "a view makes no tensor" in text, text


def _kept_and_returned(fn, args):
    """Every tensor fn's ops make (views left out), and the tensors fn returns."""
    kept = []

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            if not func.is_view:
                kept.extend(t for t in tree_flatten(res)[0] if isinstance(t, torch.Tensor))
            return res

    with Keep():
        out = fn(*args)
    return kept, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _returned_by_identity(fn, *args):  # leaves out the returned tensor object, not what it is a view of
    kept, out = _kept_and_returned(fn, args)
    return max(t.untyped_storage().nbytes() for t in kept if not any(t is o for o in out))


def _returned_by_data_ptr(fn, *args):  # the address of the first element: a slice at an offset has another
    kept, out = _kept_and_returned(fn, args)
    skip = {o.data_ptr() for o in out}
    return max(t.untyped_storage().nbytes() for t in kept if t.data_ptr() not in skip)


def _returned_by_shape(fn, *args):  # with the ledger: leaves out tensors shaped and strided as a returned one
    led = kc.ledger.measure(fn, *args)
    returned = {kc.ledger.TensorInfo.of(t) for t in tree_flatten(led.outputs)[0] if isinstance(t, torch.Tensor)}
    return max(o.nbytes for r in led.rows if r.kind != "view" for o in r.outputs if o not in returned)


VIEW_HINT = "a tensor returned through a view of it is returned"


@pytest.mark.parametrize("fn, first", [(_returned_by_identity, "scores_transposed"),
                                       (_returned_by_shape, "scores_transposed"),
                                       (_returned_by_data_ptr, "qkv_keys")])
def test_03_7_a_returned_view_returns_its_tensor(fn, first, monkeypatch):
    # every run has functions that return a view of their biggest tensor, so on every seed an answer
    # that recognises only the returned tensor itself fails there, with the statement's rule
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    for seed in range(8):
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        passed, text = grade("03.7", largest_intermediate_bytes=fn)
        assert not passed, text
        failing = [line for line in text.splitlines() if line.startswith("✘")]
        assert len(failing) == 1 and f"largest_intermediate_bytes({first}, ...) returned" in failing[0], text
        assert ", expected " in failing[0] and VIEW_HINT in failing[0] and "fn returns a view of it" in failing[0], text


@pytest.mark.parametrize("name", ["scores_transposed", "gram_flat", "qkv_keys"])
def test_03_7_each_view_is_caught(name, monkeypatch):
    # the identity mistake on that function alone: a transpose, a flattening view, a slice at an offset
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")

    def mistaken_there(fn, *args):
        return (_returned_by_identity if fn.__name__ == name else _largest_with_ledger)(fn, *args)

    for seed in range(5):
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        passed, text = grade("03.7", largest_intermediate_bytes=mistaken_there)
        assert not passed, text
        assert f"✘ largest_intermediate_bytes({name}, ...) returned" in text and VIEW_HINT in text, text
        assert "fn returns a view of it (f32[" in text, text


def test_03_7_view_functions_return_views_of_their_biggest_tensor():
    # what the reference does with them: the base of the returned view is excluded, and it is the
    # biggest tensor made, so ignoring the view gives a different, larger number
    for seed in range(10):
        functions = {name: (fn, args) for name, fn, args in ch03._hidden_functions(np.random.default_rng(seed))}
        for name in ("scores_transposed", "gram_flat", "qkv_keys"):
            fn, args = functions[name]
            led = kc.ledger.measure(fn, *args)
            out = led.outputs
            assert out._base is not None and out.untyped_storage().nbytes() > 0
            want = led.largest_intermediate().nbytes
            assert _largest_by_hand(fn, *args) == want
            assert _returned_by_identity(fn, *args) == out.untyped_storage().nbytes() > want


def test_stubs_fail():
    for ex in kc.grading.exercises("03"):
        def stub(*args):
            raise NotImplementedError("replace this line with your answer (about 1 line)")
        passed, text = grade(ex.id, **{name: stub for name in ex.names})
        assert not passed and "not written yet" in text, text


# ---- fresh cases: a table of answers cannot pass ---------------------------------------------------


@pytest.mark.parametrize("exercise, name, correct", [
    ("03.1", "block_unfused_bytes", lambda r, c, s: (7 * r * c + c) * s),
    ("03.2", "block_fused_bytes", lambda r, c, s: (3 * r * c + c) * s),
    ("03.3", "io_reduction", lambda k, e: (2 * k + e) / (2 + e)),
    ("03.4", "layernorm_bytes", lambda r, c, s: (2 * r * c + 2 * c) * s + 8 * r),
    ("03.6", "predicted_speedup", _speedup),
    ("03.7", "largest_intermediate_bytes", None),
])
def test_cases_are_fresh_every_run(exercise, name, correct, monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the recording must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    if correct is None:  # 03.7: remember each function's answer by its name
        table = {}

        def recording(fn, *args):
            table[fn.__name__] = _largest_with_ledger(fn, *args)
            return table[fn.__name__]
        lookup = lambda fn, *args: table[fn.__name__]  # noqa: E731
    else:
        recording, lookup = memorised(correct)
    assert grade(exercise, **{name: recording})[0]
    passed, text = grade(exercise, **{name: lookup})
    assert not passed, text
    assert "KC_GRADE_SEED=" in text and text.count("✘") == 1, text


# ---- the first case tells the usual mistakes apart ----------------------------------------------------


@pytest.mark.parametrize("exercise, name, mistake, hint", [
    ("03.1", "block_unfused_bytes", lambda r, c, s: 7 * r * c * s, "the add reads the bias too"),
    ("03.1", "block_unfused_bytes", lambda r, c, s: (6 * r * c + c) * s, "the multiply reads two full tensors"),
    ("03.1", "block_unfused_bytes", lambda r, c, s: 8 * r * c * s, "broadcast over the rows"),
    ("03.4", "layernorm_bytes", lambda r, c, s: (2 * r * c + 2 * c) * s + 2 * r * s, "the statistics are float32"),
    ("03.4", "layernorm_bytes", lambda r, c, s: (2 * r * c + 2 * c) * s + r * 4, "two statistics per row"),
    ("03.3", "io_reduction", lambda k, e: (2 * k + e) / 2, "2 + extra in the denominator"),
])
def test_first_case_names_the_right_mistake(exercise, name, mistake, hint, monkeypatch):
    # on every seed the first case is one where the usual mistakes give different numbers
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    for seed in range(25):
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        passed, text = grade(exercise, **{name: mistake})
        assert not passed and hint in text and text.count("✘") == 1 and "✔" not in text, text
