"""tools/gpu_check.py's summary: what it says of parts that ran, failed to run, or were left out (--only).
The checks themselves need a CUDA GPU; the table does not."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import gpu_check  # noqa: E402


def test_a_part_left_out_is_listed_and_neither_passes_nor_fails():
    ran = gpu_check.Part("unit tests", "test", ran=3, passed=3)
    left = gpu_check.Part("lessons under nbval", "cell", left_out=True)
    text = gpu_check.render([ran, left], "a GPU", {"torch": "2"}, 1.0)
    assert "not run here: lessons under nbval" in text and "could not run" not in text
    assert text.splitlines()[-1].startswith("PASS: 3 checks")

    broken = gpu_check.Part("grade report: stubs fail", "exercise", error="the grade report did not run")
    text = gpu_check.render([ran, left, broken], "a GPU", {"torch": "2"}, 1.0)
    assert "grade report: stubs fail could not run: the grade report did not run" in text
    assert text.splitlines()[-1].startswith("FAIL")


def test_a_part_that_ran_nothing_is_not_a_pass():
    assert not gpu_check.Part("unit tests", "test").ok


CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _mode(flags):
    env = gpu_check.mode_env(gpu_check.parse_args(flags))
    return {k: v for k, v in env.items() if k not in CACHES}, tuple(env.get(k) for k in CACHES)


def test_pre_hopper_mode_sets_what_gpus_before_hopper_get():
    env, caches = _mode(["--pre-hopper", "--chapter", "06"])
    assert env == {"DISABLE_MMA_V3": "1", "KC_MAX_CAPABILITY": "8.0", "KC_MAX_SHARED_MEM": str(99 * 1024)}
    env, caches_16k = _mode(["--pre-hopper", "--max-shared-mem", "65536"])
    assert env["KC_MAX_SHARED_MEM"] == "65536" and env["DISABLE_MMA_V3"] == "1"
    assert gpu_check.mode_env(gpu_check.parse_args([])) == {}  # the GPU as itself: the usual caches
    assert _mode(["--max-shared-mem", "65536"])[0] == {"KC_MAX_SHARED_MEM": "65536"}
    # each mode compiles into caches of its own: a graph traced under another mode's choices is not reused
    others = {caches_16k, _mode(["--as-t4"])[1], _mode(["--max-shared-mem", "65536"])[1]}
    assert all(caches) and caches not in others and len(others) == 3


def test_t4_mode_sets_a_t4_s_capability_and_shared_memory(capsys):
    import pytest

    env, _ = _mode(["--as-t4"])
    assert env == {"DISABLE_MMA_V3": "1", "KC_MAX_CAPABILITY": "7.5", "KC_MAX_SHARED_MEM": "65536"}
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--as-t4", "--pre-hopper"])
    assert "pick one" in capsys.readouterr().err


def test_what_the_course_chooses_under_t4_mode(monkeypatch):
    """Under --as-t4's capability an H100 gets a T4's choices: float16 for bfloat16, the pointer attention,
    the FMA shared-memory estimates."""
    import torch

    import kernelcourse.attention as A
    W = sys.modules["kernelcourse.world"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("KC_MAX_CAPABILITY", "7.5")
    cc = W.device_capability()
    assert cc == (7, 5)
    assert not W.World(True, "cuda", "H100", cc, {}).has_bf16
    assert A.default_version(cc) == 2 and A.default_version((9, 0)) == 4


def test_pre_hopper_mode_reaches_every_child_process(monkeypatch):
    monkeypatch.setattr(gpu_check, "EXTRA_ENV", {"DISABLE_MMA_V3": "1", "KC_MAX_CAPABILITY": "8.0"})
    env = gpu_check.child_env()
    assert env["DISABLE_MMA_V3"] == "1" and env["KC_MAX_CAPABILITY"] == "8.0" and env["KC_WORLD"] == "gpu"


def test_a_shared_memory_limit_below_any_supported_gpu_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--max-shared-mem", "1000"])
    assert "at least 64 KB" in capsys.readouterr().err


def test_the_course_sees_the_capability_and_shared_memory_it_is_told(monkeypatch):
    """KC_MAX_CAPABILITY caps the capability the course's choices see (never raises it); KC_MAX_SHARED_MEM
    caps what Triton reports, so its launch check and the pruners see a smaller GPU."""
    import torch

    import kernelcourse.world  # noqa: F401
    W = sys.modules["kernelcourse.world"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("KC_MAX_CAPABILITY", "8.0")
    assert W.device_capability() == (8, 0)
    monkeypatch.setenv("KC_MAX_CAPABILITY", "10.0")
    assert W.device_capability() == (9, 0)
    monkeypatch.delenv("KC_MAX_CAPABILITY")
    assert W.device_capability() == (9, 0)

    class Utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    import triton

    utils = Utils()
    # the active driver is an attribute of the DriverConfig: ``_active`` (behind a property) from Triton 3.5 on,
    # ``active`` in Triton 3.4; set directly, so that no real driver is made on a machine without a GPU
    attr = "_active" if hasattr(triton.runtime.driver, "_active") else "active"
    monkeypatch.setattr(triton.runtime.driver, attr, type("D", (), {"utils": utils})())
    monkeypatch.setenv("KC_MAX_SHARED_MEM", "65536")
    W._limit_shared_memory()
    W._limit_shared_memory()  # twice: still one limit over the GPU's own figure
    assert utils.get_device_properties(0) == {"max_shared_mem": 65536, "multiprocessor_count": 132}


def test_a_gpu_older_than_the_t4_gets_one_sentence_and_the_cpu_world(monkeypatch):
    import torch

    import kernelcourse.world  # noqa: F401
    W = sys.modules["kernelcourse.world"]
    props = type("P", (), {"name": "Tesla P100-PCIE-16GB", "major": 6, "minor": 0})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    text = W._too_old_to_serve()
    assert "compute capability 6.0" in text and "older than the course supports" in text and "\n" not in text
    props.major, props.minor = 7, 5
    assert W._too_old_to_serve() is None


def test_releases_older_than_the_course_supports_are_named_with_what_to_do(monkeypatch):
    import torch

    import kernelcourse.world  # noqa: F401
    W = sys.modules["kernelcourse.world"]
    assert W._older_than_supported() is None  # what this checkout runs on
    monkeypatch.setattr(torch, "__version__", "2.1.0+cu121")
    text = W._older_than_supported()
    assert text.startswith("torch 2.1.0+cu121 is older than the course supports") and "pip install" in text


def test_the_oldest_releases_are_named_once_for_ci_and_once_for_the_setup_cell():
    """make test-oldest installs what the Makefile's OLDEST_PINS says; kc.setup() warns below world.OLDEST."""
    import re

    import kernelcourse.world  # noqa: F401
    W = sys.modules["kernelcourse.world"]
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    pins = dict(re.findall(r"\b(torch|triton)==(\d+\.\d+)\.\d+", makefile.split("OLDEST_PINS :=")[1].splitlines()[0]))
    assert {k: tuple(map(int, v.split("."))) for k, v in pins.items()} == W.OLDEST


