"""kc.roofline: the model's formulas, the datasheet table, the probe's bookkeeping (with a stand-in
timer on the CPU), where ceilings come from in each world, and the plot (Agg backend)."""
import json
import math

import matplotlib
import pytest

matplotlib.use("Agg")

import kernelcourse as kc  # noqa: E402
from kernelcourse import bench, roofline  # noqa: E402
from kernelcourse.world import World  # noqa: E402

H100ISH = roofline.Ceilings("NVIDIA H100 80GB HBM3", 3000.0,
                            {"fp32": 50.0, "tf32": 400.0, "fp16": 700.0, "bf16": 700.0}, "test")

# ---- formulas -----------------------------------------------------------------------------------------


def test_intensity():
    assert roofline.intensity(100, 400) == 0.25
    with pytest.raises(ValueError):
        roofline.intensity(1, 0)


def test_ridge_units():
    # 1000 TFLOP/s over 2000 GB/s: 10^15 FLOP/s / 2 x 10^12 B/s = 500 FLOP/B
    assert roofline.ridge(1000, 2000) == pytest.approx(500)


def test_attainable_both_sides_of_the_ridge():
    peak, bw = 700.0, 3000.0
    knee = roofline.ridge(peak, bw)
    assert roofline.attainable(1.0, peak, bw) == pytest.approx(3.0)       # 1 FLOP/B x 3 TB/s
    assert roofline.attainable(knee, peak, bw) == pytest.approx(peak)
    assert roofline.attainable(10 * knee, peak, bw) == peak
    arr = roofline.attainable([0.5, knee * 2], peak, bw)
    assert arr.shape == (2,) and arr[0] == pytest.approx(1.5) and arr[1] == peak


def test_lower_bound_is_the_larger_limit():
    # 1 GB at 1000 GB/s = 1 ms; 1 TFLOP at 100 TFLOP/s = 10 ms
    assert roofline.lower_bound_ms(1e12, 1e9, 100, 1000) == pytest.approx(10)
    assert roofline.lower_bound_ms(1e9, 1e9, 100, 1000) == pytest.approx(1)
    assert roofline.bound(1e9, 1e9, 100, 1000) == "memory"
    assert roofline.bound(1e12, 1e9, 100, 1000) == "compute"


def test_attainable_and_lower_bound_agree():
    flops, nbytes = 3e11, 2e9
    t = roofline.lower_bound_ms(flops, nbytes, 700, 3000)
    roof = roofline.attainable(roofline.intensity(flops, nbytes), 700, 3000)
    assert flops / (t * 1e-3) / 1e12 == pytest.approx(roof)


def test_point():
    p = roofline.Point("mm", flops=2e12, nbytes=1e9, ms=4.0)
    assert p.intensity == 2000 and p.tflops == pytest.approx(500) and p.dtype == "fp16"

# ---- datasheet ----------------------------------------------------------------------------------------


def test_datasheet_rows_are_dense_and_sourced():
    names = [r["gpu"] for r in roofline.DATASHEET]
    assert names == ["T4", "L4", "A100 80GB SXM", "H100 SXM", "H200 SXM"]
    for r in roofline.DATASHEET:
        assert r["source"].startswith("https://www.nvidia.com/")
        assert r["bandwidth_gbps"] > 0 and r["fp32"] > 0 and r["fp16"] > r["fp32"]
    h100 = roofline.datasheet("NVIDIA H100 80GB HBM3")
    assert h100["fp16"] == pytest.approx(1979 / 2, rel=1e-3)  # dense: half the sparse figure
    assert roofline.datasheet("Tesla T4")["tf32"] is None
    assert roofline.datasheet("NVIDIA A100-SXM4-80GB")["bandwidth_gbps"] == 2039
    assert roofline.datasheet("NVIDIA H100 PCIe") is None
    assert roofline.datasheet("NVIDIA L4")["gpu"] == "L4"
    assert roofline.datasheet("NVIDIA H200")["bandwidth_gbps"] == 4800
    assert "H200 SXM" in roofline.datasheet_table()

# ---- the probe and the ceilings ---------------------------------------------------------------------


def test_measure_rows_with_a_stand_in_timer():
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 2.0

    rows = roofline.measure("cpu", dtypes=["fp32", "tf32", "fp16", "bf16"], copy_bytes=1 << 20, matmul_sizes=(16, 32),
                            timer=timer)
    assert [r["ceiling"] for r in rows] == ["bandwidth", "fp32", "tf32", "fp16", "bf16"]
    assert rows[0]["value"] == pytest.approx(2 * (1 << 20) / 2e-3 / 1e9)   # read + write
    assert rows[1]["value"] == pytest.approx(2 * 32**3 / 2e-3 / 1e12)
    assert "TF32 off" in rows[1]["how"]
    json.dumps(rows)  # recorded rows must be JSON
    c = roofline.Ceilings.from_rows("x", rows, "measured now on x")
    assert set(c.peak_tflops) == {"fp32", "tf32", "fp16", "bf16"} and c.details == rows


