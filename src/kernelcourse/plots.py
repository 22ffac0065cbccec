"""Plots shared by the lessons (introduced in chapter 01): one message per figure, labelled axes
with units, log scales where sizes span decades, and the source of the numbers in the title."""
from __future__ import annotations

import matplotlib.pyplot as plt


def by_size(rows: list[dict], *, x: str, y: str, series: str, xlabel: str, ylabel: str, title: str,
            logx: int | None = 2, logy: bool = False, ceiling: tuple[float, str] | None = None, ax=None):
    """One line per value of ``rows[series]``: ``y`` against ``x``, optionally with a ceiling line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2))
    for name in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[series] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, label=name)
    if ceiling is not None:
        ax.axhline(ceiling[0], color="0.3", ls="--", lw=1)
        ax.annotate(ceiling[1], (0.01, ceiling[0]), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=8, color="0.3")
    if logx:
        ax.set_xscale("log", base=logx)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
