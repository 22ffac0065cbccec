"""The repository's tools: exercise generation, setup cells, GPU stamps."""
import copy
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import exercises  # noqa: E402
import notebooks  # noqa: E402
import stamp  # noqa: E402


def test_stub_in_a_plain_function_raises_and_gives_the_size():
    src = "def f(n):\n    ### BEGIN SOLUTION\n    m = n + 1\n    # a comment\n    return m\n    ### END SOLUTION\n"
    out = exercises.strip_solutions(src)
    assert "m = n + 1" not in out and "about 2 lines" in out
    assert 'raise NotImplementedError' in out
    compile(out, "<stub>", "exec")


@pytest.mark.parametrize("decorator", ["@cuda.jit", "@triton.jit", "@cuda.jit(fastmath=True)"])
def test_stub_in_a_kernel_is_pass(decorator):
    src = f"{decorator}\ndef k(x):\n    ### BEGIN SOLUTION\n    x[0] = 1\n    ### END SOLUTION\n"
    out = exercises.strip_solutions(src)
    assert out.rstrip().endswith("pass") and "NotImplementedError" not in out and "about 1 line)" in out
    compile(out, "<stub>", "exec")


def test_markdown_answer_is_replaced():
    out = exercises.strip_solutions("Q?\n### BEGIN SOLUTION\nA secret.\n### END SOLUTION", markdown=True)
    assert "secret" not in out and exercises.MARKDOWN_STUB in out


def test_unterminated_solution_is_an_error():
    with pytest.raises(ValueError):
        exercises.strip_solutions("### BEGIN SOLUTION\nx = 1\n")


def test_generated_exercises_hold_no_solution_and_no_output():
    for path, text in exercises.generate().items():
        nb = nbformat.reads(text, as_version=4)
        # the page opens with its title, then the note for the learner; what it was generated from
        # (for the maintainers' tools) lives in the metadata, not on the page
        assert nb.cells[0].source.startswith("# ") and "Your exercise notebook" in nb.cells[1].source
        assert nb.metadata["kernelcourse"]["generated_from"] == f"solutions/{path.name}"
        assert nb.metadata["kernelcourse"]["cells"] == exercises.cells_hash(nb)
        for cell in nb.cells:
            assert "BEGIN SOLUTION" not in cell.source, path
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path


def test_setup_cell_comes_from_config_and_installs_a_release():
    source = notebooks.bootstrap_source()
    assert notebooks.config()["repository"]["url"] in source
    import kernelcourse

    assert notebooks.release_ref() == f"v{kernelcourse.__version__}"  # pyproject and the package agree
    assert f"@v{kernelcourse.__version__}\"" in source and "@main" not in source


def _stamped_lesson():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(notebooks.bootstrap_source(), metadata={"tags": ["bootstrap"]}),
                nbformat.v4.new_code_cell("x = 1", execution_count=2)]
    nb.cells[0].execution_count = 1
    versions = {k: "1.0" for k in stamp.VERSION_KEYS}
    nb.metadata["kernelcourse"] = {"stamp": {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-21", "versions": versions,
                                             "code_sha256": notebooks.code_hash(nb)}}
    return nb


def test_stamp_check_accepts_a_current_stamp():
    assert stamp.stamp_problem(_stamped_lesson()) is None


def test_stamp_check_catches_changed_code():
    nb = _stamped_lesson()
    nb.cells[1].source = "x = 2"
    assert "stale" in stamp.stamp_problem(nb)


def test_stamp_check_catches_a_warning_or_an_error_in_the_outputs():
    nb = _stamped_lesson()
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    assert stamp.stamp_problem(nb) is None
    nb.cells[1].outputs.append(nbformat.v4.new_output(
        "stream", name="stderr", text="\n/x/profiler.py:224: UserWarning: Profiler clears events\n  _warn_once(\n"))
    problem = stamp.stamp_problem(nb)
    assert "cell 1" in problem and "UserWarning: Profiler clears events" in problem
    nb.cells[1].outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[])]
    assert "ValueError: bad" in stamp.stamp_problem(nb)


def test_stamp_check_ignores_comments_but_not_what_runs():
    nb = _stamped_lesson()
    nb.cells[1].source = "x = 1  # one, as measured\n# a note on its own line"
    assert stamp.stamp_problem(nb) is None  # a comment mended: the outputs are still this code's
    for changed in ("x = 1\ny = '# not a comment'", "x = 1\n\n", "x  =  1", "if True:\n    x = 1"):
        nb.cells[1].source = changed
        assert "stale" in stamp.stamp_problem(nb), changed


def test_stamp_check_ignores_the_setup_cell_and_prose():
    nb = _stamped_lesson()
    nb.cells[0].source += "\n# another repository"
    nb.cells.append(nbformat.v4.new_markdown_cell("More prose."))
    assert stamp.stamp_problem(nb) is None


def test_stamp_check_notes_a_stamp_made_before_a_version_was_recorded():
    nb = _stamped_lesson()
    assert stamp.stamp_note(nb) is None
    del nb.metadata["kernelcourse"]["stamp"]["versions"]["numpy"]
    assert stamp.stamp_problem(nb) is None  # its outputs are still the stamped code's, run on a GPU
    assert "predates recording numpy" in stamp.stamp_note(nb)


def test_stamp_check_rejects_missing_and_cpu_stamps():
    nb = _stamped_lesson()
    cpu = copy.deepcopy(nb)
    cpu.metadata["kernelcourse"]["stamp"]["gpu"] = "CPU"
    del nb.metadata["kernelcourse"]
    assert "no GPU stamp" in stamp.stamp_problem(nb)
    assert "not from a GPU" in stamp.stamp_problem(cpu)


