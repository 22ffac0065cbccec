"""Graders for chapter 02, roofline analysis: reading measurements (02.1, 02.3, 02.4) and the formulas
behind them: FLOPs, bytes, ridge, bounds (02.2, 02.5-02.8).

The formula exercises take plain numbers. Each grader calls the learner's function on several inputs,
drawn fresh on every run (the seed is on every failing line, and ``KC_GRADE_SEED`` draws the same cases
again) and never zero, compares with the answer at a relative tolerance of 1e-4, and on a mismatch
recognises the usual mistakes by recomputing them ("you counted the output twice") before falling back
to a hint about the formula. The first case is drawn so that the usual mistakes all give different
numbers there, so the hint names the right one.
"""
from __future__ import annotations

import math

import numpy as np

from . import Report, Stop, as_number, call, exercise, fresh_rng
from . import harness

RTOL = 1e-4


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return abs(a - b) <= rtol * abs(b)


def _call(report: Report, fn, name: str, args: dict):
    """(the call as text, what it returned); stops the exercise if it raised or returned None."""
    asked = f"{name}({', '.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in args.items())})"
    return asked, call(report, asked, fn, *args.values())  # positional: the learner may rename parameters


def _grade_number(report: Report, fn, name: str, cases: list[dict], truth, mutants, unit: str,
                  fallback: str) -> None:
    """One line per case; on the first mismatch, name the mistake if a known mutant explains it.

    ``truth(**case)`` is the answer; ``mutants(**case)`` lists ``(wrong value, hint)`` pairs.
    """
    for case in cases:
        asked, got = _call(report, fn, name, case)
        value = as_number(report, asked, got)
        if value is None:
            raise Stop
        want = truth(**case)
        if _close(value, want):
            report.ok(f"{asked} = {want:.6g} {unit}")
            continue
        hint = next((h for wrong, h in mutants(**case) if _close(value, wrong) and not _close(wrong, want)),
                    fallback)
        report.fail(f"{asked} returned {value:.6g}, expected {want:.6g} {unit}: {hint}")
        return


def separating(rng, draw, truth, mutants) -> dict:
    """A case from ``draw(rng)`` on which the answer and every known mistake give different numbers."""
    return harness.separating(rng, draw, lambda case: [truth(**case)] + [w for w, _ in mutants(**case)], _close)


# ---- 02.2 FLOPs and minimal bytes of a matmul -------------------------------------------------------------


@exercise("02.2", "FLOPs and minimal bytes of a matmul", names=("matmul_flops_bytes",), time_limit_s=10)
def grade_matmul_flops_bytes(report: Report, matmul_flops_bytes):
    rng = fresh_rng(report)
    # fresh every run; not square, so that mixing up M, N and K shows; itemsize 2 and 1 first, so that
    # a hard-coded 4 shows at once
    cases = [{"M": int(rng.integers(2, 300)), "N": int(rng.integers(300, 5000)), "K": int(rng.integers(10, 80)),
              "itemsize": 2},
             {"M": 1, "N": int(rng.integers(1000, 9000)), "K": int(rng.integers(1000, 9000)), "itemsize": 1},
             {"M": int(rng.integers(500, 3000)), "N": 7, "K": int(rng.integers(3000, 9000)), "itemsize": 4},
             {"M": int(rng.integers(1000, 9000)), "N": int(rng.integers(1000, 9000)),
              "K": int(rng.integers(1000, 9000)), "itemsize": 8}]
    for case in cases:
        M, N, K, s = case["M"], case["N"], case["K"], case["itemsize"]
        asked, got = _call(report, matmul_flops_bytes, "matmul_flops_bytes", case)
        if isinstance(got, (str, bytes)) or not hasattr(got, "__len__") or len(got) != 2:
            report.fail(f"{asked} returned {got!r}: return a pair (flops, nbytes)")
            return
        flops = as_number(report, f"{asked}[0] (flops)", got[0])
        nbytes = as_number(report, f"{asked}[1] (nbytes)", got[1])
        if flops is None or nbytes is None:
            return
        want_flops = 2 * M * N * K
        want_bytes = (M * K + K * N + M * N) * s
        if not _close(flops, want_flops):
            if _close(flops, M * N * K):
                hint = "a multiply-add is two FLOPs: 2·M·N·K"
            elif _close(nbytes, want_flops) and _close(flops, want_bytes):
                hint = "flops and nbytes are swapped: return (flops, nbytes)"
            else:
                hint = "C has M·N elements, each a dot product of length K (K multiplies and K adds)"
            report.fail(f"{asked}: flops {flops:.6g}, expected {want_flops:.6g}: {hint}")
            return
        if not _close(nbytes, want_bytes):
            mutants = [
                ((M * K + K * N + 2 * M * N) * s,
                 "you counted the output twice: C = A @ B is written once, and never read"),
                ((M * K + K * N) * s, "the output C (M·N elements) is written to memory too"),
                (M * K + K * N + M * N, "bytes should be in the given dtype: multiply element counts by itemsize"),
                ((M * K + K * N + M * N) * 4, "bytes should be in the given dtype (itemsize bytes), not always 4"),
                ((2 * M * N * K + M * N) * s, "that counts every load of the naive triple loop; the minimal "
                                              "traffic moves each matrix exactly once"),
                ((M * K + K * N + M * N) * s * 8, "itemsize is already in bytes, not bits"),
            ]
            hint = next((h for wrong, h in mutants if _close(nbytes, wrong) and not _close(wrong, want_bytes)),
                        "A is M×K, B is K×N, C is M×N: read A and B once, write C once")
            report.fail(f"{asked}: nbytes {nbytes:.6g}, expected {want_bytes:.6g}: {hint}")
            return
        report.ok(f"{asked} = ({want_flops:.6g} FLOPs, {want_bytes:.6g} bytes): "
                  f"intensity {want_flops / want_bytes:.4g} FLOP/B")


