"""Graders for chapter 03, fusion IO accounting: bytes moved, fused and unfused, and the ledger.

The exercises' reference counts follow the rules of ``kc.ledger`` (compulsory traffic: each input
read once, each output written once, intermediates of a fused kernel kept on chip), and the graders
check them against the ledger itself where a small example can be run. Cases are drawn fresh on every
run (failing lines name the seed; ``KC_GRADE_SEED`` draws them again), the first one so that the usual
mistakes all give different numbers there, and a line shows the expected value only when it fails.
"""
from __future__ import annotations

import math

import numpy as np

from . import Report, call, exercise, fresh_rng, number
from . import harness

STATS_ITEMSIZE = 4  # PyTorch's GPU LayerNorm keeps its mean and rstd in float32 whatever x's dtype


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def _grade_numbers(report: Report, fn, name: str, cases, truth, wrong, unit: str = "bytes") -> None:
    """Grade ``fn`` on ``cases``; ``wrong(*case)`` lists (value, hint) of typical mistakes.

    ``cases`` may be a function of (rng, truth, wrong) drawing them: it gets this run's fresh generator.
    """
    if callable(cases):
        cases = cases(fresh_rng(report), truth, wrong)
    for case in cases:
        what = f"{name}{tuple(case)}"
        got = number(report, what, fn, *case)
        if got is None:
            return
        want = truth(*case)
        shown = f"{want:,}" if isinstance(want, int) else f"{want:.6g}"
        if _close(got, want):
            report.ok(f"{what} = {shown} {unit}".rstrip())
            continue
        hint = next((h for value, h in wrong(*case) if _close(got, value)), None)
        got_shown = f"{int(got):,}" if float(got).is_integer() else f"{got:.6g}"
        report.fail(f"{what} returned {got_shown}, expected {shown}: "
                    + (hint or "recount, op by op: what does each kernel read, and what does it write?"))
        return


def separating(rng, draw, truth, wrong):
    """A case from ``draw(rng)`` on which the answer and every known mistake give different numbers,
    so that the hint of a first failing case names the right mistake."""
    return harness.separating(rng, draw, lambda case: [truth(*case)] + [v for v, _ in wrong(*case)], _close)


def _cases(count: int):
    """(rows, cols, itemsize), fresh every run: a small case that separates the mistakes, a single row,
    then random shapes of every kind."""
    def draw(rng):
        return int(rng.integers(2, 10)), int(rng.integers(2, 10)), int(rng.choice([2, 4, 8]))

    def cases(rng, truth, wrong):
        out = [separating(rng, draw, truth, wrong), (1, int(rng.integers(1000, 9000)), int(rng.choice([2, 4])))]
        while len(out) < count:
            rows = int(rng.choice([int(rng.integers(2, 100)), int(rng.integers(1000, 70000))]))
            cols = int(rng.choice([int(rng.integers(2, 100)), int(rng.integers(500, 20000))]))
            out.append((rows, cols, int(rng.choice([1, 2, 4, 8]))))
        return out
    return cases


def _ledger_example(report: Report, fn, name: str, block, make_args, count_args) -> None:
    """Check the learner's count against ``kc.ledger`` on a small float32 example."""
    import torch

    from .. import ledger

    rng = np.random.default_rng(report.seed)
    rows, cols = int(rng.integers(2, 12)), int(rng.integers(2, 12))
    torch.manual_seed(int(rng.integers(2**31)))
    measured = count_args(ledger.measure(block, *make_args(rows, cols)))
    got = number(report, f"{name}({rows}, {cols}, 4)", fn, rows, cols, 4)
    if got is None:
        return
    report.expect(_close(got, measured), f"matches kc.ledger on a ({rows}, {cols}) float32 example",
                  f"kc.ledger counts {measured} bytes on a ({rows}, {cols}) float32 example, you said {got:g}")


# ---- 03.1 and 03.2: the scaled GELU block, unfused and fused ----------------------------------


def scaled_gelu_block(x, w, b):  # the block the statements show: x, w (rows, cols); b (cols,)
    import torch.nn.functional as F

    h = x * w
    h = h + b
    return F.gelu(h)


def _block_args(rows, cols):
    import torch

    return torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols)


