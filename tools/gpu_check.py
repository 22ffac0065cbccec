"""Check the whole course on this machine's CUDA GPU, then print one summary table.

    python3 tools/gpu_check.py          # or: make gpu-check PYTHON=python3

It runs, with the interpreter that runs it (no virtual environment is built or needed):
  1. the unit tests (pytest tests), each one GPU-safe or skipped here with its reason;
  2. every lesson in notebooks/ and every solution in solutions/ under nbval, in the GPU world;
  3. the grade report on every solution (every exercise must pass: on a GPU, speed checks are graded too)
     and on every generated exercise stub (every exercise must fail).
The table says what ran, passed, failed and was skipped (and why), how long each part took, on which GPU
and with which versions. The exit status is 0 only when everything passed. The package is imported
from this checkout's src/, whatever is installed.

    python3 tools/gpu_check.py --pre-hopper    # or: make gpu-check PREHOPPER=1

checks, on a Hopper GPU, the paths that GPUs before Hopper take: Triton emits Ampere's mma.sync instead of
wgmma (DISABLE_MMA_V3=1), the course treats the GPU as compute capability 8.0 (KC_MAX_CAPABILITY: the
attention versions that load through pointers) and as having an L4's 99 KB of shared memory per block
(KC_MAX_SHARED_MEM; --max-shared-mem 65536 for a T4's). A T4's scalar-FMA tl.dot needs a T4 itself; its
lowering is checked on any machine by tests/test_targets.py.

    python3 tools/gpu_check.py --as-t4         # or: make gpu-check T4=1

goes one step further down: the course treats the GPU as a T4 (compute capability 7.5: float16 where a
chapter computes in bfloat16, the pointer attention, the pruners' estimates for an FMA tl.dot within a
T4's 64 KB of shared memory), with mma.sync as under --pre-hopper. Every choice the course makes for a T4
runs; Triton's tl.dot still runs on this GPU's tensor cores, so the speed checks compare with the peers
of a GPU whose tl.dot has them, not with a T4's.

On a machine with several GPUs the work is shared out: each GPU runs one piece at a time (a lesson, a
solution, a notebook's grades, a group of test files), longest first, in its own process that sees that GPU
alone (CUDA_VISIBLE_DEVICES). A speed check then has its GPU to itself. --gpus N uses the first N.

    python3 tools/gpu_check.py --stamp         # or: make gpu-check STAMP=1

executes each lesson whose stamp is stale (its code changed since its GPU run) with tools/stamp.py --record
instead of nbval, so that checking the course and stamping what changed cost one run of each lesson;
--restamp NN also stamps lesson NN (one whose printed results depend on package code that changed), and a
lesson that prints a stamped lesson's recorded results (chapter 09 prints chapter 08's launch costs) is
stamped after it. The lessons it stamps run first, one at a time, with nothing else on the machine: their
timings are published.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
# What the checks import, and the pip name of each: the notebook stack is what a bare GPU machine lacks.
NEEDED = {"torch": "torch", "triton": "triton", "numpy": "numpy", "numba": "numba", "numba_cuda": "numba-cuda", "pytest": "pytest",
          "nbval": "nbval", "nbclient": "nbclient", "nbformat": "nbformat", "ipykernel": "ipykernel",
          "matplotlib": "matplotlib", "yaml": "pyyaml"}
# tests/test_exercises.py grades every stub and every solution: here that is part 3, reported per exercise.
GRADE_TESTS = "not test_generated_stubs_fail_every_grader and not test_solutions_pass_every_grader"
# The parts, in the order they run: --only picks some (a machine's time may not hold all of them at once).
PARTS = ("tests", "lessons", "solutions", "grades")
# Test files that belong to one chapter (besides tests/test_grading_chNN.py), for --chapter.
CHAPTER_TESTS = {"02": ["test_roofline.py"], "03": ["test_ledger.py"], "04": ["test_group_norm.py"],
                 "05": ["test_targets.py"], "06": ["test_attention.py", "test_attention_op.py"],
                 "07": ["test_attention_backward.py"],
                 "08": ["test_transformer.py", "test_ops_rows.py", "test_losses.py", "test_bench_profile.py"],
                 "09": ["test_hf.py"]}
# --pre-hopper: what GPUs before Hopper get, on a Hopper GPU (see the docstring)
PRE_HOPPER = {"DISABLE_MMA_V3": "1", "KC_MAX_CAPABILITY": "8.0"}
PRE_HOPPER_SHARED_MEM = 99 * 1024          # an L4's shared memory per block, the least of Colab's Ampere and Ada GPUs
# --as-t4: the course's choices for a T4, on a newer GPU (see the docstring)
AS_T4 = {"DISABLE_MMA_V3": "1", "KC_MAX_CAPABILITY": "7.5"}
T4_SHARED_MEM = 64 * 1024
EMULATED = "DISABLE_MMA_V3 (gpu_check --pre-hopper or --as-t4)"  # how world.pre_hopper_emulation says why
SLOWEST = 12                               # the slowest tests the summary names
EXTRA_ENV: dict[str, str] = {}             # set by main() from the flags, passed to every child process


@dataclass
class Part:
    what: str
    unit: str                      # what one item is: a test, a cell, an exercise
    ran: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    skips: Counter = field(default_factory=Counter)
    error: str = ""                # the part could not run at all
    left_out: bool = False         # not run on purpose (--only): neither a pass nor a failure
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (seconds, test): where a part's time goes

    @property
    def ok(self) -> bool:
        return self.left_out or (not self.error and self.failed == 0 and self.ran > 0)

    def add(self, other: "Part") -> None:
        """Count a piece of this part that ran on its own (on one GPU of several) into the part."""
        self.ran += other.ran
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.seconds += other.seconds
        self.failures += other.failures
        self.skips.update(other.skips)
        self.slowest = sorted(self.slowest + other.slowest, reverse=True)[:SLOWEST]
        self.error = "; ".join(filter(None, [self.error, other.error]))


@dataclass
class Job:
    """One piece of a part, run in a process of its own on one GPU."""
    part: Part
    label: str
    weight: float                  # the seconds it is expected to take: the longest start first
    do: Callable[[Part, dict], None]
    alone: bool = False            # runs with nothing else on the machine (a stamp: its timings are published)


def missing_stack() -> list[str]:
    return sorted({pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None})


# Thread pools a process sizes from the machine's cores: CPU-side BLAS (the graders' float64 references) and
# torch.compile's compile workers. Processes that share a machine each get their share of the cores.
THREAD_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


def child_env(gpu: str | None = None, sharing: int = 1) -> dict:
    """The environment of a check's process: this checkout's package, the GPU world, the mode's variables;
    ``gpu`` the one GPU it sees, ``sharing`` how many such processes run at once (each gets its share of the
    cores, so that one's bursts of CPU work do not slow another's timings)."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if sharing > 1:
        for name in THREAD_POOLS:
            env.setdefault(name, str(max(1, (os.cpu_count() or 1) // sharing)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["KC_WORLD"] = "gpu"  # a GPU that vanished fails loudly instead of quietly testing the CPU path
    env.pop("TRITON_INTERPRET", None)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(EXTRA_ENV)
    return env


def mode_env(args) -> dict[str, str]:
    """The environment the flags ask for: --pre-hopper, --as-t4, --max-shared-mem."""
    env = dict(AS_T4) if args.as_t4 else dict(PRE_HOPPER) if args.pre_hopper else {}
    smem = args.max_shared_mem or (T4_SHARED_MEM if args.as_t4 else PRE_HOPPER_SHARED_MEM if args.pre_hopper else None)
    if smem:
        env["KC_MAX_SHARED_MEM"] = str(smem)
    if env:
        # What torch.compile and Triton cache on disk is keyed by the code and the GPU, not by the course's
        # KC_ variables: a graph compiled in another mode (whose fake tensors took that mode's choices) would be
        # found and reused. Each mode keeps its own caches.
        mode = "-".join(f"{k}={v}" for k, v in sorted(env.items())).lower()
        base = Path(tempfile.gettempdir()) / "kernelcourse-gpu-check" / mode
        env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"] = str(base / "inductor"), str(base / "triton")
    return env


def run_pytest(part: Part, args: list[str], env: dict | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rN", "-p", "no:cacheprovider", "--junitxml", str(xml), *args]
        start = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), capture_output=True, text=True)
        part.seconds = time.time() - start
        if not xml.exists():
            part.error = f"pytest did not run (exit {proc.returncode}): {_last_line(proc.stdout + proc.stderr)}"
            return
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name')}"
            part.slowest.append((float(case.get("time") or 0.0), name))
            part.ran += 1
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                part.passed += 1
            elif outcome.tag == "skipped":
                part.skipped += 1
                part.skips[(outcome.get("message") or "no reason given").strip()] += 1
            else:
                part.failed += 1
                part.failures.append(f"{name}: {_failure_line(outcome.get('message') or outcome.text or '')}")
        if proc.returncode not in (0, 1) and not part.failed:
            # pytest's own trouble (a crash of the test process, a usage error) after the report was written
            part.error = f"pytest exited {proc.returncode}: {_last_line(proc.stdout + proc.stderr)}"


def run_grade(part: Part, notebooks: list[Path], expect_pass: bool, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "kernelcourse.grade", "--json", *map(str, notebooks)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), capture_output=True, text=True)
    part.seconds = time.time() - start
    try:
        rows = json.loads(proc.stdout)["rows"]
    except (json.JSONDecodeError, KeyError):
        part.error = f"the grade report did not run (exit {proc.returncode}): {_last_line(proc.stdout + proc.stderr)}"
        return
    for row in rows:
        part.ran += 1
        ex = f"{row['notebook']} {row['exercise']}"
        if row.get("not_graded") and expect_pass and EMULATED in row["message"]:
            # --pre-hopper or --as-t4 held the learner's Triton kernel to mma.sync while the library peer it is
            # timed against (cuBLAS, SDPA) ran as built for Hopper: the grader declines that ratio, and says why
            part.skipped += 1
            part.skips["a speed check against a library peer, under DISABLE_MMA_V3 on a Hopper GPU"] += 1
        elif row.get("not_graded"):
            part.failed += 1  # on a GPU every check, speed included, is graded
            part.failures.append(f"{ex}: not graded on this GPU: {row['message']}")
        elif not expect_pass and "did not run" in row["message"]:
            part.failed += 1  # a stub must fail its grader, not a notebook that broke before the grader
            part.failures.append(f"{ex}: {row['message']}")
        elif row["passed"] == expect_pass:
            part.passed += 1
        else:
            part.failed += 1
            part.failures.append(f"{ex}: {'FAIL' if expect_pass else 'the stub passed'}: {row['message']}")


def run_stamp(part: Part, lesson: Path, cell_timeout: int, env: dict | None = None) -> None:
    """Execute a lesson with tools/stamp.py --record: its outputs, stamp and recorded results are kept."""
    cells = sum(1 for c in json.loads(lesson.read_text())["cells"] if c["cell_type"] == "code")
    cmd = [sys.executable, str(ROOT / "tools" / "stamp.py"), "--record", "--timeout", str(cell_timeout), str(lesson)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), capture_output=True, text=True)
    part.seconds = time.time() - start
    part.ran = cells
    if proc.returncode == 0:
        part.passed = cells
    else:  # nbclient stops at the first cell that raises; the cells after it did not run
        part.failed = 1
        part.failures.append(f"{lesson.name} (stamping): {_error_line(proc.stdout + proc.stderr)}")


