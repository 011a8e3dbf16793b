"""Pipeline schedules drawn: Gantt charts of timelines (simulated or measured), bubbles against the
number of micro-batches, and activation memory per stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..schedules import Timeline

MICROBATCH_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
                     "#CCB974", "#64B5CD"]
IDLE_COLOR = "#EEEEEE"


def _tint(color: str, amount: float) -> tuple:
    """`color` mixed with white (amount 1: white)."""
    return tuple(c + (1 - c) * amount for c in to_rgb(color))


def _style(kind: str, microbatch: int) -> dict:
    """Colour by micro-batch; F light, B and BW solid, W hatched."""
    base = MICROBATCH_COLORS[microbatch % len(MICROBATCH_COLORS)]
    if kind == "F":
        return {"facecolor": _tint(base, 0.55), "edgecolor": "white"}
    if kind == "W":
        return {"facecolor": _tint(base, 0.25), "edgecolor": "white", "hatch": "////"}
    return {"facecolor": base, "edgecolor": "white"}


def draw_gantt(ax: Axes, timeline: Timeline, *, title: str = "", time_unit: str = "time units",
               labels: bool = True) -> None:
    """Draw `timeline` on `ax`: one row per stage (stage 0 on top), idle time grey; with v chunks per
    stage, each row has v lanes, chunk 0 on top."""
    total = timeline.total_time or 1
    v = 1 + max((i.action.chunk for busy in timeline.busy for i in busy), default=0)
    lane = 0.8 / v
    width_pt = ax.get_figure().get_figwidth() * 72 * 0.8  # roughly the axes' width in points
    fontsize = 7 if v == 1 else 6
    for s, (busy, idle) in enumerate(zip(timeline.busy, timeline.idle, strict=True)):
        top = -s + 0.4
        for gap in idle:
            ax.add_patch(Rectangle((gap.start, top - 0.8), gap.end - gap.start, 0.8, facecolor=IDLE_COLOR,
                                   edgecolor="none"))
        for interval in busy:
            a = interval.action
            y = top - (a.chunk + 1) * lane
            ax.add_patch(Rectangle((interval.start, y), interval.end - interval.start, lane,
                                   linewidth=0.5, **_style(a.kind, a.microbatch)))
            text = f"{a.kind}{a.microbatch}"
            box_pt = (interval.end - interval.start) / total * width_pt
            if labels and box_pt > 0.75 * fontsize * len(text) + 3:
                ax.text((interval.start + interval.end) / 2, y + lane / 2, text, ha="center", va="center",
                        fontsize=fontsize, color="white" if a.kind == "BW" else "#222222")
    p = timeline.num_stages
    ax.set_xlim(0, total)
    ax.set_ylim(-p + 0.5, 0.5)
    if getattr(timeline, "layout", "interleaved") == "bidirectional":  # lanes: down (chunk 0), up (chunk 1)
        rows = [f"stage {s}\n\u2193{s} \u2191{p - 1 - s}" for s in range(p)]
    else:
        rows = [f"stage {s}" + (f"\nchunks 0-{v - 1}" if v > 1 else "") for s in range(p)]
    ax.set_yticks([-s for s in range(p)], rows)
    ax.set_xlabel(f"time ({time_unit})")
    peaks = "" if timeline.peak_in_flight[0] is None else \
        ", peak in flight " + " ".join(f"{x:g}" for x in timeline.peak_in_flight)
    ax.set_title(f"{title}{': ' if title else ''}bubble {timeline.bubble_fraction:.1%}{peaks}", fontsize=10)


def _legend_handles() -> list:
    base = MICROBATCH_COLORS[0]
    return [Patch(**_style("F", 0), label="F forward"),
            Patch(facecolor=base, label="BW / B backward"),
            Patch(**_style("W", 0), label="W weight gradient"),
            Patch(facecolor=IDLE_COLOR, label="idle (bubble)")]


def gantt(timeline: Timeline, *, title: str = "", time_unit: str = "time units", labels: bool = True) -> Figure:
    """A Gantt chart of one timeline: one row per stage, coloured by micro-batch, F/B/W told apart."""
    fig, ax = plt.subplots(figsize=(11, 0.45 * timeline.num_stages + 1.3))
    draw_gantt(ax, timeline, title=title, time_unit=time_unit, labels=labels)
    ax.legend(handles=_legend_handles(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def gantt_stack(timelines: Sequence[tuple[str, Timeline]], *, time_unit: str = "time units",
                same_scale: bool = True, labels: bool = True) -> Figure:
    """Several timelines one above the other (e.g. GPipe against 1F1B, or measured against simulated),
    on the same time axis when `same_scale`."""
    rows = [t.num_stages for _, t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 0.45 * sum(rows) + 1.5 * len(timelines)),
                             gridspec_kw={"height_ratios": rows}, squeeze=False)
    longest = max(t.total_time for _, t in timelines)
    for ax, (title, timeline) in zip(axes[:, 0], timelines, strict=True):
        draw_gantt(ax, timeline, title=title, time_unit=time_unit, labels=labels)
        if same_scale:
            ax.set_xlim(0, longest)
    axes[0, 0].legend(handles=_legend_handles(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
                      frameon=False)
    fig.tight_layout()
    return fig


def bubble_vs_microbatches(num_microbatches: Sequence[int], simulated: dict[str, Sequence[float]],
                           formulas: dict[str, Callable[[int], float]] | None = None, *,
                           num_stages: int | None = None) -> Figure:
    """Bubble fraction against m: dots from the simulator, lines from closed forms."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, values) in enumerate(simulated.items()):
        ax.plot(num_microbatches, values, "o", color=MICROBATCH_COLORS[i], label=f"{name} (simulated)")
    for i, (name, formula) in enumerate((formulas or {}).items()):
        ms = range(min(num_microbatches), max(num_microbatches) + 1)
        ax.plot(ms, [formula(m) for m in ms], "-", color=MICROBATCH_COLORS[i], alpha=0.6, label=name)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction (idle / total)")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Pipeline bubble" + (f", p = {num_stages} stages" if num_stages else ""))
    fig.tight_layout()
    return fig


def activations_per_stage(peaks: dict[str, Sequence[float]], *, title: str = "") -> Figure:
    """Peak in-flight micro-batches (activation memory) per stage, one group of bars per schedule."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    n = len(peaks)
    for i, (name, values) in enumerate(peaks.items()):
        xs = [s + (i - (n - 1) / 2) * 0.8 / n for s in range(len(values))]
        ax.bar(xs, values, width=0.8 / n, color=MICROBATCH_COLORS[i], label=name)
    p = max(len(v) for v in peaks.values())
    ax.set_xticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_ylabel("peak activations\n(micro-batches in flight)")
    ax.legend(fontsize=8)
    ax.set_title(title or "Activation memory per stage")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
