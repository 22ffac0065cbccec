"""The helper package: worlds, recorded results, comparisons, timing limits."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import kernelcourse as kc
from kernelcourse import bench, grading

WORLD = sys.modules["kernelcourse.world"]  # the module: kc.world is the function that returns the world


def test_import_does_not_load_triton_or_numba():
    import subprocess
    import sys

    code = "import sys, kernelcourse; print('triton' in sys.modules, 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_cpu_world_switches_on_the_interpreter_and_simulator(monkeypatch):
    import subprocess
    import sys

    code = ("import os, kernelcourse as kc; w = kc.setup(world='cpu', quiet=True); "
            "print(w.device, os.environ['TRITON_INTERPRET'], os.environ['NUMBA_ENABLE_CUDASIM'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cpu", "1", "1"]


def test_setup_refuses_an_unknown_world():
    with pytest.raises(ValueError):
        kc.setup(world="tpu", quiet=True)


def test_banner_names_world_and_versions():
    text = kc.world.__module__ and kc.setup.__globals__["banner"](kc.world())
    assert "numpy" in text and "torch" in text and "triton" in text and ("GPU" in text or "CPU" in text)


def test_a_gpu_banner_says_an_emulated_capability_on_the_gpu_line_and_names_the_host_cpu(monkeypatch):
    import types

    import torch

    props = types.SimpleNamespace(multi_processor_count=132, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(WORLD, "_env_capability", lambda: (8, 0))
    w = WORLD.World(True, "cuda", "NVIDIA H100 80GB HBM3", (8, 0), kc.world().versions)
    gpu_line, cpu_line = WORLD.banner(w).splitlines()[:2]
    assert gpu_line.startswith("GPU: NVIDIA H100")
    assert gpu_line.endswith("(run as compute capability 8.0: KC_MAX_CAPABILITY)")
    assert cpu_line == f"Host CPU: {WORLD.host_cpu()}"


def test_the_host_cpu_is_named_with_its_cores_and_recorded_with_results(monkeypatch, tmp_path):
    """Recorded results and stamps name the CPU: launch costs depend on it. The model comes from
    /proc/cpuinfo where there is one, else from platform; the cores are those this process may use."""
    import builtins

    cpu = WORLD.host_cpu()
    assert cpu.endswith("logical cores") and not cpu.startswith(" ·"), cpu
    assert bench.provenance()["cpu"] == cpu
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t:  Some   CPU @ 3.0GHz\nflags\t\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(info if f == "/proc/cpuinfo" else f, *a, **k))
    assert WORLD.host_cpu().startswith("Some CPU @ 3.0GHz · ")
    info.write_text("processor\t: 0\n")  # no model name (an ARM host): platform's name instead
    assert not WORLD.host_cpu().startswith(" ·")


def test_versions_record_everything_that_changes_a_result():
    import numpy
    import torch

    v = WORLD.versions()
    assert tuple(v) == WORLD.VERSION_KEYS
    assert v["numpy"] == numpy.__version__ and v["torch"] == torch.__version__
    assert all(isinstance(x, str) and x for x in v.values()), v


def test_release_numbers_compare_as_numbers():
    assert WORLD._release("0.30.4") == (0, 30, 4) < WORLD._release("0.31.0")
    assert WORLD._release("2.10.1+cu130") > WORLD._release("2.9.0") and WORLD._release("2.6.0rc1") == (2, 6, 0)


# numpy 2.5 removed np.row_stack. These compile a kernel for a GPU (typing and lowering to LLVM IR, which
# needs no GPU) in a fresh process, out of numba's simulator, with np.row_stack gone as on numpy 2.5.
_COMPILE_WITHOUT_ROW_STACK = """
import sys
import numpy as np
if hasattr(np, "row_stack"):
    del np.row_stack
from kernelcourse.world import numba_cuda_needs_row_stack, _import_numba_cuda_with_row_stack
needed = numba_cuda_needs_row_stack()
if needed and sys.argv[1] == "shim":
    _import_numba_cuda_with_row_stack()
from numba import cuda, float32, void
from numba.cuda.compiler import compile_cuda  # numba-cuda's own entry point for one kernel: no GPU needed