PACKAGE_CODE = '''@triton.jit
def add_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)


def launch(x):
    return add_kernel[(1,)](x, x.numel(), BLOCK=64)
'''


def _printing_lesson(printed: str, package: Path):
    """A stamped lesson whose last cell prints code as inspect.getsource gave it, and a package that holds
    PACKAGE_CODE."""
    (package / "kernels.py").write_text("import triton\n\n\n" + PACKAGE_CODE)
    nb = _stamped_lesson()
    cell = nbformat.v4.new_code_cell("Code(inspect.getsource(kc.kernels.add_kernel.fn) + '\\n\\n' + "
                                     "inspect.getsource(kc.kernels.launch))", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": printed}, execution_count=3)]
    nb.cells.append(cell)
    nb.metadata["kernelcourse"]["stamp"]["code_sha256"] = notebooks.code_hash(nb)
    return nb


def test_stamp_check_catches_printed_package_code_that_changed(tmp_path):
    """A lesson that prints the package's code shows it as it was when the lesson ran: once the package
    changes, the page shows old code, though no code cell of the lesson changed."""
    printed = PACKAGE_CODE.strip("\n")
    nb = _printing_lesson(printed, tmp_path)
    assert stamp.stale_printed_source(nb, tmp_path) == []
    for old, new in (("BLOCK=64", "BLOCK=128"), ("pid = tl.program_id(0)", "pid = tl.program_id(1)")):
        (tmp_path / "kernels.py").write_text("import triton\n\n\n" + PACKAGE_CODE.replace(old, new))
        stale = stamp.stale_printed_source(nb, tmp_path)
        assert stale in ([f"launch in {tmp_path.name}/kernels.py"], [f"add_kernel in {tmp_path.name}/kernels.py"]), stale


def test_stamp_check_leaves_code_the_lesson_defines_itself_to_its_hash(tmp_path):
    """A function the lesson defines (and prints) is in a code cell, which the stamp's hash covers already."""
    nb = _printing_lesson("def mine(x):\n    return x + 1", tmp_path)
    assert stamp.stale_printed_source(nb, tmp_path) == []


def test_the_course_s_lessons_print_the_package_code_they_ran():
    """Every piece of the package a lesson prints is found, as printed, in the package (main's own check)."""
    import glob

    for path in sorted(glob.glob(str(ROOT / "notebooks" / "*.ipynb"))):
        assert stamp.stale_printed_source(notebooks.read(Path(path))) == [], path


def test_site_check_finds_broken_links_and_anchors(tmp_path):
    import check_site

    (tmp_path / "a.html").write_text('<h1 id="top">A</h1>')
    base = "http://127.0.0.1:1/b/page.html"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "page.html").write_text("<p>B</p>")
    problems = check_site.check_links(tmp_path, base, ["../a.html#top", "../a.html#nowhere", "missing.html",
                                                      "https://example.org/x", "#"])
    assert len(problems) == 2, problems
    assert any("no anchor #nowhere" in p for p in problems) and any("missing.html" in p for p in problems)


def test_site_check_expects_colab_at_the_notebook_path():
    import check_site

    url = check_site.expected_colab("notebooks/01_vector_add.html")
    assert url.startswith("https://colab.research.google.com/github/")
    assert url.endswith("/blob/main/notebooks/01_vector_add.ipynb")


def test_stamping_shows_the_home_directory_as_a_tilde():
    nb = _stamped_lesson()
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="cached in /home/ann/.cache/kc/x.json\n")]
    assert stamp.scrub_home(nb, home="/home/ann") == 1
    assert nb.cells[1].outputs[0].text == "cached in ~/.cache/kc/x.json\n"
    assert stamp.stamp_problem(nb) is None  # outputs only: the code hash is unchanged


def test_speed_margins_reads_each_graded_speed_line_and_its_threshold():
    sys.path.insert(0, str(ROOT / "tools"))
    import speed_margins

    text = "\n".join([
        "✔ 08.5 dx, 7 x 37: max error 1e-07",
        "✘ LayerNorm backward at 16384 x 2048 bfloat16: 0.85x the speed of PyTorch's LayerNorm backward "
        "(0.155 ms vs 0.168 ms); needs at least 0.9x: keep the sums in registers",
        "✔ matrix add 4099 x 4101: 2100 GB/s, 62% of a copy's bandwidth measured now (needs 60%)",
        "✘ the causal kernel at (heads, N, d) = (64, 4096, 64), against its own run with every key visible: "
        "causal 0.136 ms, every key 0.158 ms: 0.86x, needs at most 0.75x: loop over fewer keys",
        "– 08.5 LayerNorm backward at 16384 x 2048 16-bit: speed needs a GPU (not graded here)"])
    assert speed_margins.speed_lines(text) == {
        "LayerNorm backward at 16384 x 2048 bfloat16": (0.85, 0.9, False),
        "matrix add 4099 x 4101": (62.0, 60.0, False),
        "the causal kernel at (heads, N, d) = (64, 4096, 64), against its own run with every key visible": (0.86, 0.75, True)}
    assert set(speed_margins.versions()) == {"01.6", "04.5", "05.4", "06.8", "07.5", "08.5", "09.4"}


def test_speed_margins_runs_as_a_script_from_anywhere(tmp_path):
    """Run as the README says, from another folder: it finds the package and the grader tests it grades
    with before it looks for a GPU (here there is none, and it says so)."""
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU the script grades every speed check several times over: minutes")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "speed_margins.py"), "08.5", "--runs", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "there is none here" in run.stdout, run.stdout + run.stderr