@exercise("03.1", "bytes of an unfused chain", names=("block_unfused_bytes",), time_limit_s=30)
def grade_unfused(report: Report, block_unfused_bytes):
    def truth(rows, cols, s):
        return (7 * rows * cols + cols) * s

    def wrong(rows, cols, s):
        n = rows * cols
        return [((8 * n) * s, "the bias is (cols,), broadcast over the rows: it is read once, cols elements, "
                              "not rows × cols"),
                ((3 * n + cols) * s, "that is the fused count: unfused, each h is written by one kernel and read "
                                     "back by the next"),
                (7 * n * s, "the add reads the bias too: cols more elements"),
                ((4 * n + cols) * s, "you counted only reads: each kernel also writes its output"),
                (3 * n * s, "you counted only writes: each kernel also reads its inputs"),
                ((6 * n + cols) * s, "the multiply reads two full tensors, x and w"),
                (6 * n * s, "the 2kN rule is for ops with one input: the multiply also reads w, the add reads b"),
                (7 * n + cols, "multiply the element count by itemsize, the bytes per element")]

    _grade_numbers(report, block_unfused_bytes, "block_unfused_bytes", _cases(6), truth, wrong)
    if report.failures == 0:
        _ledger_example(report, block_unfused_bytes, "block_unfused_bytes", scaled_gelu_block, _block_args,
                        lambda led: led.total)


@exercise("03.2", "bytes of the fused chain", names=("block_fused_bytes",), time_limit_s=30)
def grade_fused(report: Report, block_fused_bytes):
    def truth(rows, cols, s):
        return (3 * rows * cols + cols) * s

    def wrong(rows, cols, s):
        n = rows * cols
        return [(2 * n * s, "the fused kernel still reads every input once: x, w and the bias"),
                (3 * n * s, "the fused kernel reads the bias too: cols elements"),
                ((5 * n + cols) * s, "inside one kernel, h stays in registers: it never reaches memory"),
                ((4 * n + cols) * s, "inside one kernel, h stays in registers: it never reaches memory"),
                (4 * n * s, "the bias is (cols,), broadcast over the rows: it is read once, cols elements"),
                ((7 * n + cols) * s, "that is the unfused count: fused, only the inputs and the result move"),
                (3 * n + cols, "multiply the element count by itemsize, the bytes per element")]

    _grade_numbers(report, block_fused_bytes, "block_fused_bytes", _cases(6), truth, wrong)
    if report.failures == 0:
        _ledger_example(report, block_fused_bytes, "block_fused_bytes", scaled_gelu_block, _block_args,
                        lambda led: led.fused_bytes())


# ---- 03.3 the IO reduction factor with extra operands --------------------------------------------


@exercise("03.3", "the IO reduction factor", names=("io_reduction",), time_limit_s=30)
def grade_io_reduction(report: Report, io_reduction):
    def draw(r, k_low=1, extra_low=0):  # k ops, 0 <= extra <= k, as the statement says
        k = int(r.integers(k_low, 12))
        return k, int(r.integers(extra_low, k + 1))

    def cases(rng, truth, wrong):  # fresh every run: no extra operand, then some, k from 1
        first = separating(rng, lambda r: draw(r, 2, 1), truth, wrong)
        return [first, (int(rng.integers(2, 10)), 0), (1, int(rng.integers(0, 2)))] + [draw(rng) for _ in range(4)]

    def truth(k, extra):
        return (2 * k + extra) / (2 + extra)

    def wrong(k, extra):
        return [(k, "the extra operands are read in both versions: fusion cannot shrink them, so the "
                    "reduction is less than k"),
                ((2 * k + 2 * extra) / (2 + extra), "an extra operand is only read, once, in both versions"),
                ((2 * k + extra) / 2, "the fused kernel still reads the extra operands: 2 + extra in the denominator"),
                (2 * k / (2 + extra), "unfused, the extra operands are read too: 2k + extra in the numerator"),
                ((k + extra) / (1 + extra), "count each op's read and its write: 2k, not k"),
                ((2 + extra) / (2 * k + extra), "that is fused / unfused: the reduction is unfused / fused, at least 1")]

    _grade_numbers(report, io_reduction, "io_reduction", cases, truth, wrong, unit="")


# ---- 03.4 LayerNorm forward with its statistics ------------------------------------------------