# ---- 02.5 ridge point -----------------------------------------------------------------------------------


@exercise("02.5", "ridge point from two ceilings", names=("ridge_point",), time_limit_s=10)
def grade_ridge_point(report: Report, ridge_point):
    rng = fresh_rng(report)

    def draw(rng):
        return {"peak_tflops": round(float(rng.uniform(5, 1000)), 1),
                "bandwidth_gbps": round(float(rng.uniform(200, 5000)), 1)}

    def truth(peak_tflops, bandwidth_gbps):
        return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)

    def mutants(peak_tflops, bandwidth_gbps):
        return [
            (peak_tflops / bandwidth_gbps, "TFLOP/s is 10^12 FLOP/s and GB/s is 10^9 B/s: convert both before "
                                           "dividing (the ratio gains a factor 1000)"),
            (bandwidth_gbps * 1e9 / (peak_tflops * 1e12), "inverted: the ridge is FLOP/s divided by bytes/s"),
            (bandwidth_gbps / peak_tflops, "inverted: the ridge is FLOP/s divided by bytes/s"),
            (peak_tflops * 1e12 / (bandwidth_gbps * 2**30), "that is GiB, not GB: GB/s means 10^9 bytes per second"),
            (peak_tflops * 2**40 / (bandwidth_gbps * 2**30), "TFLOP/s and GB/s are decimal: 10^12 and 10^9, "
                                                              "not 2^40 and 2^30"),
            (peak_tflops * 1e12 / (bandwidth_gbps * 1e6), "GB/s is 10^9 bytes per second"),
        ]

    cases = [separating(rng, draw, truth, mutants)] + [draw(rng) for _ in range(3)]
    _grade_number(report, ridge_point, "ridge_point", cases, truth, mutants, "FLOP/B",
                  "the ridge is the intensity where intensity × bandwidth = peak: peak FLOP/s ÷ bytes/s")


# ---- 02.6 memory- or compute-bound -------------------------------------------------------------------------