def test_probe_dtypes_follow_the_architecture():
    assert roofline._probe_dtypes((7, 5)) == ["fp32", "fp16"]
    assert set(roofline._probe_dtypes((9, 0))) == {"fp32", "tf32", "fp16", "bf16"}


def test_ceilings_methods_and_text():
    assert H100ISH.ridge("fp16") == pytest.approx(700e12 / 3000e9)
    assert H100ISH.lower_bound_ms(1e9, 3e9) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="no fp8 ceiling"):
        H100ISH.peak("fp8")
    assert "ridge" in str(H100ISH) and "GB/s" in str(H100ISH)


def test_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert roofline.cache_path("NVIDIA H100 80GB HBM3") == tmp_path / "kernelcourse" / "ceilings-nvidia-h100-80gb-hbm3.json"


def _cpu_world(monkeypatch):
    """These tests are about the CPU path; they hold on a GPU machine too."""
    cpu = World(False, "cpu", "CPU", None, kc.world().versions)
    monkeypatch.setattr(roofline, "world", lambda: cpu)
    monkeypatch.setattr(bench, "world", lambda: cpu)


def _recorded(tmp_path, monkeypatch):
    rows = [{"ceiling": "bandwidth", "value": 2900.0, "unit": "GB/s", "how": "copy"},
            {"ceiling": "fp16", "value": 650.0, "unit": "TFLOP/s", "how": "mm"}]
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-01-02", "command": "test",
            "versions": {"torch": "2.11", "triton": "3.6"}}
    (tmp_path / "02_ceilings.json").write_text(json.dumps({"provenance": prov, "rows": rows}))
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)


def test_ceilings_on_the_cpu_are_the_recorded_ones(tmp_path, monkeypatch, capsys):
    _cpu_world(monkeypatch)
    _recorded(tmp_path, monkeypatch)
    c = roofline.ceilings()
    assert c.gpu == "NVIDIA H100 80GB HBM3" and c.bandwidth_gbps == 2900 and c.peak_tflops == {"fp16": 650.0}
    assert c.source == "recorded on NVIDIA H100 80GB HBM3, 2026-01-02"
    assert "probe needs a CUDA GPU" in capsys.readouterr().out


def test_ceilings_on_the_cpu_without_a_recording(tmp_path, monkeypatch):
    _cpu_world(monkeypatch)
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="02_roofline.ipynb"):
        roofline.ceilings()


def _gpu_world(tmp_path, monkeypatch) -> World:
    """An imaginary GPU, its recorded results and its ceilings' cache under tmp_path, a small copy to probe."""
    gpu = World(True, "cuda", "NVIDIA Imaginary X1", (9, 0), {"torch": "t", "triton": "t"})
    monkeypatch.setattr(roofline, "world", lambda: gpu)
    monkeypatch.setattr(bench, "world", lambda: gpu)
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path / "recorded")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(roofline, "_fit_copy_bytes", lambda: 1 << 20)
    return gpu


def test_ceilings_on_a_gpu_measure_once_then_cache(tmp_path, monkeypatch):
    gpu = _gpu_world(tmp_path, monkeypatch)
    monkeypatch.delenv("KC_RECORD", raising=False)
    probes = []

    def fake_measure(device, copy_bytes):
        probes.append(copy_bytes)
        return [{"ceiling": "bandwidth", "value": 1000.0 + len(probes), "unit": "GB/s", "how": ""},
                {"ceiling": "fp16", "value": 100.0, "unit": "TFLOP/s", "how": ""}]

    monkeypatch.setattr(roofline, "measure", fake_measure)
    first = roofline.ceilings(quiet=True)
    assert first.source == "measured now on NVIDIA Imaginary X1" and first.bandwidth_gbps == 1001
    assert roofline.cache_path(gpu.name).exists()
    again = roofline.ceilings(quiet=True)
    assert len(probes) == 1 and again.bandwidth_gbps == 1001 and "cached" in again.source
    fresh = roofline.ceilings(refresh=True, quiet=True)
    assert len(probes) == 2 and fresh.bandwidth_gbps == 1002
    assert not (tmp_path / "recorded").exists()  # only KC_RECORD=1 writes the course's recorded file

def _write(directory, name, gpu, bandwidth, command="python tools/stamp.py --record notebooks/05_tiled_matmul.ipynb"):
    rows = [{"ceiling": "bandwidth", "value": bandwidth, "unit": "GB/s", "how": "copy"},
            {"ceiling": "fp16", "value": 650.0, "unit": "TFLOP/s", "how": "mm"}]
    prov = {"gpu": gpu, "date": "2026-01-03", "command": command, "versions": {"torch": "2.11", "triton": "3.6"}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps({"provenance": prov, "rows": rows}))


