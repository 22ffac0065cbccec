"""kc.bench's trace statistics and the recorded-schema check (the profiling itself needs a GPU)."""
import json

import pytest

import kernelcourse as kc
from kernelcourse import bench


def test_trace_stats_counts_every_launch_api_and_merges_overlaps():
    ev = [{"cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0.0, "dur": 50.0},
          {"cat": "user_annotation", "name": "ProfilerStep#4", "ts": 50.0, "dur": 50.0},
          {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 3.0},
          {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 5.0, "dur": 3.0},
          {"cat": "cuda_runtime", "name": "cudaLaunchKernelExC", "ts": 9.0, "dur": 3.0},
          {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 90.0, "dur": 3.0},
          {"cat": "kernel", "name": "a", "ts": 10.0, "dur": 20.0},
          {"cat": "kernel", "name": "b", "ts": 20.0, "dur": 20.0},     # overlaps a: counts once
          {"cat": "kernel", "name": "c", "ts": 90.0, "dur": 10.0}]
    s = bench.trace_stats(ev)
    assert s["launches"] == 3 and s["launches_by_api"] == {"cudaLaunchKernel": 1, "cuLaunchKernelEx": 1,
                                                           "cudaLaunchKernelExC": 1}
    assert s["kernels"] == 3 and s["span_us"] == 90 and s["busy_us"] == 40
    assert s["idle_share"] == pytest.approx(50 / 90)
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(0.045)


def test_the_span_ends_at_the_latest_end_not_at_the_last_start():
    """A copy on another stream that starts last but ends inside a longer kernel: the span runs to the kernel's end."""
    ev = [{"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 100.0},
          {"cat": "gpu_memcpy", "name": "copy", "ts": 40.0, "dur": 10.0}]
    s = bench.trace_stats(ev)
    assert s["span_us"] == 100 and s["busy_us"] == 100 and s["idle_us"] == 0


def test_compact_trace_keeps_driver_calls(tmp_path):
    trace = {"traceEvents": [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 100, "dur": 2},
                             {"ph": "X", "cat": "kernel", "name": "k", "ts": 103.5, "dur": 4},
                             {"ph": "X", "cat": "python_function", "name": "f", "ts": 90, "dur": 40}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    ev = bench.compact_trace(path)
    assert [e["name"] for e in ev] == ["cuLaunchKernelEx", "k"] and ev[1]["ts"] == 3.5


def test_a_recording_of_another_schema_is_not_shown_on_the_cpu(tmp_path, monkeypatch, capsys):
    if kc.world().gpu:
        pytest.skip("on a GPU the measurement runs")
    monkeypatch.setattr(bench, "RECORDED_DIR", tmp_path)
    bench.save(bench.Results("99_x", [{"a": 1}], bench.provenance(), recorded=False))       # no schema
    res = bench.measured_or_recorded("99_x", None, schema=2)
    assert res.rows == [] and "no GPU recording" in capsys.readouterr().out and res.label == "no GPU recording yet"
    bench.save(bench.Results("99_x", [{"a": 1}], bench.provenance(), recorded=False), schema=2)
    assert bench.measured_or_recorded("99_x", None, schema=2).rows == [{"a": 1}]
    assert bench.measured_or_recorded("99_x", None).rows == [{"a": 1}]


@pytest.mark.skipif(not kc.world().gpu, reason="profiling a GPU's kernels needs a CUDA GPU")
def test_profile_keeps_the_active_steps_and_counts_triton_launches():
    import torch

    from kernelcourse import kernels

    x = torch.randn(1 << 20, device="cuda")
    a = torch.randn(512, 512, device="cuda")

    def step():
        kernels.add(x, x)   # a Triton kernel: launched through the driver, not cudaLaunchKernel
        (a @ a).relu_()

    step()
    s = bench.profile(step, wait=1, warmup=2, active=3)["stats"]
    assert s["steps"] == 3, s
    assert s["kernels"] >= 9 and s["launches"] >= s["kernels"], s
    assert set(s["launches_by_api"]) - {"cudaLaunchKernel"}, s   # Triton's launch API is counted too