@exercise("02.6", "memory- or compute-bound", names=("classify",), time_limit_s=10)
def grade_classify(report: Report, classify):
    rng = fresh_rng(report)
    cases = []
    # Fresh every run. Intensities far from the ridge on both sides, a bit past ridge / 1000 (a ridge
    # in TFLOP/s ÷ GB/s), and within a few percent of it on both sides: a ridge in GiB/s (7% off) or
    # in 2^40 / 2^30 units (2.4% off) puts those on the wrong side.
    factors = [0.01, 200.0, 0.004, float(rng.uniform(1.005, 1.02)), float(rng.uniform(0.98, 0.995)),
               float(rng.uniform(1.03, 1.06)), float(rng.uniform(0.94, 0.97)), 0.5, 3.0]
    for factor in factors:
        peak, bw = round(float(rng.uniform(10, 1000)), 1), round(float(rng.uniform(200, 5000)), 1)
        nbytes = int(rng.integers(10**6, 10**9))
        ridge = peak * 1e12 / (bw * 1e9)
        cases.append({"flops": int(factor * ridge * nbytes), "nbytes": nbytes, "peak_tflops": peak,
                      "bandwidth_gbps": bw})
    answers = []
    for case in cases:
        asked, got = _call(report, classify, "classify", case)
        if got not in ("memory", "compute"):
            report.fail(f"{asked} returned {got!r}: return the string 'memory' or 'compute'")
            return
        answers.append((asked, got))
    wants = []
    for case in cases:
        ridge = case["peak_tflops"] * 1e12 / (case["bandwidth_gbps"] * 1e9)
        wants.append(("memory" if case["flops"] / case["nbytes"] < ridge else "compute", ridge))
    if all(got != want for (_, got), (want, _) in zip(answers, wants)):
        report.fail(f"{answers[0][0]} returned {answers[0][1]!r}: every answer is swapped: an op left of the "
                    "ridge (intensity below it) is memory-bound, right of it compute-bound")
        return
    for case, (asked, got), (want, ridge) in zip(cases, answers, wants):
        i = case["flops"] / case["nbytes"]
        if got == want:
            report.ok(f"{asked} = {want!r} (intensity {i:.4g} FLOP/B, ridge {ridge:.4g} FLOP/B)")
            continue
        if want == "memory" and i > ridge / 1000 and i < ridge / 100:
            hint = ("the ridge must be in FLOPs per byte: TFLOP/s × 10^12 ÷ (GB/s × 10^9), "
                    "not TFLOP/s ÷ GB/s")
        elif 0.9 < i / ridge < 1.1:
            hint = ("this op is within a few percent of the ridge: the units must be exact, TFLOP/s is 10^12 "
                    "FLOP/s and GB/s is 10^9 bytes/s (not 2^40 or 2^30), and the test is intensity < ridge")
        else:
            hint = "compare the intensity (FLOPs / bytes) with the ridge (peak FLOP/s ÷ bandwidth in bytes/s)"
        report.fail(f"{asked} returned {got!r}: intensity {i:.4g} FLOP/B is "
                    f"{'left' if want == 'memory' else 'right'} of the ridge ({ridge:.4g} FLOP/B), "
                    f"so it is {want}-bound; {hint}")
        return


# ---- 02.7 lower-bound time ----------------------------------------------------------------------------------


def _gpu_cases(rng, n: int) -> list[dict]:
    """Ops on both sides of the ridge (memory-bound first) of GPUs drawn at random."""
    cases = []
    for k in range(n):
        peak, bw = round(float(rng.uniform(10, 1000)), 1), round(float(rng.uniform(200, 5000)), 1)
        ridge = peak * 1e12 / (bw * 1e9)
        nbytes = int(rng.integers(10**6, 10**10))
        factor = [0.05, 8.0, 0.7, 40.0][k % 4]
        cases.append({"flops": int(factor * ridge * nbytes), "nbytes": nbytes, "peak_tflops": peak,
                      "bandwidth_gbps": bw})
    return cases


@exercise("02.7", "lower-bound time of an op", names=("min_time_ms",), time_limit_s=10)
def grade_min_time(report: Report, min_time_ms):
    rng = fresh_rng(report)
    cases = _gpu_cases(rng, 4)

    def parts(flops, nbytes, peak_tflops, bandwidth_gbps):
        return flops / (peak_tflops * 1e12), nbytes / (bandwidth_gbps * 1e9)

    def truth(**case):
        return max(parts(**case)) * 1e3

    def mutants(**case):
        c, m = parts(**case)
        slower = "FLOPs / peak" if c > m else "bytes / bandwidth"
        return [
            ((c + m) * 1e3, "compute and memory traffic overlap: the bound is the larger of the two, not their sum"),
            (min(c, m) * 1e3, f"the op needs both its FLOPs and its bytes: the slower one ({slower}) bounds it"),
            (max(c, m), "that is seconds: the answer is in milliseconds"),
            (max(c, m) * 1e6, "that is microseconds: the answer is in milliseconds"),
            (max(c, case["nbytes"] / (case["bandwidth_gbps"] * 2**30)) * 1e3,
             "that is GiB, not GB: GB/s means 10^9 bytes per second"),
            (max(c * 1e12, m * 1e9) * 1e3, "convert TFLOP/s to FLOP/s (× 10^12) and GB/s to bytes/s (× 10^9)"),
        ]

    # the first case (memory-bound) one where every usual mistake gives its own number
    cases[0] = separating(rng, lambda r: _gpu_cases(r, 1)[0], truth, mutants)
    _grade_number(report, min_time_ms, "min_time_ms", cases, truth, mutants, "ms",
                  "T >= max(FLOPs / peak FLOP/s, bytes / bandwidth in bytes/s), in milliseconds")