@exercise("03.4", "bytes of a LayerNorm forward", names=("layernorm_bytes",), time_limit_s=30)
def grade_layernorm(report: Report, layernorm_bytes):
    def truth(rows, cols, s):
        return (2 * rows * cols + 2 * cols) * s + 2 * rows * STATS_ITEMSIZE

    def wrong(rows, cols, s):
        n = rows * cols
        stats = 2 * rows * STATS_ITEMSIZE
        return [((2 * n + 2 * cols) * s, "LayerNorm also writes its statistics for the backward pass: a mean and "
                                         "an rstd per row, in float32"),
                ((2 * n + 2 * cols) * s + 2 * rows * s, "the statistics are float32, 4 bytes each, whatever x's dtype"),
                ((2 * n + 2 * cols) * s + 2 * n * STATS_ITEMSIZE, "one mean and one rstd per row, not per element"),
                ((2 * n + 2 * cols) * s + rows * STATS_ITEMSIZE, "two statistics per row: the mean and the rstd"),
                (2 * n * s + stats, "the kernel reads weight and bias too: 2 × cols elements"),
                ((4 * n) * s + stats, "weight and bias are (cols,), shared by every row"),
                ((3 * n + 2 * cols) * s + stats, "a fused LayerNorm keeps its row on chip between computing the "
                                                 "statistics and normalizing: x is read once"),
                (2 * n + 2 * cols + 2 * rows, "multiply by the bytes per element: itemsize for x, y, weight and "
                                              "bias, 4 for the statistics")]

    _grade_numbers(report, layernorm_bytes, "layernorm_bytes", _cases(6), truth, wrong)
    if report.failures:
        return
    import torch
    import torch.nn.functional as F

    def layernorm(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b)

    # In float32 the statistics are float32 on every device, so the ledger's count is the answer.
    _ledger_example(report, layernorm_bytes, "layernorm_bytes", layernorm,
                    lambda r, c: (torch.randn(r, c), torch.randn(c), torch.randn(c)), lambda led: led.total)


# ---- 03.5 fusions that would not reduce traffic ------------------------------------------------

NO_SAVING = {"B", "C", "E"}
WHY = {
    "A": "A does cut traffic: fused, x is read once and y written once, 2N + C instead of 4N + C",
    "B": "B saves nothing: the sum must be complete before any element is divided and x does not fit on chip, "
         "so even one kernel reads x twice, 3N as with two kernels",
    "C": "C saves nothing: a and b share no data, so one kernel or two, each is read once and written once "
         "(it saves a launch, not bytes)",
    "D": "D does cut traffic: h must still be written for the backward pass, but the fused kernel never reads it "
         "back, 5N becomes 4N",
    "E": "E saves nothing: a view moves no bytes, so there is nothing to fuse away",
    "F": "F does cut traffic: a 1024-element row fits on chip, so softmax and dropout read it once and write once",
    "G": "G does cut traffic: the product is never written and read back; whether it saves time is another "
         "matter, since a large matmul is compute-bound",
}


QUESTION = {  # a question for each proposal that leads to its verdict without stating it
    "A": "eager PyTorch writes x + b to HBM and reads it back for the GELU; does one kernel have to?",
    "B": "the division needs the complete sum before its first element; can one kernel avoid reading x "
         "twice when x does not fit on chip?",
    "C": "do the two computations share any bytes that one kernel could move once instead of twice?",
    "D": "h must be written either way; is it also read back by a second kernel when they are separate?",
    "E": "how many bytes does a view move on its own?",
    "F": "does a 1024-element row fit on chip, so that softmax's output can go straight into the dropout?",
    "G": "the product is written and read back when the ReLU is a separate kernel; is it when the ReLU is "
         "in the epilogue? (bytes, not time)",
}


@exercise("03.5", "fusions that save no traffic", names=("no_traffic_saved",), time_limit_s=10)
def grade_no_saving(report: Report, no_traffic_saved):
    got = call(report, "no_traffic_saved()", no_traffic_saved)
    if isinstance(got, str):
        got = [c for c in got if not c.isspace() and c not in ",;"]
    try:
        letters = {str(c).strip().upper() for c in got}
    except TypeError:
        return report.fail(f"no_traffic_saved() returned {got!r}: return a set of letters, e.g. {{'A', 'F'}}")
    unknown = letters - set(WHY)
    if unknown:
        return report.fail(f"no_traffic_saved() returned {sorted(unknown)}: the choices are the letters A to G")
    wrong = [letter for letter in sorted(WHY) if (letter in letters) != (letter in NO_SAVING)]
    if not wrong:
        # right as a whole: now every explanation can be shown
        for letter in sorted(WHY):
            report.ok(WHY[letter])
        return
    # Wrong: say how many, and ask about one of them without giving its verdict, so that trying again
    # does not reveal the answers.
    report.fail(f"{len(wrong)} of the 7 proposals are judged wrongly; think again about {wrong[0]}: "
                f"{QUESTION[wrong[0]]}")


