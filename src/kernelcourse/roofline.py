"""The roofline: arithmetic intensity, ceilings measured on the reader's GPU, and the plot (chapter 02).

Chapter 02 introduces this module; later chapters use it to put their own kernels on the reader's
roofline::

    c = kc.roofline.ceilings()              # measured once on this GPU and cached; recorded ones on the CPU
    p = kc.roofline.Point("my kernel", flops=2 * n, nbytes=12 * n, ms=0.25, dtype="fp32")
    kc.roofline.plot([p], c, dtype="fp32")

Units everywhere: FLOPs and bytes are plain counts, times are milliseconds, bandwidth is GB/s
(10^9 bytes per second), compute is TFLOP/s (10^12 FLOPs per second), intensity is FLOPs per byte.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import bench
from .world import world

RECORDED = "02_ceilings"   # recorded ceilings (kernelcourse/recorded/02_ceilings.json), shown on the CPU
LESSON_RECORDED = "{chapter}_ceilings"  # the ceilings a later lesson drew, recorded with its results
DTYPES = ("fp32", "tf32", "fp16", "bf16")

# ---- the model ------------------------------------------------------------------------------------


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity: FLOPs per byte of memory traffic."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    return flops / nbytes


def attainable(intensity, peak_tflops: float, bandwidth_gbps: float):
    """The roof: the TFLOP/s an op of this intensity can reach, ``min(peak, intensity x bandwidth)``.

    Works on a number or a NumPy array of intensities.
    """
    memory_roof = np.asarray(intensity, dtype=float) * bandwidth_gbps / 1e3  # GFLOP/s -> TFLOP/s
    roof = np.minimum(peak_tflops, memory_roof)
    return float(roof) if roof.ndim == 0 else roof


def lower_bound_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """The least time an op can take: ``max(FLOPs / peak, bytes / bandwidth)``, in milliseconds."""
    compute_s = flops / (peak_tflops * 1e12)
    memory_s = nbytes / (bandwidth_gbps * 1e9)
    return max(compute_s, memory_s) * 1e3


def ridge(peak_tflops: float, bandwidth_gbps: float) -> float:
    """The ridge point: the intensity (FLOPs/byte) where the memory slope meets the compute ceiling."""
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def bound(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> str:
    """"memory" if the op sits left of the ridge, else "compute"."""
    return "memory" if intensity(flops, nbytes) < ridge(peak_tflops, bandwidth_gbps) else "compute"


# ---- what the datasheets say ----------------------------------------------------------------------
# Dense figures. NVIDIA's datasheets for L4, H100 and H200 print the tensor-core numbers *with 2:4
# structured sparsity* (footnote "*"), twice the dense rate a plain matmul can reach: those are halved
# here. The A100 datasheet prints both (dense | sparse); T4 (Turing) has no sparsity, no TF32, no BF16.
# "fp32" is the non-tensor-core FP32 rate; "tf32" / "fp16" / "bf16" are tensor-core rates.

DATASHEET: list[dict] = [
    {"gpu": "T4", "memory": "16 GB GDDR6", "bandwidth_gbps": 320,
     "fp32": 8.1, "tf32": None, "fp16": 65, "bf16": None,
     "note": "datasheet prints '320+ GB/s'; fp16 is 'mixed precision (FP16/FP32)'; no TF32 or BF16 on Turing",
     "source": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"},
    {"gpu": "L4", "memory": "24 GB GDDR6", "bandwidth_gbps": 300,
     "fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121,
     "note": "datasheet prints 120 / 242 / 242 TFLOPS with sparsity; halved here",
     "source": "https://www.nvidia.com/en-us/data-center/l4/"},
    {"gpu": "A100 80GB SXM", "memory": "80 GB HBM2e", "bandwidth_gbps": 2039,
     "fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312,
     "note": "datasheet prints dense | sparse (156 | 312, 312 | 624); dense kept",
     "source": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"},
    {"gpu": "H100 SXM", "memory": "80 GB HBM3", "bandwidth_gbps": 3350,
     "fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5,
     "note": "datasheet prints 989 / 1,979 / 1,979 TFLOPS with sparsity; halved here",
     "source": "https://www.nvidia.com/en-us/data-center/h100/"},
    {"gpu": "H200 SXM", "memory": "141 GB HBM3e", "bandwidth_gbps": 4800,
     "fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5,
     "note": "datasheet prints 989 / 1,979 / 1,979 TFLOPS with sparsity; halved here",
     "source": "https://www.nvidia.com/en-us/data-center/h200/"},
]

# Which torch device names each datasheet row describes (PCIe and NVL boards have other figures).
_DATASHEET_NAMES = {
    "T4": r"\bT4\b",
    "L4": r"\bL4\b",
    "A100 80GB SXM": r"A100.*SXM.*80\s*GB",
    "H100 SXM": r"H100(?!.*(PCIe|NVL))",
    "H200 SXM": r"H200(?!.*NVL)",
}


def datasheet(gpu_name: str) -> dict | None:
    """The DATASHEET row for a torch device name (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    for row in DATASHEET:
        if re.search(_DATASHEET_NAMES[row["gpu"]], gpu_name, flags=re.IGNORECASE):
            return row
    return None


def datasheet_table() -> str:
    """DATASHEET as a text table (dense TFLOP/s; "-" where the GPU lacks the format)."""
    rows = [{k: ("-" if r[k] is None else r[k]) for k in ("gpu", "bandwidth_gbps", *DTYPES)} for r in DATASHEET]
    return bench.table(rows, {"gpu": "", "bandwidth_gbps": "", "fp32": "", "tf32": "", "fp16": "", "bf16": ""})


# ---- the ceilings of this GPU ---------------------------------------------------------------------


@dataclass
class Ceilings:
    gpu: str
    bandwidth_gbps: float              # HBM (DRAM) bandwidth, GB/s
    peak_tflops: dict[str, float]      # "fp32" (TF32 off), "tf32", "fp16", "bf16": what this GPU has
    source: str                        # "measured now on ...", or "recorded on ..., <date>"
    details: list[dict] = field(default_factory=list, repr=False)  # one row per ceiling: how it was measured

    def peak(self, dtype: str = "fp16") -> float:
        if dtype not in self.peak_tflops:
            have = ", ".join(self.peak_tflops)
            raise KeyError(f"no {dtype} ceiling for {self.gpu} (it has: {have})")
        return self.peak_tflops[dtype]

    def ridge(self, dtype: str = "fp16") -> float:
        return ridge(self.peak(dtype), self.bandwidth_gbps)

    def attainable(self, intensity, dtype: str = "fp16"):
        return attainable(intensity, self.peak(dtype), self.bandwidth_gbps)

    def lower_bound_ms(self, flops: float, nbytes: float, dtype: str = "fp16") -> float:
        return lower_bound_ms(flops, nbytes, self.peak(dtype), self.bandwidth_gbps)

    def rows(self) -> list[dict]:
        if self.details:
            return self.details
        rows = [{"ceiling": "bandwidth", "value": self.bandwidth_gbps, "unit": "GB/s", "how": ""}]
        return rows + [{"ceiling": k, "value": v, "unit": "TFLOP/s", "how": ""} for k, v in self.peak_tflops.items()]

    @classmethod
    def from_rows(cls, gpu: str, rows: list[dict], source: str) -> "Ceilings":
        by = {r["ceiling"]: r["value"] for r in rows}
        peaks = {k: float(by[k]) for k in DTYPES if k in by}
        return cls(gpu, float(by["bandwidth"]), peaks, source, list(rows))

    def __str__(self) -> str:
        lines = [f"Ceilings of {self.gpu} ({self.source})",
                 f"  HBM bandwidth  {self.bandwidth_gbps:8.0f} GB/s"]
        for k, v in self.peak_tflops.items():
            lines.append(f"  {k:<5} peak     {v:8.1f} TFLOP/s   ridge {ridge(v, self.bandwidth_gbps):6.1f} FLOP/B")
        return "\n".join(lines)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cache_path(gpu_name: str) -> Path:
    """Where the ceilings of ``gpu_name`` are cached: ``~/.cache/kernelcourse/ceilings-<slug>.json``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kernelcourse" / f"ceilings-{_slug(gpu_name)}.json"


def _shown(path: Path) -> str:
    """``path`` as a reader should see it: under the home directory, spelled from ``~``."""
    try:
        return str(Path("~") / path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def _probe_dtypes(capability) -> list[str]:
    # TF32 and BF16 tensor cores arrived with Ampere (compute capability 8.0).
    return ["fp32", "fp16"] + (["tf32", "bf16"] if capability and tuple(capability) >= (8, 0) else [])


def measure(device: str = "cuda", dtypes=None, copy_bytes: int = 1 << 30, matmul_sizes=(4096, 8192),
            timer=None) -> list[dict]:
    """Run the probe; one row per ceiling. ``timer(fn) -> ms`` defaults to ``kc.bench.do_bench``.

    Bandwidth: ``dst.copy_(src)`` of ``copy_bytes``, far larger than any L2, counting the bytes read
    *and* written. Peak: the fastest of ``n x n x n`` matmuls (2 n^3 FLOPs) over ``matmul_sizes``, per
    dtype; fp32 with TF32 off, then on. The best of several sizes, because a GPU's clock under a long
    matmul depends on its power draw: a single size can sit a few percent under another's rate, and
    a ceiling must not be below an operation measured later.
    """
    import torch

    timer = timer or bench.do_bench
    dtypes = list(dtypes or _probe_dtypes(world().capability))
    rows = []

    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * src.element_size()
    rows.append({"ceiling": "bandwidth", "value": nbytes / (ms * 1e-3) / 1e9, "unit": "GB/s", "ms": ms,
                 "how": f"device-to-device copy of {copy_bytes / 2**20:.0f} MiB, bytes read + written"})
    del src, dst

    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    previous = torch.get_float32_matmul_precision()
    try:
        for name in [d for d in DTYPES if d in dtypes]:
            # "highest" keeps fp32 matmuls in true fp32; "high" lets them use TF32 tensor cores.
            torch.set_float32_matmul_precision("high" if name == "tf32" else "highest")
            best = None
            for n in matmul_sizes:
                a = torch.randn(n, n, device=device).to(torch_dtype[name])
                b = torch.randn(n, n, device=device).to(torch_dtype[name])
                c = torch.empty(n, n, device=device, dtype=torch_dtype[name])
                ms = timer(lambda: torch.mm(a, b, out=c))
                tflops = 2 * n**3 / (ms * 1e-3) / 1e12
                if best is None or tflops > best[0]:
                    best = (tflops, ms, n)
                del a, b, c
            tflops, ms, n = best
            sizes = " and ".join(f"{m}^3" for m in matmul_sizes)
            how = f"best of {sizes} matmuls in {name}" + (", TF32 off" if name == "fp32" else "") + f" ({n}^3)"
            rows.append({"ceiling": name, "value": tflops, "unit": "TFLOP/s", "ms": ms, "how": how})
    finally:
        torch.set_float32_matmul_precision(previous)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _fit_copy_bytes() -> int:
    """1 GiB for the copy, less on a GPU with little free memory (two buffers, plus headroom)."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    return int(min(1 << 30, free // 4)) // (1 << 20) * (1 << 20)


def ceilings(refresh: bool = False, *, quiet: bool = False) -> Ceilings:
    """This GPU's ceilings: bandwidth (GB/s) and peak TFLOP/s per dtype.

    On a GPU: the ceilings cached by an earlier probe on this GPU, or (first time, or ``refresh=True``)
    measured now by the probe, which takes about ten seconds and then saves them in
    ``~/.cache/kernelcourse/`` for later chapters. Measuring goes through
    ``kc.bench.measured_or_recorded("02_ceilings", ...)``, so a recording run of the chapter 02 lesson
    saves them as the course's recorded ceilings; a recording run of a later lesson NN saves the ceilings it
    drew as ``NN_ceilings`` (``_record_with_lesson``).

    On the CPU: recorded ceilings, of the GPU that recorded the results shown last (``bench.last_shown``):
    a lesson recorded on another GPU than lesson 02 draws its recorded points under that GPU's roof, not
    lesson 02's. Lesson 02's when there are none of that GPU.
    """
    w = world()
    if not w.gpu:
        try:
            res = bench.measured_or_recorded(_recorded_for_what_is_shown(), None)
        except FileNotFoundError:
            raise FileNotFoundError(
                "the ceilings probe needs a CUDA GPU, and no recorded ceilings are installed "
                f"({bench.recorded_path(RECORDED)}); run `python tools/stamp.py --record "
                "notebooks/02_roofline.ipynb` on a GPU to record them") from None
        if not quiet:
            print(f"The ceilings probe needs a CUDA GPU: these are the ceilings {res.label}.")
        return Ceilings.from_rows(res.provenance["gpu"], res.rows, res.label)

    path = cache_path(w.name)
    if path.exists() and not refresh:
        cached = json.loads(path.read_text())
        c = Ceilings.from_rows(w.name, cached["rows"], f"measured on {w.name}, {cached['date']} (cached)")
        if not quiet:
            print(f"Ceilings of {w.name} measured on {cached['date']}, cached in {_shown(path)} "
                  "(kc.roofline.ceilings(refresh=True) measures again).")
        _record_with_lesson(cached["rows"])
        return c

    if not quiet:
        print(f"Measuring the ceilings of {w.name}: a large copy and large matmuls (about ten seconds)...")
    copy_bytes = _fit_copy_bytes()
    res = bench.measured_or_recorded(RECORDED, lambda: measure("cuda", copy_bytes=copy_bytes))
    path.parent.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    path.write_text(json.dumps({"gpu": w.name, "date": date, "versions": w.versions, "rows": res.rows}, indent=1))
    _record_with_lesson(res.rows)
    return Ceilings.from_rows(w.name, res.rows, f"measured now on {w.name}")


def _record_with_lesson(rows: list[dict]) -> None:
    """In ``tools/stamp.py``'s recording run of lesson NN (not 02, which records ``02_ceilings`` itself), save
    the ceilings the lesson drew as ``NN_ceilings``, beside its other recorded results."""
    chapter = os.environ.get("KC_RECORD_CHAPTER")
    name = LESSON_RECORDED.format(chapter=chapter)
    if chapter and chapter != RECORDED[:2] and bench.records(name):
        bench.save(bench.Results(name, rows, bench.provenance(), recorded=False))


def _recorded_for_what_is_shown() -> str:
    """On the CPU, which recorded ceilings to draw: those recorded with the lesson whose recorded results were
    shown last, where they came from the same GPU; else lesson 02's."""
    last = bench.last_shown()
    if last is None or not re.fullmatch(r"\d\d_.*", last.name):
        return RECORDED
    own = LESSON_RECORDED.format(chapter=last.name[:2])
    if own != RECORDED and bench.recorded_path(own).exists() and \
            bench.load(own).provenance.get("gpu") == last.provenance.get("gpu"):
        return own
    return RECORDED


_this_gpu = ceilings  # plot() takes a parameter named `ceilings`


# ---- the plot --------------------------------------------------------------------------------------


@dataclass
class Point:
    """One op on the roofline: its FLOPs, the bytes it must move, and its measured time."""
    name: str
    flops: float
    nbytes: float
    ms: float
    dtype: str = "fp16"

    @property
    def intensity(self) -> float:
        return intensity(self.flops, self.nbytes)

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s."""
        return self.flops / (self.ms * 1e-3) / 1e12


def plot(points, ceilings: Ceilings | None = None, dtype: str = "fp16", ax=None, title: str | None = None,
         labels: str = "inline"):
    """Draw the roofline of ``ceilings`` for ``dtype`` on log-log axes and place ``points`` on it.

    x: arithmetic intensity (FLOPs/byte), y: TFLOP/s. The memory slope (intensity x bandwidth) and the
    compute ceiling are drawn in, the ridge is marked, each point sits at (intensity, achieved TFLOP/s).
    A point above its roof is circled in red: the op cannot be that fast, so the timing is wrong.
    ``labels="inline"`` names each point beside it; ``"legend"`` names them in the legend, for plots
    whose points crowd together. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    c = ceilings if ceilings is not None else _this_gpu(quiet=True)
    points = list(points)
    peak, bw = c.peak(dtype), c.bandwidth_gbps
    knee = ridge(peak, bw)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 5))

    xs = [p.intensity for p in points]
    lo = min([knee / 1e3, *(x / 4 for x in xs)])
    hi = max([knee * 30, *(x * 4 for x in xs)])
    grid = np.geomspace(lo, hi, 400)
    ax.plot(grid, attainable(grid, peak, bw), color="black", lw=2.2,
            label=f"roof: {bw:,.0f} GB/s and {peak:,.1f} TFLOP/s ({dtype})")
    # the two limits extended past the ridge, faintly: min() of them is the roof
    ax.plot(grid, grid * bw / 1e3, color="gray", lw=0.8, ls=":")
    ax.axhline(peak, color="gray", lw=0.8, ls=":")
    ax.axvline(knee, color="tab:red", lw=1, ls="--")
    # the ridge's label sits low on the left of its line, below the slope, where no point can be
    ax.annotate(f"ridge {knee:,.0f} FLOP/B", (knee, 0), xycoords=("data", "axes fraction"), xytext=(-3, 6),
                textcoords="offset points", color="tab:red", fontsize=9, rotation=90, va="bottom", ha="right",
                annotation_clip=True)

    others = sorted({p.dtype for p in points} - {dtype})
    for other in others:
        if other in c.peak_tflops:
            ax.axhline(c.peak_tflops[other], color="tab:gray", lw=1, ls="-.",
                       label=f"{other} compute ceiling {c.peak_tflops[other]:,.1f} TFLOP/s")

    ys = [p.tflops for p in points]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    flagged = False
    # labels alternate above and below their points, in order of intensity, so neighbours do not collide
    above = {i: k % 2 == 0 for k, i in enumerate(sorted(range(len(points)), key=lambda i: xs[i]))}
    for i, (p, x, y) in enumerate(zip(points, xs, ys)):
        col = colors[i % len(colors)]
        ax.scatter([x], [y], s=40, color=col, zorder=3, label=p.name if labels == "legend" else None)
        roof = attainable(x, c.peak_tflops.get(p.dtype, peak), bw)
        if y > 1.10 * roof:  # measured ceilings are not exact limits: flag only clear violations
            ax.scatter([x], [y], s=180, facecolors="none", edgecolors="tab:red", lw=1.5, zorder=4,
                       label=None if flagged else "above the roof: a timing error")
            flagged = True
        if labels == "inline":
            ax.annotate(p.name, (x, y), xytext=(5, 5) if above[i] else (5, -6), textcoords="offset points",
                        fontsize=8, color=col, va="bottom" if above[i] else "top")

    ax.set_xscale("log")
    ax.set_yscale("log")
    ymin = min([peak / 1e4, *(y / 3 for y in ys)])
    ymax = max([peak * 3, *(y * 3 for y in ys)])
    ax.set_xlim(lo, hi)
    ax.set_ylim(ymin, ymax)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte of memory traffic)")
    ax.set_ylabel("TFLOP/s (achieved, or attainable on the roof)")
    ax.set_title(title or f"Roofline of {c.gpu} ({dtype})\n{c.source}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)  # above the slope: only impossible points live there
    return ax