# ---- 02.8 fraction of the roofline ---------------------------------------------------------------------------


@exercise("02.8", "fraction of the roofline reached", names=("fraction_of_roofline",), time_limit_s=10)
def grade_fraction(report: Report, fraction_of_roofline):
    rng = fresh_rng(report)
    cases = _gpu_cases(rng, 5)
    # the last case is an impossible timing, faster than the roof: its fraction is above 1, and must say so
    for case, frac in zip(cases, [*rng.uniform(0.3, 0.95, len(cases) - 1), rng.uniform(1.2, 2.0)]):
        c = case["flops"] / (case["peak_tflops"] * 1e12)
        m = case["nbytes"] / (case["bandwidth_gbps"] * 1e9)
        case["ms"] = round(max(c, m) * 1e3 / float(frac), 6)
    # reorder the keyword arguments to the signature's order
    cases = [{k: case[k] for k in ("flops", "nbytes", "ms", "peak_tflops", "bandwidth_gbps")} for case in cases]

    def achieved(flops, ms):
        return flops / (ms * 1e-3) / 1e12

    def truth(flops, nbytes, ms, peak_tflops, bandwidth_gbps):
        return achieved(flops, ms) / min(peak_tflops, flops / nbytes * bandwidth_gbps / 1e3)

    def mutants(flops, nbytes, ms, peak_tflops, bandwidth_gbps):
        a, i = achieved(flops, ms), flops / nbytes
        roof = min(peak_tflops, i * bandwidth_gbps / 1e3)
        return [
            (a / peak_tflops, "you compared with the compute peak: this op is memory-bound, its roof is "
                              "intensity × bandwidth (in TFLOP/s: intensity × GB/s / 1000)"),
            (a / (i * bandwidth_gbps / 1e3), "this op is compute-bound: its roof is the peak, the smaller of "
                                             "the two limits"),
            (roof / a, "inverted: the fraction is achieved ÷ attainable (at most 1)"),
            (a / roof * 100, "return a fraction (e.g. 0.8), not a percentage"),
            (a / roof * 1e-3, "ms is milliseconds: the time in seconds is ms × 1e-3"),
            (a / roof * 1e3, "ms is milliseconds: the time in seconds is ms × 1e-3"),
            (a / min(peak_tflops, i * bandwidth_gbps), "intensity × GB/s gives GFLOP/s: divide by 1000 for TFLOP/s"),
            (min(1.0, a / roof), "this timing is faster than the roof allows, a measurement error: return the "
                                 "fraction as it is (above 1), so that the error shows; clamped at 1 it reads as a "
                                 "perfect kernel"),
        ]

    _grade_number(report, fraction_of_roofline, "fraction_of_roofline", cases, truth, mutants, "of the roof",
                  "achieved TFLOP/s (FLOPs / seconds / 10^12) ÷ min(peak, intensity × bandwidth / 1000)")


# ---- 02.1, 02.3, 02.4: reading measurements -------------------------------------------------------------
# The learner reads GPU timings that the course ships (src/kernelcourse/recorded/, measured by the chapter 02
# lesson on a GPU), so these exercises grade the same way with or without a GPU. Each grader asks three ways:
# about the recorded rows as the lesson shows them (they teach), about the same rows on another GPU (a T4's
# datasheet ceilings; for 02.3, an L2 that holds the largest size), and about rows derived from the recorded ones with their times scaled to
# ratios drawn fresh on every run, under ceilings (or a factor) drawn too, so that no table of answers passes.
# The statement prints the first two cases' arguments; the drawn ones it cannot.
#
# The drawn times place rows a little (0.5% to 3%) inside and outside the statement's boundary, on both sides
# of the ridge, so that only the statement's cut-off gives the right reading: 1.08x and 1.12x the roof tell
# "more than 1.1x" from 1.0x or 1.5x. The other rows sit well away from it. No row lies on a boundary, where
# "more than" and "at least" part only by rounding, which the correct formulas (in TFLOP/s, in seconds, in
# GB/s) do each their own way.