# ---- 03.6 a predicted speed-up with a launch floor ---------------------------------------------


@exercise("03.6", "predict the speed-up of fusion", names=("predicted_speedup",), time_limit_s=30)
def grade_speedup(report: Report, predicted_speedup):
    def cases(rng, truth, wrong):
        # fresh every run: launch-bound (small), bandwidth-bound (large) and in between
        def draw(rows_range):
            return (int(rng.integers(*rows_range)), int(rng.integers(500, 8192)), int(rng.choice([1, 2, 4, 8])),
                    round(float(rng.uniform(300, 5000)), 1), round(float(rng.uniform(1.5, 6.0)), 2))
        first = separating(rng, lambda r: draw((64, 2048)), truth, wrong)
        return [first, draw((1, 4)), draw((20000, 70000)), draw((100, 1000)), draw((2000, 9000))]

    def model(rows, cols, s, gbps, launch_us, kernels=(3, 1), bw_unit=1e9, launch_unit=1e-6):
        n = rows * cols
        unfused = kernels[0] * launch_us * launch_unit + (7 * n + cols) * s / (gbps * bw_unit)
        fused = kernels[1] * launch_us * launch_unit + (3 * n + cols) * s / (gbps * bw_unit)
        return unfused / fused

    def truth(*case):
        return model(*case)

    def wrong(rows, cols, s, gbps, launch_us):
        n = rows * cols
        case = (rows, cols, s, gbps, launch_us)
        return [((7 * n + cols) / (3 * n + cols), "at small sizes the launches dominate: add kernels × launch_us "
                                                  "to each time (3 launches unfused, 1 fused)"),
                (3.0, "at large sizes the bytes dominate: add bytes / bandwidth to each time"),
                (model(*case, kernels=(1, 1)), "fusion also removes launches: 3 kernels unfused, 1 fused"),
                (model(*case, kernels=(3, 3)), "fusion also removes launches: 3 kernels unfused, 1 fused"),
                (model(*case, bw_unit=2**30), "GB/s is 10^9 bytes per second, not 2^30"),
                (model(*case, launch_unit=1e-3), "launch_us is in microseconds: 1e-6 s"),
                (model(*case, launch_unit=1.0), "launch_us is in microseconds: 1e-6 s"),
                (1 / model(*case), "that is T_fused / T_unfused: the speed-up is T_unfused / T_fused")]

    _grade_numbers(report, predicted_speedup, "predicted_speedup", cases, truth, wrong, unit="x")


# ---- 03.7 the largest intermediate, found with the ledger --------------------------------------