def _jobs_by_part(jobs):
    out = {}
    for job in jobs:
        out.setdefault(job.part.what, []).append(job)
    return out


def test_on_one_gpu_each_part_runs_in_one_process_in_the_table_s_order():
    root = gpu_check.ROOT
    lessons = sorted((root / "notebooks").glob("0[1-3]_*.ipynb"))
    solutions = sorted((root / "solutions").glob("0[1-3]_*.ipynb"))
    parts, jobs = gpu_check.plan(gpu_check.parse_args([]), lessons, solutions, ["tests"], 1, [])
    assert [j.part for j in sorted(jobs, key=lambda j: -j.weight)] == list(parts.values())


def test_on_several_gpus_every_piece_runs_once_and_stale_lessons_are_stamped():
    root = gpu_check.ROOT
    lessons = sorted((root / "notebooks").glob("0[1-3]_*.ipynb"))
    solutions = sorted((root / "solutions").glob("0[1-3]_*.ipynb"))
    args = gpu_check.parse_args(["--stamp"])
    parts, jobs = gpu_check.plan(args, lessons, solutions, ["tests"], 2, [lessons[1]])
    by = _jobs_by_part(jobs)
    assert len(by["unit tests"]) == 6  # three groups per GPU
    assert [j.label for j in by["lessons (stale ones stamped)"]] == [
        f"{lessons[1].name}, stamped", lessons[0].name, lessons[2].name]
    assert len(by["solutions under nbval"]) == len(by["grade report: stubs fail"]) == len(solutions) == 3
    # every test file in exactly one group
    groups = gpu_check.balanced(sorted((root / "tests").glob("test_*.py")), 6)
    files = [p for g in groups for p in g]
    assert sorted(files) == sorted((root / "tests").glob("test_*.py")) and len(files) == len(set(files))

    parts, jobs = gpu_check.plan(gpu_check.parse_args(["--only", "grades"]), lessons, solutions, ["tests"], 2, [])
    assert {j.part.what for j in jobs} == {"grade report: solutions pass", "grade report: stubs fail"}
    assert parts["tests"].left_out and parts["lessons"].left_out and not parts["pass"].left_out