def add(x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] + y[i]

ir = compile_cuda(add, void, (float32[:], float32[:], float32[:]), cc=(9, 0)).library.get_llvm_str()
print(needed, "fadd float" in ir, hasattr(np, "row_stack"))
"""


def _compile_without_row_stack(mode: str):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-c", _COMPILE_WITHOUT_ROW_STACK, mode], capture_output=True, text=True,
                          env=env, timeout=300)


def test_numba_cuda_compiles_kernels_on_a_numpy_without_row_stack():
    proc = _compile_without_row_stack("shim")
    assert proc.returncode == 0, proc.stderr[-2000:]
    needed, compiled, row_stack_left = proc.stdout.split()
    assert compiled == "True" and row_stack_left == "False", proc.stdout  # numpy is left as it was


def test_the_row_stack_shim_is_applied_exactly_when_numba_cuda_needs_it():
    """Catches a numba-cuda release that fixed np.row_stack (drop the shim) or one that still breaks
    (raise NUMBA_CUDA_ROW_STACK_LAST_BROKEN)."""
    proc = _compile_without_row_stack("no shim")
    broken = proc.returncode != 0 and "row_stack" in proc.stderr
    assert proc.returncode == 0 or broken, proc.stderr[-2000:]
    version = WORLD._version("numba-cuda")
    assert broken == (WORLD._release(version) <= WORLD.NUMBA_CUDA_ROW_STACK_LAST_BROKEN), (
        f"numba-cuda {version} {'still' if broken else 'no longer'} needs np.row_stack: "
        f"{'raise' if broken else 'lower'} NUMBA_CUDA_ROW_STACK_LAST_BROKEN in kernelcourse/world.py")


def test_recorded_results_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    rows = [{"impl": "a", "n": 1024, "ms": 0.5}]
    prov = {"gpu": "Test GPU", "date": "2026-01-01", "versions": {"torch": "x", "triton": "y"},
            "compute_capability": "9.0", "command": "test"}
    bench.save(bench.Results("t", rows, prov, recorded=False))
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == rows
    loaded = bench.load("t")
    assert loaded.recorded and loaded.rows == rows and loaded.label == "recorded on Test GPU, 2026-01-01"


def test_missing_recording_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="tools/stamp.py --record"):
        bench.load("nothing")


def test_a_lesson_records_only_its_own_chapter(monkeypatch):
    monkeypatch.delenv("KC_RECORD", raising=False)
    assert not bench.records("04_short_rows")
    monkeypatch.setenv("KC_RECORD", "1")
    monkeypatch.delenv("KC_RECORD_CHAPTER", raising=False)
    assert bench.records("04_short_rows") and bench.records("02_ceilings")  # recording by hand: everything
    monkeypatch.setenv("KC_RECORD_CHAPTER", "04")                           # tools/stamp.py --record lesson 04
    assert bench.records("04_short_rows") and not bench.records("02_ceilings")


def test_gbps():
    assert bench.gbps(3e9, 1000.0) == pytest.approx(3.0)


def test_gpu_time_replays_the_calls_it_times():
    """gpu_time runs fn once, once more on its capture stream, and ``reps`` times in the graph that each
    of ``trials`` replays runs again: the GPU work happens, not only the Python calls."""
    if not kc.world().gpu:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            bench.gpu_time(lambda: None)
        return
    import torch

    y = torch.randint(-1000, 1000, (1 << 16,), device="cuda")
    y0, calls = y.clone(), []
    ms = bench.gpu_time(lambda: (calls.append(1), y.add_(1)), reps=3, trials=2)
    torch.cuda.synchronize()
    assert len(calls) == 2 + 3 and ms >= 0.0
    assert torch.equal(y, y0 + 2 + 3 * 2)
    three = bench.gpu_time_for_autotune(lambda: y.add_(1), quantiles=(0.5, 0.2, 0.8))
    assert len(three) == 3 and len(set(three)) == 1 and three[0] >= 0.0  # the autotuner reads three quantiles


def test_compare_finds_unwritten_nan_and_errors():
    truth = np.arange(1, 6, dtype=np.float64)
    ok, line = grading.compare(truth.astype(np.float32), truth, what="t")
    assert ok, line
    out = truth.astype(np.float32)
    out[3] = grading.POISON
    assert "never written (first at index 3)" in grading.compare(out, truth, what="t")[1]
    out[3] = np.nan
    assert "NaN" in grading.compare(out, truth, what="t")[1]
    out[3] = 4.5
    ok, line = grading.compare(out, truth, what="t")
    assert not ok and "max error 0.5 at index 3" in line
    assert "shape" in grading.compare(out[:2], truth, what="t")[1]
    assert "dtype float64, expected float32" in grading.compare(truth, truth, what="t", dtype=np.float32)[1]
    assert "no element" in grading.compare(grading.poisoned(5), truth, what="t")[1]


def test_compare_tolerance_follows_the_reference_error():
    truth = np.array([1.0, 2.0])
    ref = np.array([1.0, 2.001])
    assert grading.compare(np.array([1.0, 2.0015]), truth, ref, what="t")[0]
    assert not grading.compare(np.array([1.0, 2.003]), truth, ref, what="t")[0]


def test_a_failing_line_carries_its_hint_after_a_colon():
    lines = []
    report = grading.Report(exercise=None, sink=lines.append)
    report.fail("max error 0.5", "mask the tail")
    report.fail("max error 0.5", None)
    assert lines == ["✘ max error 0.5: mask the tail", "✘ max error 0.5"] and report.failures == 2


def test_compare_returned_says_when_learner_code_returns_no_numbers():
    from kernelcourse.grading.harness import compare_returned, exact_f32

    truth = exact_f32([1.0, 1 / 3])
    assert compare_returned([1, 1 / 3], truth, None, "t", 1e-6)[0]
    ok, line = compare_returned(["a", "b"], truth, None, "t", 1e-6)
    assert not ok and line.startswith("t: got ndarray of <U1, expected numbers")


def test_diagnose_by_distance_or_by_order():
    from kernelcourse.grading.harness import diagnose

    truth = np.arange(1.0, 6.0)
    mistakes = [("listed first", truth + 1.0), ("closest", truth + 1.0 + 1e-9)]
    got = truth + 1.0 + 1e-9
    assert diagnose(got, mistakes, truth=truth) == "closest"
    assert diagnose(got, mistakes, truth=truth, first=True) == "listed first"


def test_separating_finds_a_case_that_tells_the_mistakes_apart():
    from kernelcourse.grading.harness import separating

    rng = np.random.default_rng(0)
    # answer n, mistakes 2n and n + 1: only n = 1 makes 2n and n + 1 equal
    case = separating(rng, lambda r: int(r.integers(1, 3)), lambda n: [n, 2 * n, n + 1], lambda a, b: a == b)
    assert case == 2


def test_time_limit_interrupts():
    with pytest.raises(grading.TimeLimit):
        with grading.time_limit(0.2):
            while True:
                pass


def test_unknown_learner_exception_is_one_line():
    try:
        {}["missing"]
    except KeyError as exc:
        line = grading.explain(exc)
    assert line.startswith("KeyError") and "\n" not in line


@pytest.mark.skipif(not grading.can_isolate(),
                    reason="graders run in this process on a GPU (CUDA does not survive fork): a crash would end it")
def test_a_crash_in_learner_code_fails_only_that_exercise():
    import ctypes

    from tests.helpers import grade

    def crashes(n, block):
        ctypes.string_at(0)  # a segfault, as an unmasked out-of-bounds access can cause

    passed, text = grade("01.2", grid_size=crashes)
    assert not passed and "crashed" in text and "SIGSEGV" in text
    passed, text = grade("01.2", grid_size=lambda n, b: (n + b - 1) // b)  # this process lives on
    assert passed, text


def test_recorded_results_come_from_a_stamped_gpu_run_of_a_lesson():
    """Every recorded file names the lesson whose GPU execution wrote it, and that lesson's stamp
    agrees on the GPU: recorded numbers can only come from running a lesson on a GPU."""
    import re
    from pathlib import Path

    import nbformat

    root = Path(__file__).resolve().parent.parent
    files = sorted(bench.RECORDED_DIR.glob("*.json"))
    assert files
    for path in files:
        prov = json.loads(path.read_text())["provenance"]
        match = re.fullmatch(r"python tools/stamp.py --record (notebooks/\d\d_\w+\.ipynb)", prov["command"])
        assert match, f"{path.name}: not recorded by tools/stamp.py --record ({prov['command']!r})"
        lesson = nbformat.read(root / match.group(1), as_version=4)
        stamp = lesson.metadata["kernelcourse"]["stamp"]
        assert prov["gpu"] == stamp["gpu"] and prov["gpu"] != "CPU", path.name
        assert prov["versions"]["torch"] == stamp["versions"]["torch"], path.name


def test_an_illegal_gpu_access_is_explained():
    line = grading.explain(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert "illegal memory access" in line and "restart the kernel" in line


def test_a_launch_out_of_shared_memory_is_explained():
    from triton.runtime.errors import OutOfResources

    line = grading.explain(OutOfResources(98304, 65536, "shared memory"))
    assert line.startswith("the launch needs more shared memory than this GPU has (out of resource: shared memory, "
                           "Required: 98304, Hardware limit: 65536"), line
    assert line.endswith(": smaller tiles or fewer stages"), line
    assert "shared memory than" not in grading.explain(OutOfResources(300, 255, "registers"))


def test_setup_warns_only_about_combinations_that_cannot_work(monkeypatch):
    cpu, gpu = kc.World(False, "cpu", "CPU", None), kc.World(True, "cuda", "GPU", (9, 0))

    def given(numpy_version, triton_version):
        monkeypatch.setattr(np, "__version__", numpy_version)
        monkeypatch.setattr(WORLD, "_version", lambda dist: triton_version if dist == "triton" else "0.30.4")

    given("2.4.1", "3.6.0")
    problem = WORLD._known_problem(cpu)
    assert 'pip install "numpy>=2,<2.4"' in problem and "restart" in problem
    assert WORLD._known_problem(gpu) is None  # compiled Triton kernels do not go through the interpreter
    given("2.4.1", "3.7.1")
    assert WORLD._known_problem(cpu) is None
    given("2.3.5", "3.6.0")
    assert WORLD._known_problem(cpu) is None
    given("2.5.2", "3.9.0")  # numba-cuda 0.30.4 with numpy 2.5: made to work by setup(), no warning
    assert WORLD._known_problem(cpu) is None and WORLD._known_problem(gpu) is None


def test_no_course_code_asks_torch_whether_bf16_is_supported():
    """torch.cuda.is_bf16_supported() says True on a T4, whose bfloat16 is emulated: what the course runs in
    bfloat16 asks kc.world().has_bf16 (compute capability 8.0 or newer, KC_MAX_CAPABILITY honoured)."""
    root = Path(__file__).resolve().parent.parent
    files = [*(root / "src").rglob("*.py"), *(root / "notebooks").glob("*.ipynb"), *(root / "solutions").glob("*.ipynb"),
             *(root / "exercises").glob("*.ipynb")]
    asking = [str(f.relative_to(root)) for f in files if "is_bf16_supported(" in f.read_text(encoding="utf-8")]
    assert not asking, asking


def test_every_relative_import_in_the_package_names_something_that_exists():
    """Imports inside functions run only on the path that reaches them (a speed check runs on a GPU only):
    read every ``from .x import name`` in the package and look each name up, so a renamed helper fails here."""
    import ast
    import importlib

    root = Path(kc.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        package = ".".join(("kernelcourse",) + path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            name = base + ("." + node.module if node.module else "")
            try:
                module = importlib.import_module(name)
            except ImportError as e:  # an optional dependency (transformers) may be absent: not this test's concern
                if name.startswith("kernelcourse") and "kernelcourse" in str(e):
                    missing.append(f"{path.name}:{node.lineno} {name} ({e})")
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{name}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(root)}:{node.lineno} {name}.{alias.name}")
    assert not missing, missing
