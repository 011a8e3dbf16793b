"""Pictures of the limits of scaling: the roofline; where data parallelism's all-reduce starts to hide under
its computation, measured here beside the model of a GPU cluster; and how that changes with the number of
GPUs at a fixed global batch. The notebook computes every number; this module only draws them."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .collectives import RANK_COLORS

ROOF_COLORS = ["#C44E52", "#DD8452", "#8172B3", "#937860"]
COMPUTE_COLOR, COMM_COLOR = RANK_COLORS[0], RANK_COLORS[2]


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 10 else f"{x:.2g}"


def _log_grid(lo: float, hi: float, n: int = 200) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def roofline(panels: Sequence[Mapping], *, title: str = "") -> Figure:
    """One log-log roofline per panel: attainable FLOP/s against arithmetic intensity (FLOPs per byte).

    A panel is a dict with `title`; `peak_flops`; `bandwidths`, {name: bytes/s}, each drawn as its roof
    min(peak, intensity x bandwidth) with its ridge point (peak / bandwidth) marked; and `points`, a list of
    (label, intensity, flop_s), computed or measured, drawn on top."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.8 * len(panels), 4.3), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        peak, points = panel["peak_flops"], panel.get("points", ())
        ridges = [peak / bw for bw in panel["bandwidths"].values()]
        xs = [p[1] for p in points] + ridges
        grid = _log_grid(min(xs) / 4, max(xs) * 4)
        for i, (name, bw) in enumerate(panel["bandwidths"].items()):
            color = ROOF_COLORS[i % len(ROOF_COLORS)]
            ax.plot(grid, [min(peak, x * bw) for x in grid], color=color, linewidth=1.5,
                    label=f"{name}: ridge at {_num(peak / bw)} FLOPs/byte")
            ax.plot([peak / bw], [peak], "o", color=color)
        for label, intensity, flop_s in points:
            ax.plot([intensity], [flop_s], "s", color=COMPUTE_COLOR, markersize=5)
            ax.annotate(label, (intensity, flop_s), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
        ax.set_ylabel("attainable FLOP/s")
        ax.set_title(panel["title"], fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def dp_crossover(measured: Mapping, model: Mapping | None = None, *, title: str = "") -> Figure:
    """Data parallelism's step against the batch per rank, log-log: the computation grows with the batch, the
    all-reduce of the gradients does not, and the step stops being dominated by communication where they cross.

    `measured`: `batches`; `compute_s` and `comm_s`, the repeated timings at each batch (drawn as their median,
    with a bar from the lowest to the highest); `crossover`, the batch found from them; `predicted` (optional),
    the formula's; `title`. `model` (optional, a second panel, computed rather than measured): `batches`,
    `compute_s`, `comm_s` (one value each), `crossover`, `title`."""
    panels = [measured] + ([model] if model is not None else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.3), squeeze=False)
    ax = axes[0][0]
    batches = list(measured["batches"])
    for key, color, name in [("compute_s", COMPUTE_COLOR, "forward + backward"), ("comm_s", COMM_COLOR, "all-reduce")]:
        samples = [sorted(s) for s in measured[key]]
        mid = [statistics.median(s) * 1e3 for s in samples]
        low = [m - s[0] * 1e3 for m, s in zip(mid, samples, strict=True)]
        high = [s[-1] * 1e3 - m for m, s in zip(mid, samples, strict=True)]
        ax.errorbar(batches, mid, yerr=[low, high], fmt="o", color=color, capsize=3, markersize=4,
                    label=f"{name} (median, lowest to highest)")
    _mark_crossovers(ax, min(batches) / 1.5, measured["crossover"], measured.get("predicted"))
    ax.set_title(measured["title"], fontsize=10)
    ax.set_xlabel("batch per rank (rows)")
    if model is not None:
        ax = axes[0][1]
        ax.plot(model["batches"], [t * 1e3 for t in model["compute_s"]], color=COMPUTE_COLOR, label="backward")
        ax.plot(model["batches"], [t * 1e3 for t in model["comm_s"]], color=COMM_COLOR, label="all-reduce")
        _mark_crossovers(ax, min(model["batches"]) / 1.5, model["crossover"], None)
        ax.set_title(model["title"], fontsize=10)
        ax.set_xlabel("batch per GPU (tokens)")
    for ax in axes[0]:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylabel("time per step (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _mark_crossovers(ax, left: float, measured: float, predicted: float | None) -> None:
    """Shade the communication-bound side of the crossover (from `left`); mark the prediction beside it."""
    ax.axvspan(left, measured, color="#EEEEEE", zorder=0, label="communication dominates")
    ax.axvline(measured, color="black", linewidth=1.2, label=f"crossover: {_num(measured)}")
    if predicted is not None:
        ax.axvline(predicted, color=ROOF_COLORS[0], linestyle=":", linewidth=1.5,
                   label=f"predicted: {_num(predicted)}")


def dp_ratio_vs_gpus(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, mark_gpus: float | None = None,
                     end_label: str | None = None, title: str = "") -> Figure:
    """How well data parallelism's all-reduce hides at a fixed global batch, against the number of GPUs: per
    layout, (GPUs, computation time over all-reduce time), log-log, with the line where they are equal (below
    it, communication is exposed). Each series' last point is marked with an x, which `end_label` explains
    (e.g. "one sequence per replica")."""
    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    for i, (name, (gpus, ratios)) in enumerate(series.items()):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        ax.plot(gpus, ratios, "-", color=color, label=name)
        ax.plot([gpus[-1]], [ratios[-1]], "x", color=color, markersize=8)
    if end_label:
        ax.plot([], [], "x", color="black", label=end_label)
    ax.axhline(1.0, color="black", linewidth=1, label="computation = all-reduce")
    if mark_gpus is not None:
        ax.axvline(mark_gpus, color="#888888", linestyle=":", label=f"{mark_gpus:,.0f} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("computation / all-reduce time (data parallelism)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