def _hidden_functions(rng=None):
    """(name, fn, args) of functions whose largest intermediate the learner must find, with shapes
    drawn from ``rng`` (fresh every run when grading)."""
    import torch
    import torch.nn.functional as F

    rng = rng if rng is not None else np.random.default_rng(37)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def size(low, high):
        return int(rng.integers(low, high + 1))

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    def attention(q, k, v):  # (B, H, T, d): the (B, H, T, T) scores are the big intermediate
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(s, dim=-1) @ v

    def cross_entropy(logits, target):  # (T, V) bf16 logits, cast to float32 first
        return F.cross_entropy(logits.float(), target)

    def outer_norm(x):  # returns its biggest tensor, scaled in place: the intermediates are small
        s = x.sum(dim=1)
        y = torch.outer(s, s)
        y.div_(s.abs().max())
        return y

    def mlp(x, w1, w2):  # the hidden activation is 4x wider than the input
        h = x @ w1
        h = F.gelu(h)
        return h @ w2

    def transposed_head(x):  # a large view of the input, then a small intermediate
        xt = x.t()
        head = xt[:, :4] * 2.0
        return head.sum(dim=1)

    def layer_norm_rows(x, w, b):  # a multi-output op: out, mean and rstd are three tensors
        y = F.layer_norm(x, (x.shape[-1],), w, b)
        return y.sum(dim=0)

    # Each of the next three returns a view of its biggest tensor, not the tensor itself: a tensor
    # returned through a view of it is returned, so the answer is a smaller tensor made before it.
    def scores_transposed(q, k):  # (n, d), (m, d): the (n, m) scores come back as an (m, n) transpose
        s = (q * q.shape[-1] ** -0.5) @ k.t()
        return s.t()

    def gram_flat(x):  # (n, d): the (n, n) Gram matrix of the normalised rows, flattened by a view
        xn = x / x.norm(dim=1, keepdim=True)
        return (xn @ xn.t()).view(-1)

    def qkv_keys(x, w):  # (n, e), (e, 3c): one projection to q, k and v side by side, k is a slice of it
        qkv = F.silu(x) @ w
        c = w.shape[1] // 3
        return qkv[:, c:2 * c]

    b, h, t, d = size(1, 3), size(2, 4), size(48, 80), size(8, 24)
    rows, vocab = size(64, 128), size(400, 700)
    m, k = size(32, 64), size(16, 48)
    return [
        ("attention", attention, tuple(rand(b, h, t, d) for _ in range(3))),
        ("cross_entropy", cross_entropy, (rand(rows, vocab, dtype=torch.bfloat16),
                                          torch.randint(0, vocab, (rows,), generator=g))),
        ("outer_norm", outer_norm, (rand(size(200, 400), size(4, 10)),)),
        ("mlp", mlp, (rand(m, k), rand(k, 4 * k), rand(4 * k, k))),
        ("transposed_head", transposed_head, (rand(size(150, 250), size(60, 120)),)),
        ("layer_norm_rows", layer_norm_rows, (rand(size(30, 50), 64), rand(64), rand(64))),
        # drawn after the others, so that a seed draws the same shapes for those as before
        ("scores_transposed", scores_transposed, (rand(size(40, 90), 16), rand(size(50, 120), 16))),
        ("gram_flat", gram_flat, (rand(size(60, 120), size(8, 24)),)),
        ("qkv_keys", qkv_keys, (rand(size(30, 60), 24), rand(24, 3 * size(40, 64)))),
    ]


@exercise("03.7", "find the largest intermediate", names=("largest_intermediate_bytes",), time_limit_s=60)
def grade_largest_intermediate(report: Report, largest_intermediate_bytes):
    for name, fn, args in _hidden_functions(fresh_rng(report)):
        if not _grade_intermediate(report, largest_intermediate_bytes, name, fn, args):
            return


def _grade_intermediate(report: Report, largest_intermediate_bytes, name, fn, args) -> bool:
    from .. import ledger

    led = ledger.measure(fn, *args)
    want = led.largest_intermediate().nbytes
    what = f"largest_intermediate_bytes({name}, ...)"
    got = number(report, what, largest_intermediate_bytes, fn, *args)
    if got is None:
        return False
    if _close(got, want):
        report.ok(f"{what} = {want:,} bytes")
        return True
    outputs = ledger._tensors(led.outputs)
    returned = [ledger.footprint(t) for t in outputs]
    given = [ledger.footprint(t) for t in ledger._tensors(args)]
    row_totals = [r.bytes_written for r in led.rows]
    # tensors fn made and returns only through a view of them: same storage, another shape or stride
    shapes = {ledger.TensorInfo.of(t) for t in outputs}
    storages = {led._storage(t) for t in outputs}
    viewed = [(info, led.rows[row].name) for row, info, storage in led._fresh
              if storage in storages and info not in shapes]
    through_view = next(((info, op) for info, op in viewed if _close(got, info.nbytes)), None)
    if through_view is not None and got > want:
        info, op = through_view
        hint = (f"that is the {info} that {op} made, and fn returns a view of it "
                f"({', '.join(str(ledger.TensorInfo.of(t)) for t in outputs)}): a tensor returned through "
                "a view of it is returned, not an intermediate; a view shares its tensor's storage")
    elif any(_close(got, b) for b in returned) and got > want:
        hint = "that tensor is what fn returns, not an intermediate: leave out the outputs"
    elif any(_close(got, b) for b in given):
        hint = ("that is the size of one of fn's inputs, or of a view of one: a view makes no tensor, and "
                "inputs are not intermediates")
    elif any(_close(got, b) for b in row_totals):
        hint = "that is everything one op wrote: an op can write several tensors; count one tensor"
    elif _close(got, led.total) or _close(got, led.total_written):
        hint = "that is the ledger's total traffic, not one tensor"
    else:
        hint = "measure fn with kc.ledger.measure(fn, *args) and look at the tensors its ops made"
    report.fail(f"{what} returned {got:,.0f}, expected {want:,}: {hint}")
    return False
