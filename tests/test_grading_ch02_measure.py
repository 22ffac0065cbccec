"""Chapter 02's measurement exercises (02.1, 02.3, 02.4): the learner reads GPU timings that ship with the
course. Correct readings pass, other correct ways of writing them pass, typical wrong readings are rejected
with a hint, an answer copied from the recorded GPU's table fails under the T4's ceilings, and neither a
table of the answers to the calls the statement prints nor a cut-off other than the statement's passes the
cases drawn on every run."""
import pytest

from tests.helpers import grade

SEEDS = range(20)


def _on_every_seed(monkeypatch, exercise, **objects):
    """(passed, text) of grading ``objects`` under each of SEEDS, in one process."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    results = []
    for seed in SEEDS:
        monkeypatch.setenv("KC_GRADE_SEED", str(seed))
        results.append(grade(exercise, **objects))
    return results


def _printed_answers(correct, calls):
    """A learner who tabulated ``correct``'s answers to the first ``calls`` calls (those the statement prints:
    the recorded rows and ceilings), keyed by everything passed, and answers anything else as the first."""
    table = {}

    def tabulated(*args):
        if len(table) < calls:
            table.setdefault(repr(args), correct(*args))
        return table.get(repr(args), next(iter(table.values())))
    return tabulated


def _rejected_on_a_drawn_case(monkeypatch, exercise, fixed_cases, **objects):
    """Graded without a seed, ``objects`` pass the ``fixed_cases`` calls the statement prints and fail the
    first drawn one, with its seed on the failing line."""
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")  # the table must see the grader's calls
    monkeypatch.delenv("KC_GRADE_SEED", raising=False)
    passed, text = grade(exercise, **objects)
    assert not passed, text
    lines = [line for line in text.splitlines() if line[:1] in "✔✘"]
    assert [line[0] for line in lines] == ["✔"] * fixed_cases + ["✘"], text
    assert "drawn for this run" in lines[-1] and "KC_GRADE_SEED=" in lines[-1], text
    return lines[-1]


def _x_roof(r, bw, peak):
    return r["flops"] / (r["ms"] * 1e-3) / 1e12 / min(peak, r["flops"] / r["nbytes"] * bw / 1e3)


def _copied(correct):
    """A learner who hard-codes the answer for the recorded GPU: right the first time, then the same list."""
    answer = []

    def copied(*args):
        if not answer:
            answer.append(correct(*args))
        return answer[0]
    return copied


# ---- 02.1 which timings are impossible ----------------------------------------------------------------


def impossible_timings(rows, bandwidth_gbps, peak_tflops):
    return [i for i, r in enumerate(rows) if _x_roof(r, bandwidth_gbps, peak_tflops) > 1.1]


def impossible_timings_seconds(rows, bandwidth_gbps, peak_tflops):
    # the same test in seconds: time below the lower bound / 1.1
    out = []
    for i, r in enumerate(rows):
        t_min = max(r["flops"] / (peak_tflops * 1e12), r["nbytes"] / (bandwidth_gbps * 1e9))
        if r["ms"] * 1e-3 * 1.1 < t_min:
            out.append(i)
    return out


@pytest.mark.parametrize("fn", [impossible_timings, impossible_timings_seconds])
def test_02_1_accepts_correct(fn):
    passed, text = grade("02.1", impossible_timings=fn)
    assert passed, text
    assert "no synchronize" in text  # the no-synchronize matmul is the textbook impossible point


@pytest.mark.parametrize("fn, hint", [
    (lambda rows, bw, peak: [i for i, r in enumerate(rows) if _x_roof(r, bw, peak) > 1.0], "10% margin"),
    (lambda rows, bw, peak: [i for i, r in enumerate(rows) if r["flops"] / (r["ms"] * 1e-3) / 1e12 > 1.1 * peak],
     "compute peak only"),
    (lambda rows, bw, peak: [i for i, r in enumerate(rows) if r["nbytes"] / (r["ms"] * 1e-3) / 1e9 > 1.1 * bw],
     "bandwidth only"),
    (_copied(impossible_timings), "a T4's datasheet ceilings"),  # the recorded GPU's answer, hard-coded
    (lambda rows, bw, peak: [r for i, r in enumerate(rows) if _x_roof(r, bw, peak) > 1.1], "indices"),
    (lambda rows, bw, peak: None, "forget `return`"),
])
def test_02_1_rejects_wrong(fn, hint):
    passed, text = grade("02.1", impossible_timings=fn)
    assert not passed
    assert hint in text, text


def test_02_1_accepts_correct_on_every_drawn_case(monkeypatch):
    for fn in (impossible_timings, impossible_timings_seconds):
        for passed, text in _on_every_seed(monkeypatch, "02.1", impossible_timings=fn):
            assert passed and text.count("drawn for this run") >= 2, text


def test_02_1_rejects_a_table_of_the_printed_answers(monkeypatch):
    # right on the recorded rows under the recorded and the T4 ceilings; the drawn times tell
    line = _rejected_on_a_drawn_case(monkeypatch, "02.1", 2, impossible_timings=_printed_answers(impossible_timings, 2))
    assert "misjudged: row" in line and "x its roof" in line, line


@pytest.mark.parametrize("cut_off", [1.02, 1.05, 1.15, 1.5, 1.67])
def test_02_1_rejects_another_margin_on_every_seed(cut_off, monkeypatch):
    # the recorded rows have no point between 1.02x and 1.67x the roof: the drawn rows at 0.5-3% either side
    # of 1.1x tell these cut-offs from the statement's
    def wrong(rows, bw, peak):
        return [i for i, r in enumerate(rows) if _x_roof(r, bw, peak) > cut_off]
    for passed, text in _on_every_seed(monkeypatch, "02.1", impossible_timings=wrong):
        assert not passed and "[ceilings drawn for this run] returned" in text, text
        side = "more than 1.1x, so impossible" if cut_off > 1.1 else "not more than 1.1x, so possible"
        assert f"x its roof, {side}" in text and "10%" in text, text  # the hint: a margin of 10%


def test_02_1_missing_name_is_explained():
    passed, text = grade("02.1")
    assert not passed and "impossible_timings not defined" in text


# ---- 02.3 where the L2 cache stops helping -------------------------------------------------------------


def served_from_l2(rows, factor=1.5):
    hot = {r["op"]: r["ms"] for r in rows if r["method"].startswith("hot")}
    flushed = {r["op"]: r["ms"] for r in rows if r["method"].startswith("do_bench")}
    return [op for op in hot if flushed[op] / hot[op] >= factor]


def served_from_l2_bandwidth(rows, factor=1.5):
    # the same reading through GB/s: the hot loop's bandwidth is factor x the flushed one's
    gbps = {}
    for r in rows:
        gbps.setdefault(r["op"], {})[r["method"].split(",")[0]] = r["nbytes"] / r["ms"]
    return {op for op, g in gbps.items() if g["hot loop"] >= factor * g["do_bench"]}


@pytest.mark.parametrize("fn", [served_from_l2, served_from_l2_bandwidth])
def test_02_3_accepts_correct(fn):
    passed, text = grade("02.3", served_from_l2=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda rows, factor=1.5: [op for op in {r["op"] for r in rows}
                               if min(r["ms"] for r in rows if r["op"] == op and r["method"].startswith("do"))
                               / min(r["ms"] for r in rows if r["op"] == op and r["method"].startswith("hot"))
                               <= 1 / factor], "inverted"),
    (lambda rows, factor=1.5: sorted({r["op"] for r in rows}), "only some sizes"),
    (lambda rows, factor=1.5: ["add, 3 x 2 MiB", "add, 3 x 8 MiB"], "expected"),  # hard-coded: the second case differs
    (lambda rows, factor=1.5: "add, 3 x 2 MiB", "return a list"),
])
def test_02_3_rejects_wrong(fn, hint):
    passed, text = grade("02.3", served_from_l2=fn)
    assert not passed
    assert hint in text, text


def _served_at(cut_off):
    """served_from_l2 that keeps a cut-off of its own and ignores the factor it is passed."""
    return lambda rows, factor=1.5: served_from_l2(rows, cut_off)


def served_from_l2_times(rows, factor=1.5):
    # the same reading with the factor on the other side: hot time x factor at most the flushed time
    times = {}
    for r in rows:
        times.setdefault(r["op"], {})["hot" if r["method"].startswith("hot") else "flushed"] = r["ms"]
    return [op for op, t in times.items() if t["hot"] * factor <= t["flushed"]]


def test_02_3_accepts_correct_on_every_drawn_case(monkeypatch):
    for fn in (served_from_l2, served_from_l2_bandwidth, served_from_l2_times):
        for passed, text in _on_every_seed(monkeypatch, "02.3", served_from_l2=fn):
            assert passed and text.count("drawn for this run") == 2, text


def test_02_3_rejects_a_table_of_the_printed_answers(monkeypatch):
    # right on the recorded rows and on those with a larger L2, both at factor 1.5; the drawn times tell
    line = _rejected_on_a_drawn_case(monkeypatch, "02.3", 2, served_from_l2=_printed_answers(served_from_l2, 2))
    assert "misjudged: add" in line and "x faster hot than flushed" in line, line


@pytest.mark.parametrize("cut_off", [1.5, 2.0, 1.2, 2.5])
def test_02_3_rejects_a_function_that_ignores_factor_on_every_seed(cut_off, monkeypatch):
    # the recorded speed-ups are 1.0, 1.1, 2.8 and 2.9, so any cut-off in between passed them; the drawn factors,
    # one below 2 and one above, with speed-ups 0.5-3% either side of each, leave none
    for passed, text in _on_every_seed(monkeypatch, "02.3", served_from_l2=_served_at(cut_off)):
        assert not passed and "(L2 rows with times drawn for this run, factor=" in text, text
        assert "misjudged: add" in text and ("so served" in text or "so not served" in text), text


def test_02_3_names_the_ignored_factor(monkeypatch):
    # at factor 1.5 the statement's example and the drawn factor part on a row between them
    hinted = [text for passed, text in _on_every_seed(monkeypatch, "02.3", served_from_l2=_served_at(1.5))
              if "that is what factor=1.5 (the statement's example) selects" in text]
    assert hinted, "no seed named the factor 1.5"


# ---- 02.4 which operations are far below their roof ------------------------------------------------------


def below_half_roof(rows, bandwidth_gbps, peak_tflops):
    return [r["op"] for r in rows if _x_roof(r, bandwidth_gbps, peak_tflops) < 0.5]


def below_half_roof_time(rows, bandwidth_gbps, peak_tflops):
    # the same reading in time: measured time more than twice the lower bound
    return tuple(r["op"] for r in rows
                 if r["ms"] * 1e-3 > 2 * max(r["flops"] / (peak_tflops * 1e12), r["nbytes"] / (bandwidth_gbps * 1e9)))


@pytest.mark.parametrize("fn", [below_half_roof, below_half_roof_time])
def test_02_4_accepts_correct(fn):
    passed, text = grade("02.4", below_half_roof=fn)
    assert passed, text


@pytest.mark.parametrize("fn, hint", [
    (lambda rows, bw, peak: [r["op"] for r in rows if r["flops"] / (r["ms"] * 1e-3) / 1e12 < 0.5 * peak],
     "compute peak only"),
    (lambda rows, bw, peak: [r["op"] for r in rows if r["nbytes"] / (r["ms"] * 1e-3) / 1e9 < 0.5 * bw],
     "bandwidth only"),
    (lambda rows, bw, peak: [r["op"] for r in rows if _x_roof(r, bw, peak) > 0.5], "inverted"),
    (lambda rows, bw, peak: ["softmax", "matmul 128", "matmul 256", "matmul 512", "matmul 1024"],
     "a T4's datasheet ceilings"),  # the recorded GPU's answer, hard-coded
])
def test_02_4_rejects_wrong(fn, hint):
    passed, text = grade("02.4", below_half_roof=fn)
    assert not passed
    assert hint in text, text


def test_02_4_accepts_correct_on_every_drawn_case(monkeypatch):
    for fn in (below_half_roof, below_half_roof_time):
        for passed, text in _on_every_seed(monkeypatch, "02.4", below_half_roof=fn):
            assert passed and text.count("drawn for this run") >= 2, text


def test_02_4_rejects_a_table_of_the_printed_answers(monkeypatch):
    # right on the recorded rows under the recorded and the T4 ceilings; the drawn times tell
    line = _rejected_on_a_drawn_case(monkeypatch, "02.4", 2, below_half_roof=_printed_answers(below_half_roof, 2))
    assert "misjudged: " in line and "% of its roof" in line, line


@pytest.mark.parametrize("cut_off", [0.45, 0.6, 0.43, 0.63])
def test_02_4_rejects_another_fraction_on_every_seed(cut_off, monkeypatch):
    # the recorded rows have no op between 42% and 64% of its roof: the drawn rows at 0.5-3% either side of half
    # tell these cut-offs from the statement's
    def wrong(rows, bw, peak):
        return [r["op"] for r in rows if _x_roof(r, bw, peak) < cut_off]
    for passed, text in _on_every_seed(monkeypatch, "02.4", below_half_roof=wrong):
        assert not passed and "[ceilings drawn for this run] returned" in text, text
        side = "of its roof, below half" if cut_off < 0.5 else "of its roof, not below half"
        assert side in text, text


def test_selections_name_a_duplicate(monkeypatch):
    monkeypatch.setenv("KC_GRADE_IN_PROCESS", "1")
    passed, text = grade("02.4", below_half_roof=lambda rows, bw, peak: below_half_roof(rows, bw, peak) * 2)
    assert not passed and "list each one once" in text, text


def test_02_4_rows_instead_of_names_are_explained():
    passed, text = grade("02.4", below_half_roof=lambda rows, bw, peak: [r for r in rows if _x_roof(r, bw, peak) < .5])
    assert not passed and "return the op names" in text, text