def test_a_lesson_that_prints_a_stamped_lessons_recorded_results_is_stamped_after_it():
    """Chapter 09 prints chapter 08's recorded launch costs (bench.load("08_launch")): stamping 08 again
    stamps 09 too, after it; stamping 07 alone stamps nothing else, and the order is the lessons'."""
    root = gpu_check.ROOT
    lessons = sorted((root / "notebooks").glob("0[1-9]_*.ipynb"))
    by_ch = {p.name[:2]: p for p in lessons}
    assert gpu_check.readers_of([by_ch["08"]], lessons) == [by_ch["08"], by_ch["09"]]
    assert gpu_check.readers_of([by_ch["09"], by_ch["08"]], lessons) == [by_ch["08"], by_ch["09"]]
    assert gpu_check.readers_of([by_ch["07"]], lessons) == [by_ch["07"]]
    assert gpu_check.readers_of([], lessons) == []


def test_stamps_run_in_the_order_given_and_the_rest_longest_first():
    order = []
    part = gpu_check.Part("lessons", "cell")
    jobs = [gpu_check.Job(part, name, weight, lambda p, env, n=name: order.append(n), alone=alone)
            for name, weight, alone in (("08 stamped", 10, True), ("09 stamped", 50, True), ("short", 1, False),
                                        ("long", 9, False))]
    gpu_check.run_jobs(jobs, ["0"])
    assert order == ["08 stamped", "09 stamped", "long", "short"]


def test_pieces_share_the_gpus_and_add_up_into_their_part():
    import threading

    seen = []
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=30)  # each GPU's first piece waits for the other's: neither takes all
    part = gpu_check.Part("unit tests", "test")

    def do(piece, env):
        with lock:
            first = env["CUDA_VISIBLE_DEVICES"] not in seen
            seen.append(env["CUDA_VISIBLE_DEVICES"])
        if first:
            both.wait()
        piece.ran, piece.passed, piece.seconds = 2, 1, 1.5
        piece.failed, piece.failures = 1, [f"one failed on GPU {env['CUDA_VISIBLE_DEVICES']}"]

    jobs = [gpu_check.Job(part, f"piece {i}", float(i), do) for i in range(5)]
    gpu_check.run_jobs(jobs, ["3", "5"])
    assert sorted(set(seen)) == ["3", "5"] and len(seen) == 5
    assert (part.ran, part.passed, part.failed, part.seconds) == (10, 5, 5, 7.5) and len(part.failures) == 5
    assert not part.ok


