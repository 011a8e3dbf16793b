"""Pictures of data-parallel training: measured step timelines per rank, step times, a bucket-size sweep.

The spans come from `cs336_parallel.trace` on the ranks; this module only draws them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .collectives import RANK_COLORS

STAGE_COLORS = {"forward": RANK_COLORS[0], "backward": RANK_COLORS[1], "wait": "#DDDDDD"}
COMM_SHADES = [RANK_COLORS[2], "#8FCB9B"]  # neighbouring collectives alternate
OTHER_COLOR = "#8C8C8C"


def _busy(spans: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of each collective while it had the group to itself: from its launch, or from the end of
    the one before it if that was later, to its completion. Collectives of a process group run one after
    another (NCCL queues them on one stream), so a launch does not mean data moves yet."""
    busy, free_at = [], float("-inf")
    for s in sorted(spans, key=lambda s: s["start_s"]):
        start = max(s["start_s"], free_at)
        if s["end_s"] > start:
            busy.append((start, s["end_s"]))
        free_at = max(free_at, s["end_s"])
    return busy


def draw_compute_lane(ax, base: float, spans: Sequence[dict], colors: Mapping[str, str], **style) -> None:
    """A rank's compute spans as bars on lane `base` (ms), coloured by name; gaps between them are waits."""
    for s in spans:
        if s["lane"] == "compute":
            ax.barh(base, (s["end_s"] - s["start_s"]) * 1e3, left=s["start_s"] * 1e3, height=0.8,
                    color=colors.get(s["name"], OTHER_COLOR), **style)


def label_rank_lanes(ax, n_ranks: int, *, margin: float) -> None:
    """Name the two lanes of each rank: compute at -2 r, communication at -2 r - 1."""
    ticks = [t for r in range(n_ranks) for t in (-2 * r, -2 * r - 1)]
    labels = [label for r in range(n_ranks) for label in (f"rank {r} compute", f"rank {r} comm")]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(-2 * n_ranks + margin, 0.6)
    ax.grid(axis="x", alpha=0.3)


def ddp_timeline(timelines: Mapping[str, Sequence[Sequence[dict]]], *, title: str = "") -> Figure:
    """One measured training step per variant: for each rank a compute lane (forward, backward, waiting
    for communication) and a communication lane (a tick where each collective was launched; a bar while
    it ran, from its launch or the previous one's completion to its own completion).

    `timelines[variant][rank]` is that rank's list of spans (`trace.Trace.as_dicts()`): lane, name,
    start_s, end_s, nbytes."""
    names = list(timelines)
    n_ranks = max(len(t) for t in timelines.values())
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.1 + 1.1 * n_ranks * len(names)), sharex=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        step_ms = 0.0
        for rank, spans in enumerate(timelines[name]):
            base = -2 * rank  # compute lane at base, communication lane below it
            draw_compute_lane(ax, base, spans, STAGE_COLORS, edgecolor="white", linewidth=0.5)
            comm = [s for s in spans if s["lane"] == "comm"]
            for i, (start, end) in enumerate(_busy(comm)):
                ax.barh(base - 1, (end - start) * 1e3, left=start * 1e3, height=0.6, edgecolor="white",
                        linewidth=0.5, color=COMM_SHADES[i % 2])
            ax.vlines([s["start_s"] * 1e3 for s in comm], base - 0.7, base - 0.4, color="black", linewidth=0.8)
            step_ms = max([step_ms] + [s["end_s"] * 1e3 for s in spans])
        label_rank_lanes(ax, n_ranks, margin=0.5)
        n_all_reduces = sum(s["name"] == "all_reduce" for s in timelines[name][0])
        ax.set_title(f"{name}: step {step_ms:.0f} ms, {n_all_reduces} all-reduces per rank", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time since the step began (ms)")
    handles = [Patch(color=STAGE_COLORS[k], label=k) for k in ("forward", "backward")]
    handles += [Patch(color=STAGE_COLORS["wait"], label="waiting for communication"),
                Patch(color=COMM_SHADES[0], label="all-reduce running"),
                Line2D([], [], color="black", marker="|", linestyle="", markersize=8, label="all-reduce launched")]
    height = fig.get_figheight()
    fig.suptitle(title, x=0.01, y=1 - 0.05 / height, ha="left", va="top", fontsize=11)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.005, 1 - 0.28 / height), ncol=len(handles),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))
    return fig


def ddp_step_times(rows: Sequence[dict], *, title: str = "") -> Figure:
    """Time per step of each variant, split into compute and exposed communication.

    `rows`: name, step_s (median time of a step), compute_s (the same step with no communication)."""
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.6))
    for i, r in enumerate(rows):
        compute_ms, step_ms = r["compute_s"] * 1e3, r["step_s"] * 1e3
        exposed = max(0.0, step_ms - compute_ms)
        ax.barh(i, compute_ms, color=RANK_COLORS[0], label="compute (forward + backward)" if i == 0 else None)
        ax.barh(i, exposed, left=compute_ms, color=RANK_COLORS[2], label="communication not hidden" if i == 0 else None)
        ax.text(step_ms, i, f" {step_ms:.1f} ms ({exposed / step_ms:.0%} comm)", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(right=max(r["step_s"] for r in rows) * 1e3 * 1.35)
    ax.set_xlabel("time per step (ms, median)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def bucket_sweep(rows: Sequence[dict], *, compute_s: float | None = None, title: str = "",
                 published: Mapping[str, Mapping[int, float]] | None = None, published_title: str = "") -> Figure:
    """Step time against bucket size, one line per implementation; with `published`, beside it a published
    GPU figure: a throughput change (%) per number of GPUs, one bar per model.

    `rows`: name, bucket_mb, step_s. `compute_s`, if given, draws the no-communication floor.
    `published`: {model: {gpus: throughput change in %}}."""
    fig, axes = plt.subplots(1, 2 if published else 1, figsize=(12 if published else 7, 4), squeeze=False)
    ax = axes[0, 0]
    for i, name in enumerate(dict.fromkeys(r["name"] for r in rows)):
        points = sorted((r["bucket_mb"], r["step_s"] * 1e3) for r in rows if r["name"] == name)
        ax.plot(*zip(*points, strict=True), marker="o", color=RANK_COLORS[i % len(RANK_COLORS)], label=name)
    if compute_s is not None:
        ax.axhline(compute_s * 1e3, color="#555555", linestyle="--", linewidth=1, label="compute only")
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MB, log scale)")
    ax.set_ylabel("time per step (ms, median)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    if published:
        _published_bars(axes[0, 1], published, published_title)
    fig.tight_layout()
    return fig


def _published_bars(ax, published: Mapping[str, Mapping[int, float]], title: str) -> None:
    """Grouped bars: for each number of GPUs, one bar per model (a throughput change in %)."""
    gpus = sorted({g for by_gpus in published.values() for g in by_gpus})
    width = 0.8 / len(published)
    for i, (model, by_gpus) in enumerate(published.items()):
        xs = [gpus.index(g) + (i - (len(published) - 1) / 2) * width for g in by_gpus]
        ax.bar(xs, list(by_gpus.values()), width=width, color=RANK_COLORS[i % len(RANK_COLORS)], label=model)
    ax.axhline(0, color="#555555", linewidth=0.8)
    ax.set_xticks(range(len(gpus)), [str(g) for g in gpus])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput change (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