_T4 = (320.0, 65.0)  # the T4 datasheet's bandwidth (GB/s) and fp16 tensor-core peak (TFLOP/s)
_NEAR = (0.005, 0.03)  # how far from a boundary, relatively, the rows placed on either side of it lie


def _recorded(name: str) -> list[dict]:
    from ..bench import load

    return [dict(r) for r in load(name).rows]


def _recorded_ceilings() -> tuple[float, float]:
    by = {r["ceiling"]: r["value"] for r in _recorded("02_ceilings")}
    return float(by["bandwidth"]), float(by["fp16"])


def _x_roof(row: dict, bandwidth_gbps: float, peak_tflops: float) -> float:
    """Achieved over attainable performance: above 1, the point sits above the roof."""
    achieved = row["flops"] / (row["ms"] * 1e-3) / 1e12
    return achieved / min(peak_tflops, row["flops"] / row["nbytes"] * bandwidth_gbps / 1e3)


def _drawn_ceilings(rng) -> tuple[float, float]:
    """The bandwidth (GB/s) and fp16 peak (TFLOP/s) of a GPU drawn at random, its ridge between 20 and 800
    FLOP/B: the recorded 4096 and 8192 matmuls are then right of it, the elementwise ops left."""
    while True:
        bw, peak = float(round(rng.uniform(300, 5000))), round(float(rng.uniform(20, 1500)), 1)
        if 20 <= peak * 1e3 / bw <= 800:
            return bw, peak


def _near(rng, boundary: float, side: int) -> float:
    """A value a little below (``side`` -1) or above (+1) ``boundary``: 0.5% to 3% away, log-uniformly."""
    return boundary * (1 + side * math.exp(rng.uniform(math.log(_NEAR[0]), math.log(_NEAR[1]))))


def _rows_at_drawn_ratios(rng, rows: list[dict], bw: float, peak: float, boundary: float,
                          away: tuple[tuple[float, float], ...]) -> list[dict]:
    """``rows`` in their order with their times scaled so that each point sits at a drawn fraction of its roof
    under these ceilings. Left of the ridge and right of it, one row lies just below ``boundary`` × the roof
    and one just above; every other row at a ratio drawn from one of the ranges ``away`` (clear of it)."""
    ridge = peak * 1e3 / bw
    out = list(rows)
    for left in (True, False):
        side = [i for i, r in enumerate(rows) if (r["flops"] / r["nbytes"] < ridge) == left]
        for k, i in enumerate(rng.permutation(side)):
            if k < 2:
                ratio = _near(rng, boundary, (-1, 1)[k])
            else:
                ratio = float(rng.uniform(*away[int(rng.integers(len(away)))]))
            out[i] = {**rows[i], "ms": rows[i]["ms"] * _x_roof(rows[i], bw, peak) / ratio}
    return out


def _unlike_the_printed(draw, answer, printed: list, tries: int = 100):
    """``draw()`` again until ``answer`` of the case it returns is none of the ``printed`` cases' answers: a
    table of the answers the statement's own calls get must fail every drawn case, not most."""
    seen = [sorted(map(str, answer(*case))) for case in printed]
    for _ in range(tries):
        case = draw()
        if sorted(map(str, answer(*case))) not in seen:
            return case
    return case


def _names(report: Report, what: str, kind: str, fn, *args) -> list:
    """What learner code returned, as a list of ``kind``; stops the exercise if it raised, returned None or
    returned something that is not a list."""
    got = call(report, what, fn, *args)
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        report.fail(f"{what} returned {got!r}: return a list of {kind}")
        raise Stop
    return list(got)