def test_stamping_is_for_the_gpu_as_itself(capsys):
    import pytest

    for argv in (["--restamp", "08"], ["--stamp", "--as-t4"], ["--stamp", "--pre-hopper"], ["--gpus", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(argv)
    err = capsys.readouterr().err
    assert "add --stamp" in err and "as itself" in err and "at least one" in err
    assert gpu_check.parse_args(["--stamp", "--restamp", "08"]).restamp == ["08"]


def test_a_failed_stamp_names_the_exception():
    text = "Traceback (most recent call last):\n  File x\nnbclient.exceptions.CellExecutionError: cell 3\nValueError: bad\nexit"
    assert gpu_check._error_line(text) == "ValueError: bad"
    assert gpu_check._error_line("") == "(no output)"


def test_a_failed_grader_test_shows_the_line_a_learner_would_read():
    message = "AssertionError: ✔ 08.5 dx, 7 x 37\n✘ 08.5 speed: 0.85x the speed of PyTorch's\nassert False"
    assert gpu_check._failure_line(message) == "✘ 08.5 speed: 0.85x the speed of PyTorch's (assert False)"
    assert gpu_check._failure_line("assert (not True)") == "assert (not True)"


def test_the_summary_names_the_slowest_tests():
    part = gpu_check.Part("unit tests", "test", ran=3, passed=3)
    part.add(gpu_check.Part("unit tests", "test", slowest=[(0.5, "a"), (30.0, "b")]))
    part.add(gpu_check.Part("unit tests", "test", slowest=[(12.0, "c")]))
    text = gpu_check.render([part], "a GPU", {"torch": "2"}, 1.0)
    assert "the 3 slowest:" in text and text.index("b") < text.index("  12.0 s  c") < text.index("a\n")


def test_stamps_run_first_one_at_a_time_with_nothing_beside_them():
    import threading
    import time

    running, events = [], []
    lock = threading.Lock()
    part = gpu_check.Part("lessons", "cell")

    def do(name):
        def run(piece, env):
            with lock:
                running.append(name)
                events.append((name, tuple(running)))
            time.sleep(0.02)
            with lock:
                running.remove(name)
            piece.ran = piece.passed = 1
        return run

    jobs = [gpu_check.Job(part, f"test {i}", 100.0, do(f"test {i}")) for i in range(4)]
    jobs += [gpu_check.Job(part, f"stamp {i}", 1.0, do(f"stamp {i}"), alone=True) for i in range(2)]
    gpu_check.run_jobs(jobs, ["0", "1"])
    assert sorted(name for name, _ in events[:2]) == ["stamp 0", "stamp 1"]  # before every other piece
    assert all(together == (name,) for name, together in events if name.startswith("stamp"))
    assert part.ran == 6


def test_processes_that_share_a_machine_each_get_their_share_of_the_cores(monkeypatch):
    for name in gpu_check.THREAD_POOLS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu_check.os, "cpu_count", lambda: 32)
    env = gpu_check.child_env("1", sharing=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["OMP_NUM_THREADS"] == env["TORCHINDUCTOR_COMPILE_THREADS"] == "16"
    assert "OMP_NUM_THREADS" not in gpu_check.child_env()


def test_under_emulation_a_declined_library_ratio_is_a_skip_and_any_other_not_graded_row_a_failure(monkeypatch):
    import json
    import subprocess

    from kernelcourse.world import pre_hopper_emulation

    held_back = pre_hopper_emulation((9, 0))
    assert held_back is None or gpu_check.EMULATED in held_back  # None: DISABLE_MMA_V3 is not set here
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    reason = pre_hopper_emulation((9, 0))
    assert reason and gpu_check.EMULATED in reason  # the words gpu_check looks for are the grader's
    rows = [{"notebook": "07", "exercise": "07.5", "passed": True, "not_graded": True,
             "message": f"5 checks passed; not graded here: dK/dV: 0.43x the speed of SDPA, not graded here: {reason}"},
            {"notebook": "05", "exercise": "05.4", "passed": True, "not_graded": True,
             "message": "4 checks passed; not graded here: speed needs a GPU (not graded here)"}]
    out = subprocess.CompletedProcess([], 0, stdout=json.dumps({"rows": rows}), stderr="")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: out)
    part = gpu_check.Part("grade report: solutions pass", "exercise")
    gpu_check.run_grade(part, [], expect_pass=True, env={})
    assert (part.ran, part.passed, part.skipped, part.failed) == (2, 0, 1, 1)
    assert part.failures[0].startswith("05 05.4: not graded on this GPU")
    stubs = gpu_check.Part("grade report: stubs fail", "exercise")
    gpu_check.run_grade(stubs, [], expect_pass=False, env={})
    assert stubs.failed == 2  # a stub that only went ungraded did not fail its grader
