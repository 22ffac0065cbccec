"""Draw the website's landing figure from the course's recorded GPU results.

    python tools/landing_figure.py   # writes book/images/roofline.png (run by `make book` and `make test`)

The course's kernels and the PyTorch operations they are compared with, on the fp16 roofline of the
GPU the results were recorded on. Every point is a recorded measurement; nothing is typed in.
"""
from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from notebooks import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
from kernelcourse import bench, roofline  # noqa: E402

OUT = ROOT / "book" / "images" / "roofline.png"
OPS = ("GELU", "softmax", "LayerNorm", "matmul 256", "matmul 1024", "matmul 8192", "QKᵀ scores")


def points() -> tuple[list[roofline.Point], str]:
    ops = bench.load("02_ops")
    pts = [roofline.Point(r["op"], r["flops"], r["nbytes"], r["ms"], r["dtype"])
           for r in ops.rows if r["op"] in OPS]
    add = bench.load("01_vector_add")
    n = max(add.column("n"))
    v2 = add.select(impl="CUDA C++ v2 (float4)", n=n)[0]
    pts.append(roofline.Point("vector add, CUDA C++ (01)", n, 12 * n, v2["ms"], "fp32"))
    fusion = bench.load("03_fusion_io")
    largest = max(r["n"] for r in fusion.rows)
    for r in fusion.rows:
        if r["n"] == largest and r["chain"] == "bias + GELU" and r["variant"] in ("eager", "Triton"):
            label = "bias+GELU " + ("fused, Triton (03)" if r["variant"] == "Triton" else "eager (03)")
            pts.append(roofline.Point(label, r["flops"], r["bytes"], r["ms"], "bf16"))
    return pts, ops.label


def main() -> int:
    ceilings = roofline.Ceilings.from_rows(*_recorded_ceilings())
    pts, label = points()
    # The width of the website's text column, and the legend inside the axes (above the memory slope,
    # where no measured point can be), so the figure shrinks as one piece and stays legible on a phone.
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    roofline.plot(pts, ceilings, dtype="fp16", ax=ax, labels="legend",
                  title=f"The course's kernels and PyTorch's on the fp16 roofline\n{label}")
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top * 60)  # headroom above the roof for the legend
    ax.legend(loc="upper left", fontsize=7.5, framealpha=0.92, borderaxespad=0.4)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130, bbox_inches="tight", metadata={"Software": None})
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


def _recorded_ceilings():
    rec = bench.load(roofline.RECORDED)
    return rec.provenance["gpu"], rec.rows, rec.label


if __name__ == "__main__":
    sys.exit(main())