def _grade_selection(report: Report, what: str, got: list, want: list, describe, mistakes, judge,
                     fallback: str) -> bool:
    """``got`` and ``want`` are lists compared as sets; ``mistakes`` lists (wrong answer, hint) pairs.

    On a mismatch the line says what was asked, what came back and what was expected, then each item the
    answer misjudged with ``judge(item)`` (why it belongs in the answer or not: its ratio against the
    boundary), then the hint of the known mistake the answer reproduces, else ``fallback``."""
    key = lambda items: sorted(map(str, items))  # noqa: E731
    if key(got) == key(want):
        report.ok(f"{what} = {describe(want)}")
        return True
    hint = next((h for wrong, h in mistakes if key(got) == key(wrong) and key(wrong) != key(want)), fallback)
    line = f"{what} returned {describe(got)}, expected {describe(want)}"
    given, wanted = set(map(str, got)), set(map(str, want))
    said = [judge(i) for i in want if str(i) not in given] + [judge(i) for i in got if str(i) not in wanted]
    if said:
        line += "; misjudged: " + "; ".join(said if len(said) <= 4 else said[:4] + [f"{len(said) - 4} more"])
    else:  # the same items, one of them more than once
        hint = "list each one once"
    report.fail(line, hint)
    return False


def _short(item) -> str:
    """``item`` as a learner returned it, cut short when long (a whole row instead of its index)."""
    text = repr(item)
    return text if len(text) <= 60 else text[:57] + "..."


@exercise("02.1", "which timings are impossible?", names=("impossible_timings",), time_limit_s=20)
def grade_impossible_timings(report: Report, impossible_timings):
    rng = fresh_rng(report)
    recorded = _recorded("02_timing")
    cases = [("recorded 02_timing rows", recorded, _recorded_ceilings(), "the recorded GPU's ceilings"),
             ("recorded 02_timing rows", recorded, _T4, "a T4's datasheet ceilings")]
    def draw():  # its own ceilings; rows at 1.08x and 1.12x the roof, say, on both sides of the ridge
        b, p = _drawn_ceilings(rng)
        return ("02_timing rows with times drawn for this run", _rows_at_drawn_ratios(
            rng, recorded, b, p, 1.1, ((0.3, 0.9), (1.3, 20.0))), (b, p), "ceilings drawn for this run")

    def impossible(_, rows, ceilings, __):  # the answer to a case: also what the learner's must be
        return [i for i, r in enumerate(rows) if _x_roof(r, *ceilings) > 1.1]

    cases += [_unlike_the_printed(draw, impossible, cases[:2]) for _ in range(2)]
    for rows_are, rows, (b, p), label in cases:
        what = f"impossible_timings({rows_are}, {b:.6g}, {p:.6g})  [{label}]"
        got = _names(report, what, "row indices", impossible_timings, [dict(r) for r in rows], b, p)
        if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in got):
            return report.fail(f"{what} returned {_short(got)}: return the indices (ints) of the rows, not "
                               "the rows")
        x = [_x_roof(r, b, p) for r in rows]
        want = impossible(rows_are, rows, (b, p), label)
        compute_only = [i for i, r in enumerate(rows)
                        if r["flops"] / (r["ms"] * 1e-3) / 1e12 > 1.1 * p]
        memory_only = [i for i, r in enumerate(rows) if r["nbytes"] / (r["ms"] * 1e-3) / 1e9 > 1.1 * b]
        mistakes = [
            ([i for i, v in enumerate(x) if v > 1.0], "allow the 10% margin: measured ceilings are not exact "
                                                      "limits, so flag only points more than 1.1x their roof"),
            (compute_only, "you compared with the compute peak only: a memory-bound op's roof is intensity × "
                           "bandwidth, lower than the peak"),
            (memory_only, "you compared with the bandwidth only: a compute-bound op's roof is the peak"),
            ([i for i, v in enumerate(x) if v < 1 / 1.1], "inverted: a point is impossible when it is faster "
                                                          "than the roof allows, above it"),
        ]

        def row(i, rows=rows):
            return rows[i] if 0 <= i < len(rows) else None

        def describe(idx, rows=rows, x=x):
            named = [f"{i} ({rows[i]['op']}, {rows[i]['method']}: {x[i]:.3f}x)" if row(i) else repr(i) for i in idx]
            return "[" + ", ".join(named if len(named) <= 4 else named[:3] + [f"... {len(named)} rows in all"]) + "]"

        def judge(i, rows=rows, x=x):
            if not row(i):
                return f"{i!r} is not the index of one of these {len(rows)} rows"
            return (f"row {i} ({rows[i]['op']}, {rows[i]['method']}) is at {x[i]:.3f}x its roof, "
                    + ("more than 1.1x, so impossible" if x[i] > 1.1 else "not more than 1.1x, so possible"))

        if not _grade_selection(report, what, got, want, describe, mistakes, judge,
                                "a timing is impossible when its achieved TFLOP/s is more than 1.1 × "
                                "min(peak, intensity × bandwidth / 1000): a margin of 10%, no more and no less"):
            return