def _error_line(text: str) -> str:
    """The line that names the exception in a traceback, else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Interrupt", "Exit"))]
    return (named or lines or ["(no output)"])[-1][:300]


def run_jobs(jobs: list[Job], gpus: list[str]) -> None:
    """Run the jobs on the GPUs, each GPU one job at a time, the longest first; print each as it ends.

    The jobs marked ``alone`` run first, one after another in the order given (a lesson that prints another
    lesson's recorded results is stamped after that lesson), with nothing else on the machine: a stamped
    lesson publishes its timings, and some of them (launch costs, torch.compile's calls) are the CPU's, which
    another process on the same host (torch.compile's workers, say) would slow down."""
    _share([j for j in jobs if j.alone], gpus[:1], len(gpus) > 1, longest_first=False)
    _share([j for j in jobs if not j.alone], gpus, len(gpus) > 1)


def readers_of(stale: list[Path], lessons: list[Path]) -> list[Path]:
    """The lessons that print recorded results of a lesson in ``stale`` (``bench.load("NN_...")`` in a code
    cell, NN that lesson's number): what they print comes from that lesson's run, so when it is stamped
    again they are too, after it. Returned with ``stale``, in the lessons' order."""
    from notebooks import read

    chapters = {p.name[:2] for p in stale}
    readers = [p for p in lessons if p not in stale and chapters & {
        m for c in read(p).cells if c.cell_type == "code" for m in re.findall(r'\bload\("(\d\d)_', c.source)}]
    return sorted(stale + readers, key=lambda p: p.name)


def _share(jobs: list[Job], gpus: list[str], name_gpu: bool, longest_first: bool = True) -> None:
    todo: queue.Queue = queue.Queue()
    for job in sorted(jobs, key=lambda j: -j.weight) if longest_first else jobs:
        todo.put(job)
    lock = threading.Lock()

    def worker(gpu: str) -> None:
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            piece = Part(job.part.what, job.part.unit)
            job.do(piece, child_env(gpu if name_gpu else None, sharing=len(gpus)))
            with lock:
                job.part.add(piece)
                where = f" on GPU {gpu}" if name_gpu else ""
                print(f"  {job.label}{where}: {piece.passed}/{piece.ran} {piece.unit}s as expected, {piece.failed} not, "
                      f"{piece.skipped} skipped, {piece.seconds:.0f} s{' (' + piece.error + ')' if piece.error else ''}",
                      flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def gpu_ids(count: int | None) -> list[str]:
    """The GPUs to share the work out over, as CUDA_VISIBLE_DEVICES names them for a child process."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    n = torch.cuda.device_count()
    names = names[:n] if names else [str(i) for i in range(n)]
    return names[:count] if count else names


def balanced(paths: list[Path], groups: int) -> list[list[Path]]:
    """Test files in `groups` groups of about equal size (lines of code stand in for time)."""
    out: list[list[Path]] = [[] for _ in range(max(1, groups))]
    sizes = [0] * len(out)
    for p in sorted(paths, key=lambda p: -len(p.read_text().splitlines())):
        i = sizes.index(min(sizes))
        out[i].append(p)
        sizes[i] += len(p.read_text().splitlines())
    return [g for g in out if g]


def _failure_line(message: str) -> str:
    """What a failed test says: an assertion's own message (``assert ok, text``: the grader's report, whose
    failing line is the one a learner would read) before pytest's restatement of the expression."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("AssertionError: ") and len(lines) > 1:
        said = [line for line in lines[:-1] if line.startswith("✘")] or lines[:1]
        return f"{said[0][:400]} ({lines[-1][:100]})"
    return _last_line(message)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def machine() -> tuple[str, dict]:
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from kernelcourse.world import host_cpu, versions

    props = torch.cuda.get_device_properties(0)
    return f"{props.name} (compute capability {props.major}.{props.minor}; host CPU {host_cpu()})", versions()


def render(parts: list[Part], gpu: str, versions: dict, seconds: float) -> str:
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"GPU check on {gpu}, {when}, {sys.executable}",
             " · ".join(f"{k} {v}" for k, v in versions.items()), ""]
    head = ("part", "unit", "ran", "passed", "failed", "skipped", "time")
    body = [(p.what, p.unit, *(str(n) for n in (p.ran, p.passed, p.failed, p.skipped)),
             f"{p.seconds:.0f} s") for p in parts]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    for r in [head, *body]:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for p in parts:
        if p.error:
            lines.append(f"\n{p.what} could not run: {p.error}")
        if p.failures:
            lines.append(f"\n{p.what}, failed:")
            lines += [f"  {f}" for f in p.failures]
        if p.slowest and p.unit == "test":
            lines.append(f"\n{p.what}, the {min(SLOWEST, len(p.slowest))} slowest:")
            lines += [f"  {t:6.1f} s  {name}" for t, name in sorted(p.slowest, reverse=True)[:SLOWEST]]
        if p.skips:
            lines.append(f"\n{p.what}, skipped here and why:")
            lines += [f"  {n} x {reason}" for reason, n in sorted(p.skips.items())]
    verdict = "PASS" if all(p.ok for p in parts) else "FAIL"
    if any(p.left_out for p in parts):
        lines.append("\nnot run here: " + ", ".join(p.what for p in parts if p.left_out))
    lines.append(f"\n{verdict}: {sum(p.ran for p in parts)} checks in {seconds:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell-timeout", type=int, default=600, help="seconds allowed per notebook cell")
    ap.add_argument("--chapter", action="append", metavar="NN",
                    help="check chapter NN only (repeatable): its notebooks and tests, and the tests that belong "
                         "to no chapter; runs over chapters that split the course together cover all of it")
    ap.add_argument("--only", action="append", choices=PARTS, metavar="PART",
                    help=f"run only this part (repeatable; one of {', '.join(PARTS)}); the others are listed as not run")
    ap.add_argument("--pre-hopper", action="store_true",
                    help="on a Hopper GPU, check the paths of GPUs before Hopper: mma.sync instead of wgmma "
                         "(DISABLE_MMA_V3=1), compute capability 8.0 for the course's choices, an L4's shared memory")
    ap.add_argument("--as-t4", action="store_true",
                    help="check the course's choices for a T4 on this GPU: compute capability 7.5 (float16 for "
                         "bfloat16, the pointer attention), a T4's 64 KB of shared memory, mma.sync instead of wgmma")
    ap.add_argument("--max-shared-mem", type=int, metavar="BYTES",
                    help="shared memory per block that Triton and the autotune pruners may use (65536: a T4's); "
                         f"--pre-hopper's default is {PRE_HOPPER_SHARED_MEM}, --as-t4's {T4_SHARED_MEM}")
    ap.add_argument("--gpus", type=int, metavar="N",
                    help="share the work out over the first N GPUs (default: every GPU this machine shows)")
    ap.add_argument("--stamp", action="store_true",
                    help="execute each lesson whose stamp is stale with tools/stamp.py --record (outputs, stamp and "
                         "recorded results kept) instead of under nbval")
    ap.add_argument("--restamp", action="append", default=[], metavar="NN",
                    help="with --stamp, also stamp lesson NN (repeatable): one whose printed results depend on "
                         "package code that changed")
    args = ap.parse_args(argv)
    if args.restamp and not args.stamp:
        ap.error("--restamp NN stamps lessons as part of --stamp: add --stamp")
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: at least one")
    if args.as_t4 and args.pre_hopper:
        ap.error("--as-t4 and --pre-hopper: pick one (--as-t4 already takes the pre-Hopper code paths)")
    if args.stamp and (args.as_t4 or args.pre_hopper or args.max_shared_mem):
        ap.error("--stamp records what this GPU does as itself: drop --as-t4, --pre-hopper and --max-shared-mem")
    if args.max_shared_mem is not None and args.max_shared_mem < 16 * 1024:
        ap.error(f"--max-shared-mem {args.max_shared_mem}: every GPU the course supports has at least 64 KB (65536)")
    return args


def plan(args, lessons: list[Path], solutions: list[Path], tests: list[str], n_gpus: int,
         stale: list[Path]) -> tuple[dict[str, Part], list[Job]]:
    """The parts of the table and the pieces that fill them. On one GPU each part runs in one process, in the
    table's order; on several, each lesson, solution and notebook's grades is a piece, and the test files
    make three groups per GPU."""
    nbval = ["--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={args.cell_timeout}"]
    stubs = [ROOT / "exercises" / p.name for p in solutions]
    parts = {name: Part(what, unit) for name, what, unit in [
        ("tests", "unit tests", "test"), ("lessons", "lessons under nbval", "cell"),
        ("solutions", "solutions under nbval", "cell"), ("pass", "grade report: solutions pass", "exercise"),
        ("fail", "grade report: stubs fail", "exercise")]}
    if stale:
        parts["lessons"].what = "lessons (stale ones stamped)"
    only = {"tests": ["tests"], "lessons": ["lessons"], "solutions": ["solutions"], "grades": ["pass", "fail"]}
    chosen = {name for part in (args.only or PARTS) for name in only[part]}
    for name, part in parts.items():
        part.left_out = name not in chosen

    def seconds(path: Path) -> float:  # the chapter lesson's last stamped run stands in for its notebooks' time
        lesson = next((ROOT / "notebooks").glob(path.name[:3] + "*.ipynb"), None)
        stamp = json.loads(lesson.read_text())["metadata"].get("kernelcourse", {}).get("stamp", {}) if lesson else {}
        return float(stamp.get("seconds", 60))

    one = n_gpus == 1
    pieces = (lambda items: [items]) if one else (lambda items: [[x] for x in items])
    jobs: list[Job] = []
    if not parts["tests"].left_out:
        files = [ROOT / t for t in tests] if tests != ["tests"] else sorted((ROOT / "tests").glob("test_*.py"))
        groups = [tests] if one else [[str(p.relative_to(ROOT)) for p in g] for g in balanced(files, 3 * n_gpus)]
        for i, group in enumerate(groups):
            jobs.append(Job(parts["tests"], "unit tests" if one else f"unit tests, group {i + 1} of {len(groups)}",
                            200.0, lambda p, env, g=group: run_pytest(p, [*g, "-k", GRADE_TESTS], env)))
    if not parts["lessons"].left_out:
        for lesson in stale:
            jobs.append(Job(parts["lessons"], f"{lesson.name}, stamped", seconds(lesson),
                            lambda p, env, n=lesson: run_stamp(p, n, args.cell_timeout, env), alone=True))
        for group in pieces([p for p in lessons if p not in stale]) if [p for p in lessons if p not in stale] else []:
            jobs.append(Job(parts["lessons"], "lessons" if len(group) > 1 else group[0].name, sum(map(seconds, group)),
                            lambda p, env, g=group: run_pytest(p, [*nbval, *map(str, g)], env)))
    for name, items, share, do in [
            ("solutions", solutions, 0.5, lambda g: lambda p, env: run_pytest(p, [*nbval, *map(str, g)], env)),
            ("pass", solutions, 0.5, lambda g: lambda p, env: run_grade(p, g, True, env)),
            ("fail", stubs, 0.2, lambda g: lambda p, env: run_grade(p, g, False, env))]:
        if not parts[name].left_out and items:
            for group in pieces(items):
                label = parts[name].what if len(group) > 1 else f"{parts[name].what}: {group[0].name}"
                jobs.append(Job(parts[name], label, share * sum(map(seconds, group)), do(group)))
    if one:  # the table's order, as the parts always ran
        order = list(parts.values())
        jobs.sort(key=lambda j: order.index(j.part))
        for i, job in enumerate(jobs):
            job.weight = -float(i)
    return parts, jobs


def main() -> int:
    args = parse_args()
    EXTRA_ENV.update(mode_env(args))
    if missing := missing_stack():
        print(f"The course's notebook stack is not installed for {sys.executable}: {', '.join(missing)} missing.\n"
              f"Install it with:  {sys.executable} -m pip install {' '.join(missing)}\n"
              "(or `make install` for the course's own .venv), then run this again.")
        return 2
    import torch

    if not torch.cuda.is_available():
        print("tools/gpu_check.py checks the course on a CUDA GPU, and torch sees none here "
              f"(torch {torch.__version__}). On a CPU machine, `make test` checks the CPU world.")
        return 2
    gpu, versions = machine()
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    solutions = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    tests = ["tests"]
    if args.chapter:
        lessons = [p for p in lessons if p.name[:2] in args.chapter]
        solutions = [p for p in solutions if p.name[:2] in args.chapter]
        others = {p.stem[:2] for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")} - set(args.chapter)
        elsewhere = {f"test_grading_ch{c}.py" for c in others} | {f for c in others for f in CHAPTER_TESTS.get(c, [])}
        tests = [f"tests/{p.name}" for p in sorted((ROOT / "tests").glob("test_*.py")) if p.name not in elsewhere]
    gpus = gpu_ids(args.gpus)
    from notebooks import read
    from stamp import stamp_problem
    stale = readers_of([p for p in lessons if args.stamp and (stamp_problem(read(p)) or p.name[:2] in args.restamp)],
                       lessons)
    parts, jobs = plan(args, lessons, solutions, tests, len(gpus), stale)
    start = time.time()
    print(f"running {len(jobs)} pieces on {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
          + (f"; stamping {', '.join(p.name for p in stale)}" if stale else "") + "...", flush=True)
    run_jobs(jobs, gpus)
    parts = list(parts.values())
    scope = f"chapters {', '.join(sorted(args.chapter))} and the tests of no chapter" if args.chapter else "the whole course"
    if EXTRA_ENV:
        scope += ", as " + " ".join(f"{k}={v}" for k, v in EXTRA_ENV.items() if not k.endswith("_CACHE_DIR"))
    if args.only:
        scope += f", parts: {', '.join(args.only)}"
    if len(gpus) > 1:
        scope += f", shared out over {len(gpus)} GPUs (times are each part's sum over them)"
    print("\n" + render(parts, f"{gpu}, {scope}", versions, time.time() - start))
    return 0 if all(p.ok for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
