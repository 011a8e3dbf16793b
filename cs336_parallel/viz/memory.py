"""Pictures of training memory and of FSDP: per-rank memory of DDP and the ZeRO stages (computed and
measured), the life of one FSDP unit's parameters through a step, and a measured timeline of FSDP's gathers
against its compute."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .collectives import RANK_COLORS
from .data_parallel import OTHER_COLOR, draw_compute_lane, label_rank_lanes

STAGE_COLORS = ["#8C8C8C", RANK_COLORS[0], RANK_COLORS[2], RANK_COLORS[1]]  # DDP, ZeRO-1, ZeRO-2, ZeRO-3
SPAN_COLORS = {"forward": RANK_COLORS[0], "backward": RANK_COLORS[1], "all_gather": RANK_COLORS[2],
               "reduce_scatter": RANK_COLORS[3], "all_reduce": RANK_COLORS[4], "broadcast": RANK_COLORS[5],
               "reduce": RANK_COLORS[6]}
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def zero_memory_bars(world_sizes: Sequence[int], computed: Mapping[str, Sequence[float]], *,
                     measured: Mapping[str, Sequence[float]] | None = None,
                     peaks: Mapping[str, Sequence[float]] | None = None, unit: str = "GB",
                     limit_bytes: float | None = None, limit_label: str = "", title: str = "") -> Figure:
    """Bytes per rank of each method (DDP, ZeRO-1, ...) at each world size, grouped by world size.

    `computed[method][i]` is the formula's value at `world_sizes[i]`: a light bar. With `measured`, a
    dark bar beside it (what the ranks held after a step) and, with `peaks`, a tick at the most they held
    during the step. `limit_bytes` draws a horizontal line, e.g. a GPU's memory."""
    scale = UNITS[unit]
    methods = list(computed)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(world_sizes) + 3) + (2.5 if measured else 0), 4.2))
    group = 0.8 / len(methods)
    for m, method in enumerate(methods):
        color = STAGE_COLORS[m % len(STAGE_COLORS)]
        xs = [i - 0.4 + group * (m + 0.5) for i in range(len(world_sizes))]
        width = group * (0.48 if measured else 0.9)
        left = [x - width / 2 if measured else x for x in xs]
        ax.bar(left, [v / scale for v in computed[method]], width=width, color=color, alpha=0.45 if measured else 1,
               label=method if not measured else None)
        if measured:
            right = [x + width / 2 for x in xs]
            ax.bar(right, [v / scale for v in measured[method]], width=width, color=color, label=method)
            if peaks:
                ax.scatter(right, [v / scale for v in peaks[method]], marker="_", s=220, color="black", zorder=3)
    if limit_bytes:
        ax.axhline(limit_bytes / scale, color="#C44E52", linestyle="--", linewidth=1)
        ax.text(len(world_sizes) - 0.45, limit_bytes / scale, f" {limit_label}", color="#C44E52", va="bottom",
                ha="right", fontsize=8)
    ax.set_xticks(range(len(world_sizes)), [f"N = {n}" for n in world_sizes])
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel(f"memory per rank ({unit})")
    handles, labels = ax.get_legend_handles_labels()
    if measured:
        handles += [Patch(color="#8C8C8C", alpha=0.45), Patch(color="#8C8C8C")]
        labels += ["computed (light)", "measured after the step (dark)"]
        if peaks:
            handles.append(Line2D([], [], color="black", marker="_", linestyle="", markersize=12))
            labels.append("measured peak during the step")
    if measured:  # beside the axes: the bars fill them
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend(handles, labels, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


# What one rank runs around one FSDP unit in a training step (no prefetch): (label, kind, length, what of the unit
# it holds, in the unit's parameter bytes: a function of the world size n).
_UNIT_LIFE = [
    ("forward of the\nunits before", "forward", 2, lambda n: 1 / n, "its shard"),
    ("all-gather", "all_gather", 1, lambda n: 1 + 1 / n, "+ the whole\nparameters"),
    ("forward of\nthis unit", "forward", 2, lambda n: 1 + 1 / n, ""),
    ("forward of the units after,\nthen their backward", "other", 4, lambda n: 1 / n, "freed: the shard only"),
    ("all-gather\nagain", "all_gather", 1, lambda n: 1 + 1 / n, "+ whole again"),
    ("backward of\nthis unit", "backward", 2, lambda n: 2 + 1 / n, "+ its whole\ngradient"),
    ("reduce-scatter\nits gradient", "reduce_scatter", 1.4, lambda n: 1 + 2 / n, "whole parameters freed"),
    ("backward of the\nunits before", "backward", 2, lambda n: 2 / n, "shards of the parameters\nand of the gradient"),
]


def fsdp_unit_life(world_size: int = 4) -> Figure:
    """One FSDP unit's parameters on one rank through a training step: above, what the rank runs (the unit's
    all-gather before its forward, again before its backward, the reduce-scatter of its gradient); below, the bytes
    of this unit the rank holds, in units of the unit's parameter bytes: its 1/N shard, the whole parameters while
    they are needed, then the shards of the parameters and of the gradient."""
    n = world_size
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 4.6), sharex=True, gridspec_kw={"height_ratios": [1, 2.2]})
    edges, held = [0.0], []
    for label, kind, length, holds, note in _UNIT_LIFE:
        x = edges[-1]
        top.barh(0, length, left=x, color=SPAN_COLORS.get(kind, OTHER_COLOR), edgecolor="white")
        top.text(x + length / 2, 0, label, ha="center", va="center", fontsize=7.5,
                 color="white" if kind != "other" else "black")
        held.append(holds(n))
        if note:
            bottom.text(x + 0.08, holds(n) + 0.06, note, fontsize=7.5, va="bottom")
        edges.append(x + length)
    top.set_yticks([])
    top.set_title(f"One FSDP unit through a training step, on one of N = {n} ranks", loc="left", fontsize=10)
    bottom.stairs(held, edges, fill=True, color=SPAN_COLORS["all_gather"], alpha=0.35)
    bottom.stairs(held, edges, color=SPAN_COLORS["all_gather"], linewidth=1.5)
    bottom.set_ylim(0, 3)
    bottom.set_xlim(0, edges[-1])
    bottom.set_ylabel("this unit's bytes held\n(x its parameter bytes)", fontsize=8)
    bottom.set_xlabel("time (schematic)")
    bottom.set_xticks([])
    bottom.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _rows(spans: Sequence[dict]) -> list[int]:
    """A sub-row for each span so that spans in one sub-row do not overlap (greedy, in start order)."""
    ends: list[float] = []
    rows = []
    for s in spans:
        row = next((i for i, end in enumerate(ends) if end <= s["start_s"]), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = s["end_s"]
        rows.append(row)
    return rows


def fsdp_timeline(traces: Mapping[str, Sequence[Sequence[dict]]], *, title: str = "") -> Figure:
    """One measured step per variant: for each rank a compute lane (forward, backward: gaps are waits)
    and a communication lane (each collective from issue to completion; overlapping ones stacked).

    `traces[variant][rank]` is that rank's list of spans (`cs336_parallel.trace`): lane, name, start_s,
    end_s, in seconds."""
    variants = list(traces)
    n_ranks = max(len(t) for t in traces.values())
    fig, axes = plt.subplots(len(variants), 1, figsize=(11, 0.9 + 1.3 * n_ranks * len(variants)), sharex=True,
                             squeeze=False)
    for ax, variant in zip(axes[:, 0], variants, strict=True):
        end_ms = 0.0
        for rank, spans in enumerate(traces[variant]):
            base = -2 * rank
            draw_compute_lane(ax, base, spans, SPAN_COLORS, linewidth=0)
            comm = sorted((s for s in spans if s["lane"] == "comm"), key=lambda s: s["start_s"])
            rows = _rows(comm)
            height = 0.8 / max(1, max(rows, default=0) + 1)
            for s, row in zip(comm, rows, strict=True):
                ax.barh(base - 1.4 + (row + 0.5) * height, (s["end_s"] - s["start_s"]) * 1e3,
                        left=s["start_s"] * 1e3, height=height * 0.9, color=SPAN_COLORS.get(s["name"], OTHER_COLOR),
                        edgecolor="black", linewidth=0.3)
            end_ms = max([end_ms] + [s["end_s"] * 1e3 for s in spans])
        label_rank_lanes(ax, n_ranks, margin=0.4)
        ax.set_title(f"{variant}: forward + backward in {end_ms:.0f} ms", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time since the step began (ms)")
    used = {s["name"] for t in traces.values() for spans in t for s in spans}
    handles = [Patch(color=c, label=k.replace("_", "-")) for k, c in SPAN_COLORS.items() if k in used]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


def speedup_beside_published(measured: Mapping[str, float], published: Mapping[str, tuple[float, float]], *,
                             xlabel: str = "speed-up (%)", title: str = "") -> Figure:
    """Measured speed-ups as bars, beside published ones drawn as the range they span (hatched).

    `measured`: {label: percent}; `published`: {label: (low percent, high percent)}."""
    rows = [*measured, *published]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    for i, pct in enumerate(measured.values()):
        ax.barh(i, pct, color=RANK_COLORS[0])
        ax.text(pct, i, f" {pct:.0f}%", va="center", fontsize=8)
    for i, (low, high) in enumerate(published.values(), start=len(measured)):
        ax.barh(i, high - low, left=low, color="white", edgecolor=RANK_COLORS[1], hatch="//")
        ax.text(high, i, f" {low:g}-{high:g}%", va="center", fontsize=8)
    ax.axvline(0, color="#555555", linewidth=0.8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