@exercise("02.3", "where the L2 cache stops helping", names=("served_from_l2",), time_limit_s=20)
def grade_served_from_l2(report: Report, served_from_l2):
    rng = fresh_rng(report)
    rows = [r for r in _recorded("02_timing") if r.get("part") == "L2"]
    ops = sorted({r["op"] for r in rows}, key=lambda op: next(r["nbytes"] for r in rows if r["op"] == op))
    bw, _ = _recorded_ceilings()

    def speedup(op, data):
        t = {r["method"].split(",")[0]: r["ms"] for r in data if r["op"] == op}
        return t["do_bench"] / t["hot loop"]

    # the recorded rows, then the same rows with the hot loop of the largest size made 3x faster (as if this
    # GPU's L2 were larger than its inputs): the reading must follow the data
    bigger_l2 = [dict(r) for r in rows]
    for r in bigger_l2:
        if r["op"] == ops[-1] and r["method"].startswith("hot"):
            r["ms"] /= 3
    cases = [("recorded L2 rows", rows, 1.5, False),
             ("L2 rows as on a GPU with a larger L2", bigger_l2, 1.5, False)]  # (rows, factor, drawn?)

    def drawn(low, high):
        """The rows with times drawn for a factor drawn in [low, high]: the flushed times scaled (another GPU),
        the hot ones to speed-ups that fall with size, as on a GPU whose L2 holds the k smallest sizes (k drawn),
        the k-th just above the factor, the next just below it."""
        factor = round(float(rng.uniform(low, high)), 2)
        k = int(rng.integers(1, len(ops)))
        served = sorted((factor * float(rng.uniform(1.25, 3.0)) for _ in range(k - 1)), reverse=True)
        missed = sorted((float(rng.uniform(0.9, factor / 1.25)) for _ in range(len(ops) - k - 1)), reverse=True)
        by_op = dict(zip(ops, served + [_near(rng, factor, 1), _near(rng, factor, -1)] + missed))
        scale = float(rng.uniform(0.5, 2.0))
        flushed = {r["op"]: r["ms"] * scale for r in rows if r["method"].startswith("do_bench")}
        data = [{**r, "ms": flushed[r["op"]] / (1.0 if r["method"].startswith("do_bench") else by_op[r["op"]])}
                for r in rows]
        return "L2 rows with times drawn for this run", data, factor, True

    # one factor below 2 and one above: a function that ignores its factor, whatever cut-off it keeps
    # instead, lies outside the 0.5-3% either side of at least one of them
    def served(_, data, factor, __):  # the answer to a case: also what the learner's must be
        return [op for op in ops if speedup(op, data) >= factor]

    cases += [_unlike_the_printed(lambda: drawn(1.15, 1.9), served, cases[:2]),
              _unlike_the_printed(lambda: drawn(2.1, 4.0), served, cases[:2])]
    for label, data, factor, drawn_case in cases:
        what = f"served_from_l2({label}, factor={factor:g})"
        got = _names(report, what, "op names (the rows' 'op')", served_from_l2, [dict(r) for r in data], factor)
        if any(isinstance(n, dict) for n in got):
            return report.fail(f"{what} returned {_short(got)}: return the op names (each row's 'op'), not the rows")
        want = served(label, data, factor, drawn_case)
        mistakes = [
            ([op for op in ops if speedup(op, data) >= 1.5], f"that is what factor=1.5 (the statement's example) "
                                                            f"selects, and this call passed factor={factor:g}: did "
                                                            "you compare with the argument?"),
            # inverted, the drawn rows (no hot loop slower than flushed by the factor) select nothing: an
            # empty answer there is a wrong cut-off, and an inverted reading fails on the recorded rows first
            ([op for op in ops if 1 / speedup(op, data) >= factor] if not drawn_case else want,
             "inverted: the speed-up is the flushed time divided by the hot time"),
            ([op for op in ops if any(r["op"] == op and r["method"].startswith("hot")
                                      and r["nbytes"] / (r["ms"] * 1e-3) / 1e9 > bw for r in data)],
             "you compared the hot loop with the HBM bandwidth; the question compares the two timings of each size"),
            (ops, "compare each size's hot and flushed times: only some sizes get the factor"),
        ]

        def describe(names, data=data):
            return "[" + ", ".join(f"{n} ({speedup(n, data):.3f}x)" if n in ops else _short(n) for n in names) + "]"

        def judge(op, data=data, factor=factor):
            if op not in ops:
                return f"{_short(op)} is not the op of any of these rows"
            s = speedup(op, data)
            return (f"{op} runs {s:.3f}x faster hot than flushed, " + (
                f"at least factor={factor:g}, so served" if s >= factor else f"below factor={factor:g}, so not served"))

        if not _grade_selection(report, what, got, want, describe, mistakes, judge,
                                "keep the ops whose flushed time ÷ hot time is at least factor, the argument "
                                "(a speed-up equal to it counts)"):
            return


