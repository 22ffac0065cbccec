"""Timing on a GPU, and recorded GPU results for readers without one (introduced in chapter 01).

On a GPU, ``measured_or_recorded(name, measure)`` runs ``measure()`` now. On the CPU it loads what a
GPU run saved under ``kernelcourse/recorded/<name>.json`` and says where and when it was recorded.
A GPU run saves (or refreshes) that file only when ``KC_RECORD=1``, which
``python tools/stamp.py --record notebooks/NN_slug.ipynb`` sets: the lesson notebook is the script
that regenerates its own recorded data, on any GPU.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .world import host_cpu, world

RECORDED_DIR = Path(__file__).parent / "recorded"


def do_bench(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn()`` in milliseconds, with CUDA events and a flushed L2 between runs.

    A thin wrapper over ``triton.testing.do_bench`` (warm-up and repetitions are in milliseconds).
    """
    if not world().gpu:
        raise RuntimeError("timing needs a CUDA GPU; on the CPU, notebooks show recorded results instead")
    from triton.testing import do_bench as _do_bench

    return float(_do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def gpu_time(fn, *, reps: int = 20, trials: int = 5) -> float:
    """Milliseconds that ``fn``'s kernels take on the GPU alone: no CPU work (Python, launches) between them.

    ``do_bench`` times a call as a program makes it; when a kernel runs for less time than Python takes to
    launch it, that time is the launch's. Here ``fn`` runs ``reps`` times inside a CUDA graph, each run
    after an L2 flush (as in ``do_bench``), and a graph of the flushes alone is timed and subtracted:
    the median over ``trials`` replays. ``fn`` runs once first, outside the graph, to compile and tune.
    """
    if not world().gpu:
        raise RuntimeError("timing needs a CUDA GPU; on the CPU, notebooks show recorded results instead")
    import statistics

    import torch

    fn()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")  # larger than any GPU's L2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(side):
        fn()  # capture wants a warm-up on the capturing stream
        for with_fn in (True, False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                for _ in range(reps):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(graph)
    torch.cuda.current_stream().wait_stream(side)

    def replay_ms(graph):
        times = []
        for _ in range(trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return max(replay_ms(graphs[0]) - replay_ms(graphs[1]), 0.0) / reps


def gpu_time_for_autotune(fn, quantiles=None):
    """``gpu_time`` in the form ``triton.autotune(do_bench=...)`` calls: it ranks configs by what they cost
    the GPU, where a short kernel's ``do_bench`` time would mostly be its launch (the same for all)."""
    ms = gpu_time(fn, reps=10, trials=3)
    return [ms] * len(quantiles) if quantiles else ms


def gbps(nbytes: float, ms: float) -> float:
    """Effective bandwidth in GB/s (10^9 bytes per second) of moving ``nbytes`` in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def provenance() -> dict:
    w = world()
    return {
        "gpu": w.name,
        "compute_capability": ".".join(map(str, w.capability)) if w.capability else None,
        "versions": w.versions,
        "cpu": host_cpu(),  # launch costs and calls timed from Python depend on it
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "command": os.environ.get("KC_RECORD_COMMAND", "interactive"),
    }


@dataclass
class Results:
    name: str
    rows: list[dict]
    provenance: dict
    recorded: bool  # True when loaded from a file rather than measured now

    @property
    def label(self) -> str:
        p = self.provenance
        if p.get("gpu") is None:
            return "no GPU recording yet"
        when = "recorded" if self.recorded else "measured"
        return f"{when} on {p['gpu']}, {p['date']}"

    def column(self, key: str) -> list:
        return [r[key] for r in self.rows]

    def select(self, **where) -> list[dict]:
        return [r for r in self.rows if all(r.get(k) == v for k, v in where.items())]


def recorded_path(name: str) -> Path:
    return RECORDED_DIR / f"{name}.json"


def load(name: str) -> Results:
    path = recorded_path(name)
    if not path.exists():
        raise FileNotFoundError(
            f"no recorded GPU results named {name!r} ({path}): run the lesson that measures them "
            f"on a GPU with `python tools/stamp.py --record notebooks/<lesson>.ipynb`"
        )
    data = json.loads(path.read_text())
    return Results(name, data["rows"], data["provenance"], recorded=True)


def recorded_schema(name: str) -> int | None:
    """The ``schema`` a recording was saved with (None for a recording without one, or no recording)."""
    path = recorded_path(name)
    return json.loads(path.read_text()).get("schema") if path.exists() else None


def save(results: Results, schema: int | None = None) -> Path:
    path = recorded_path(results.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"provenance": results.provenance, "rows": results.rows}
    if schema is not None:
        payload["schema"] = schema
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def records(name: str) -> bool:
    """Whether this run saves the results called ``name``: ``KC_RECORD=1``, and, when ``tools/stamp.py``
    records a lesson (it sets ``KC_RECORD_CHAPTER``), only that chapter's results (``NN_...``): lesson 04
    also measures chapter 02's ceilings, and those are recorded by lesson 02's run."""
    if os.environ.get("KC_RECORD") != "1":
        return False
    chapter = os.environ.get("KC_RECORD_CHAPTER")
    return not chapter or name.startswith(f"{chapter}_")


_last_shown: list[Results] = []  # the recorded results measured_or_recorded showed last, on the CPU


def last_shown() -> Results | None:
    """The recorded results that ``measured_or_recorded`` showed last in this process (None on a GPU, or before
    any): which GPU the numbers a reader without one is looking at came from."""
    return _last_shown[-1] if _last_shown else None


def measured_or_recorded(name: str, measure, schema: int | None = None) -> Results:
    """Measure now on a GPU (``measure()`` returns a list of dict rows), or load the recorded rows.

    ``schema`` numbers what the rows hold: when a lesson changes what it measures it raises the number,
    and on the CPU a recording saved with another number (or none) is not shown: the result has no rows,
    and a line says that no GPU recording of this measurement exists yet.
    """
    if world().gpu:
        results = Results(name, measure(), provenance(), recorded=False)
        if records(name):
            save(results, schema)
    else:
        if schema is not None and recorded_schema(name) != schema:
            print(f"No GPU here, and no GPU recording of this measurement ({name!r}) exists yet: "
                  f"run this notebook on a GPU to see it.")
            return Results(name, [], {"gpu": None, "date": None}, recorded=True)
        results = load(name)
        _last_shown[:] = [results]
        p = results.provenance
        v = p["versions"]
        print(f"No GPU here: these are results recorded on {p['gpu']} on {p['date']} "
              f"(torch {v['torch']}, triton {v['triton']}), not measured now.")
    return results


def table(rows: list[dict], columns: dict[str, str]) -> str:
    """Render ``rows`` as a fixed-width text table; ``columns`` maps row keys to format specs."""
    heads = list(columns)
    cells = [[format(r[k], columns[k]) for k in heads] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# ---- profiling (introduced in chapter 08) ---------------------------------------------------------

TRACE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "user_annotation",
                    "gpu_user_annotation"}
# Every call by which the CPU starts work on the GPU. PyTorch's own kernels go through cudaLaunchKernel;
# Triton's kernels and cuBLAS's newer ones through the driver's cuLaunchKernelEx (or the runtime's
# cudaLaunchKernelExC): a count of cudaLaunchKernel alone misses them.
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cuLaunchKernel",
               "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cudaGraphLaunch", "cuGraphLaunch",
               "cudaMemcpyAsync", "cudaMemsetAsync")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def compact_trace(trace) -> list[dict]:
    """The events of a Chrome trace (a dict, or the path ``prof.export_chrome_trace`` wrote) that say where
    time went: GPU kernels and copies, CUDA runtime and driver calls, annotated ranges; rows
    ``{cat, name, ts, dur}`` in microseconds from the first kept event, sorted by start."""
    if not isinstance(trace, dict):
        trace = json.loads(Path(trace).read_text())
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in TRACE_CATEGORIES]
    t0 = min(float(e["ts"]) for e in evs)
    rows = [{"cat": e["cat"], "name": e["name"], "ts": round(float(e["ts"]) - t0, 3), "dur": round(float(e["dur"]), 3)}
            for e in evs]
    return sorted(rows, key=lambda r: r["ts"])


def profile(fn, *, wait: int = 1, warmup: int = 3, active: int = 2) -> dict:
    """Profile ``fn()`` with ``torch.profiler`` on a schedule: ``wait`` calls unrecorded, ``warmup`` calls
    with the profiler running but their events dropped, then ``active`` recorded calls.

    The first calls under a profiler are slow (it allocates its buffers, CUPTI attaches to the kernels),
    and a trace of them shows that cost, not ``fn``'s: the warm-up calls absorb it. Compile and tune
    ``fn`` before (run it once or twice): the schedule does not tell a first call's compilation from its
    work. Each call is one profiler step (``ProfilerStep#i`` in the trace). Returns
    ``{"events": compact_trace(...), "stats": trace_stats(events)}``.
    """
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, schedule

    if not world().gpu:
        raise RuntimeError("profiling a GPU's kernels needs a CUDA GPU; on the CPU, notebooks show recorded traces")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                                acc_events=True) as prof:  # one cycle: keep its events (else torch warns it clears them)
        for i in range(wait + warmup + active):
            fn()
            if i == wait + warmup - 1:
                torch.cuda.synchronize()  # the warm-up's kernels end before the recorded steps begin
            prof.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = compact_trace(path)
    return {"events": events, "stats": trace_stats(events)}


def trace_stats(events: list[dict]) -> dict:
    """What a compact trace says about launches and idle time.

    ``kernels``: GPU events (kernels, copies, memsets); ``launches``: every launch call of ``LAUNCH_APIS``
    and ``launches_by_api``: per call; ``span_us`` from the first GPU event's start to the last one's end,
    ``busy_us`` the time some GPU event runs (overlaps count once), ``idle_us`` and ``idle_share`` the rest;
    ``steps``: the recorded profiler steps, and ``step_ms``: the span divided by their number.
    """
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] in GPU_CATEGORIES)
    busy, end = 0.0, float("-inf")
    for s, t in iv:
        if t > end:
            busy += t - max(s, end)
            end = t
    span = end - iv[0][0] if iv else 0.0  # to the latest end: the last event to start can end inside another
    by_api: dict[str, int] = {}
    for e in events:
        if e["cat"] in ("cuda_runtime", "cuda_driver") and e["name"] in LAUNCH_APIS:
            by_api[e["name"]] = by_api.get(e["name"], 0) + 1
    steps = sum(1 for e in events if e["cat"] == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    return {"kernels": len(iv), "launches": sum(by_api.values()), "launches_by_api": by_api,
            "span_us": span, "busy_us": busy, "idle_us": span - busy, "idle_share": (span - busy) / span if span else 0.0,
            "steps": steps, "step_ms": span / steps / 1e3 if steps else float("nan")}

def cpu_time_per_call(fn, *, calls: int = 200, warmup: int = 5) -> float:
    """Microseconds of the CPU's time per call of ``fn`` (introduced in chapter 09): ``calls`` calls issued
    back to back, with no wait for the GPU between them (the GPU runs them behind, asynchronously), after
    ``warmup`` calls to compile, tune and warm the caches. When this exceeds the GPU's time per call
    (``gpu_time``), a stream of such calls keeps the GPU waiting: they are launch-bound."""
    import time

    import torch

    gpu = world().gpu
    for _ in range(warmup):
        fn()
    if gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    if gpu:
        torch.cuda.synchronize()
    return us


def measured_recorded_or_none(name: str, measure) -> Results | None:
    """``measured_or_recorded``, or None on a machine without a GPU when no GPU run has recorded ``name`` yet
    (introduced in chapter 09); then it says so in one line, and the notebook shows nothing in its place."""
    try:
        return measured_or_recorded(name, measure)
    except FileNotFoundError:
        print(f"No GPU here, and no GPU run has recorded these results ({name}) yet: nothing to show. "
              f"On a GPU this cell measures them.")
        return None