def test_on_the_cpu_a_lesson_s_points_get_the_roof_of_the_gpu_that_recorded_them(tmp_path, monkeypatch):
    _cpu_world(monkeypatch)
    _recorded(tmp_path, monkeypatch)                                   # lesson 02's: an H100's, 2900 GB/s
    _write(tmp_path, "05_sweep", "NVIDIA H200", 0)                     # lesson 05 recorded on an H200...
    _write(tmp_path, "05_ceilings", "NVIDIA H200", 4200.0)             # ...with the ceilings it drew there
    _write(tmp_path, "06_versions", "NVIDIA H100 80GB HBM3", 0)        # lesson 06 on lesson 02's GPU, none of its own
    monkeypatch.setattr(bench, "_last_shown", [])
    assert roofline.ceilings(quiet=True).bandwidth_gbps == 2900       # nothing shown yet: lesson 02's
    bench.measured_or_recorded("05_sweep", None)
    c = roofline.ceilings(quiet=True)
    assert c.gpu == "NVIDIA H200" and c.bandwidth_gbps == 4200 and "H200" in c.source
    assert roofline.ceilings(quiet=True).bandwidth_gbps == 4200       # asked again: the same roof
    bench.measured_or_recorded("06_versions", None)
    assert roofline.ceilings(quiet=True).bandwidth_gbps == 2900
    _write(tmp_path, "05_ceilings", "NVIDIA A100-SXM4-80GB", 1900.0)  # of another GPU than 05's results: not used
    bench.measured_or_recorded("05_sweep", None)
    assert roofline.ceilings(quiet=True).bandwidth_gbps == 2900


def test_a_recording_run_of_a_later_lesson_keeps_the_ceilings_it_drew(tmp_path, monkeypatch):
    gpu = _gpu_world(tmp_path, monkeypatch)
    monkeypatch.setattr(roofline, "measure", lambda device, copy_bytes: [
        {"ceiling": "bandwidth", "value": 1234.0, "unit": "GB/s", "how": ""},
        {"ceiling": "fp16", "value": 100.0, "unit": "TFLOP/s", "how": ""}])
    monkeypatch.setenv("KC_RECORD", "1")
    monkeypatch.setenv("KC_RECORD_COMMAND", "python tools/stamp.py --record notebooks/05_tiled_matmul.ipynb")
    monkeypatch.setenv("KC_RECORD_CHAPTER", "05")
    roofline.ceilings(quiet=True)                                       # measured now
    saved = bench.load("05_ceilings")
    assert saved.provenance["gpu"] == gpu.name and saved.rows[0]["value"] == 1234.0
    assert not bench.recorded_path("02_ceilings").exists()             # lesson 02's are lesson 02's run's to record
    bench.recorded_path("05_ceilings").unlink()
    monkeypatch.setenv("KC_RECORD_CHAPTER", "06")
    roofline.ceilings(quiet=True)                                       # cached by lesson 05's run: recorded too
    assert bench.load("06_ceilings").rows[0]["value"] == 1234.0
    assert not bench.recorded_path("05_ceilings").exists()
    monkeypatch.delenv("KC_RECORD")
    monkeypatch.setenv("KC_RECORD_CHAPTER", "08")
    roofline.ceilings(quiet=True)                                       # not a recording run: nothing written
    assert not bench.recorded_path("08_ceilings").exists()

# ---- the plot -----------------------------------------------------------------------------------------


def test_plot_draws_roof_ridge_and_points():
    points = [roofline.Point("vector add", 1e8, 6e8, 0.25),
              roofline.Point("matmul 8192", 2 * 8192**3, 3 * 8192**2 * 2, 1.8),
              roofline.Point("fp32 add", 1e8, 12e8, 0.5, dtype="fp32")]
    ax = roofline.plot(points, H100ISH, dtype="fp16", title="test")
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "FLOPs / byte" in ax.get_xlabel() and "TFLOP/s" in ax.get_ylabel()
    assert ax.get_title() == "test"
    texts = [t.get_text() for t in ax.texts]
    assert "vector add" in texts and "matmul 8192" in texts and any("ridge" in t for t in texts)
    # the ridge line sits at peak / bandwidth
    ridge_x = [ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == "--"]
    assert ridge_x and math.isclose(ridge_x[0], H100ISH.ridge("fp16"))
    labels = ax.get_legend_handles_labels()[1]
    assert any("fp32 compute ceiling" in lab for lab in labels)
    assert not any("above the roof" in lab for lab in labels)
    matplotlib.pyplot.close(ax.figure)


def test_plot_flags_a_point_above_the_roof():
    too_fast = roofline.Point("no synchronize", 2 * 8192**3, 3 * 8192**2 * 2, 0.01)
    ax = roofline.plot([too_fast], H100ISH)
    assert any("above the roof" in lab for lab in ax.get_legend_handles_labels()[1])
    matplotlib.pyplot.close(ax.figure)


def test_plot_on_given_axes_and_default_title(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    out = roofline.plot([roofline.Point("x", 1e6, 1e6, 1e-3)], H100ISH, dtype="tf32", ax=ax)
    assert out is ax and "tf32" in ax.get_title() and H100ISH.gpu in ax.get_title()
    with pytest.raises(KeyError):
        roofline.plot([], H100ISH, dtype="fp8")
    _cpu_world(monkeypatch)
    _recorded(tmp_path, monkeypatch)  # ceilings=None: this world's ceilings (recorded, on the CPU)
    ax2 = roofline.plot([], dtype="fp16")
    assert "recorded on" in ax2.get_title()
    plt.close("all")