@exercise("02.4", "which ops are far below their roof?", names=("below_half_roof",), time_limit_s=20)
def grade_below_half_roof(report: Report, below_half_roof):
    rng = fresh_rng(report)
    recorded = _recorded("02_ops")
    cases = [("recorded 02_ops rows", recorded, _recorded_ceilings(), "the recorded GPU's ceilings"),
             ("recorded 02_ops rows", recorded, _T4, "a T4's datasheet ceilings")]
    def draw():  # its own ceilings; rows at 47% and 53% of the roof, say, on both sides of the ridge
        b, p = _drawn_ceilings(rng)
        return ("02_ops rows with times drawn for this run", _rows_at_drawn_ratios(
            rng, recorded, b, p, 0.5, ((0.05, 0.4), (0.6, 0.98))), (b, p), "ceilings drawn for this run")

    def below_half(_, rows, ceilings, __):  # the answer to a case: also what the learner's must be
        return [r["op"] for r in rows if _x_roof(r, *ceilings) < 0.5]

    cases += [_unlike_the_printed(draw, below_half, cases[:2]) for _ in range(2)]
    for rows_are, rows, (b, p), label in cases:
        what = f"below_half_roof({rows_are}, {b:.6g}, {p:.6g})  [{label}]"
        got = _names(report, what, "op names", below_half_roof, [dict(r) for r in rows], b, p)
        if any(isinstance(n, dict) for n in got):
            return report.fail(f"{what} returned {_short(got)}: return the op names (each row's 'op'), not the rows")
        x = {r["op"]: _x_roof(r, b, p) for r in rows}
        want = below_half(rows_are, rows, (b, p), label)
        tflops = {r["op"]: r["flops"] / (r["ms"] * 1e-3) / 1e12 for r in rows}
        gbps = {r["op"]: r["nbytes"] / (r["ms"] * 1e-3) / 1e9 for r in rows}
        mistakes = [
            ([op for op, t in tflops.items() if t < 0.5 * p], "you compared with the compute peak only: a "
                                                              "memory-bound op's roof is intensity × bandwidth"),
            ([op for op, g in gbps.items() if g < 0.5 * b], "you compared with the bandwidth only: a "
                                                            "compute-bound op's roof is the peak"),
            ([op for op, v in x.items() if v > 0.5], "inverted: keep the ops that reach less than half their roof"),
        ]

        def describe(names, x=x):
            return "[" + ", ".join(f"{n} ({x[n]:.1%})" if n in x else _short(n) for n in names) + "]"

        def judge(op, x=x):
            if op not in x:
                return f"{_short(op)} is not the op of any of these rows"
            return f"{op} reaches {x[op]:.1%} of its roof, " + ("below half" if x[op] < 0.5 else "not below half")

        if not _grade_selection(report, what, got, want, describe, mistakes, judge,
                                "keep the ops whose achieved TFLOP/s is below 0.5 × min(peak, intensity × "
                                "bandwidth / 1000): half the roof, no other fraction"):
            return
