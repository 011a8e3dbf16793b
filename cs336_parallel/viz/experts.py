"""Pictures of mixture-of-experts routing: tokens moving between ranks in an all-to-all with uneven
splits, the drop rate against the capacity factor, per-expert load over training steps, and the CPU and GPU
of a step on one time axis (where the host waits)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from .collectives import RANK_COLORS


def _color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def dispatch_diagram(send_counts: Sequence[Sequence[int]], *, title: str | None = None) -> Figure:
    """Dispatch as one all-to-all: `send_counts[s][e]` token rows go from rank s to expert e, experts
    split evenly over the ranks (rank r owns experts r*E/n .. (r+1)*E/n - 1).

    Left: each rank's send buffer, sorted by expert, coloured by the rank that owns the expert.
    Right: each rank's receive buffer, by source rank then local expert, coloured by the source.
    Arrows carry the split sizes; combine is the same picture with the arrows reversed."""
    n, num_experts = len(send_counts), len(send_counts[0])
    if num_experts % n:
        raise ValueError(f"the number of experts ({num_experts}) must be divisible by the ranks ({n})")
    per = num_experts // n
    owner = [e // per for e in range(num_experts)]
    sent = [[sum(send_counts[s][e] for e in range(num_experts) if owner[e] == r) for r in range(n)] for s in range(n)]
    width = max(max(sum(row) for row in send_counts), max(sum(sent[s][r] for s in range(n)) for r in range(n)), 1)
    scale, gap, height = 10.0 / width, 9.0, 0.55
    right_x = 10.0 + gap
    fig, ax = plt.subplots(figsize=(12, 0.9 * n + 1.3))
    right_mid = {}
    for s in range(n):
        x, y = 0.0, -s
        for e in range(num_experts):
            c = send_counts[s][e]
            if c:
                ax.add_patch(Rectangle((x, y), c * scale, height, facecolor=_color(owner[e]), edgecolor="white"))
                ax.text(x + c * scale / 2, y + height / 2, f"e{e}:{c}" if c * scale > 0.65 else "", ha="center",
                        va="center", fontsize=7, color="white")
            x += c * scale
        ax.text(-0.3, y + height / 2, f"rank {s}", ha="right", va="center", fontsize=9)
        ax.text(x + 0.15, y + height / 2, f"in {sent[s]}", ha="left", va="center", fontsize=7, color="#555555")
    for r in range(n):
        x, y = right_x, -r
        for s in range(n):
            start = x
            for e in range(r * per, (r + 1) * per):
                c = send_counts[s][e]
                if c:
                    ax.add_patch(Rectangle((x, y), c * scale, height, facecolor=_color(s), edgecolor="white"))
                    ax.text(x + c * scale / 2, y + height / 2, f"e{e}:{c}" if c * scale > 0.65 else "", ha="center",
                            va="center", fontsize=7, color="white")
                x += c * scale
            right_mid[s, r] = ((start + x) / 2, y)
        received = [sent[s][r] for s in range(n)]
        ax.text(right_x - 0.3, y + height / 2, f"rank {r}", ha="right", va="center", fontsize=9)
        ax.text(x + 0.15, y + height / 2, f"out {received}", ha="left", va="center", fontsize=7, color="#555555")
    for s in range(n):  # one arrow per pair of different ranks, as wide as the rows it carries
        for r in range(n):
            c = sent[s][r]
            if c and s != r:
                x1, y1 = right_mid[s, r]
                ax.add_patch(FancyArrowPatch((12.8, -s + height / 2), (right_x - 1.6, y1 + height / 2),
                                             arrowstyle="->", mutation_scale=10, color=_color(s), alpha=0.6,
                                             lw=0.5 + 3.0 * c / width))
    for r in range(n):
        ax.plot([], [], color=_color(r), lw=6, label=f"rank {r}")
    ax.text(5.0, 0.9, "send buffers, sorted by expert (colour: destination rank)", ha="center", fontsize=9)
    ax.text(right_x + 5.0, 0.9, "receive buffers, by source rank (colour: source rank)", ha="center", fontsize=9)
    ax.set_xlim(-1.8, right_x + 12.5)
    ax.set_ylim(-n + 0.2, 1.3)
    ax.axis("off")
    ax.legend(loc="lower center", ncol=n, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.02))
    ax.set_title(title or "Dispatch: one all_to_all_single; in/out = input/output_split_sizes (token rows per rank)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def drop_rate_plot(capacity_factors: Sequence[float], drop_rates: Mapping[str, Sequence[float]]) -> Figure:
    """Share of token assignments dropped against the capacity factor, one line per router imbalance."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, rates) in enumerate(drop_rates.items()):
        ax.plot(capacity_factors, [100 * r for r in rates], "o-", color=_color(i), label=label, ms=4)
    ax.axvline(1.0, color="#999999", ls=":", lw=1)
    ax.set_xlabel("capacity factor (capacity = factor x k x tokens / experts)")
    ax.set_ylabel("token assignments dropped (%)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="router imbalance (max / mean load)", title_fontsize=8)
    fig.tight_layout()
    return fig


def load_histograms(loads: Mapping[str, Sequence[Sequence[float]]], steps: Sequence[int]) -> Figure:
    """Per-expert share of routed tokens at a few training steps: one row per run (`loads[run][step][e]`,
    fractions summing to 1), one column per step in `steps`; the dashed line is a perfectly even load."""
    runs = list(loads)
    num_experts = len(next(iter(loads.values()))[0])
    fig, axes = plt.subplots(len(runs), len(steps), figsize=(2.6 * len(steps), 2.3 * len(runs)),
                             sharey=True, squeeze=False)
    top = max(max(load[s]) for load in loads.values() for s in steps) * 100 * 1.1
    for i, run in enumerate(runs):
        for j, step in enumerate(steps):
            ax = axes[i][j]
            share = [100 * v for v in loads[run][step]]
            ax.bar(range(num_experts), share, color=_color(i))
            ax.axhline(100 / num_experts, color="#333333", ls="--", lw=1)
            ax.set_ylim(0, top)
            ax.set_xticks(range(num_experts))
            ax.tick_params(labelsize=7)
            ax.set_title(f"{run}: step {step}", fontsize=9)
            if j == 0:
                ax.set_ylabel("share of routed tokens (%)", fontsize=8)
            if i == len(runs) - 1:
                ax.set_xlabel("expert", fontsize=8)
    fig.tight_layout()
    return fig


_SPAN_STYLE = {"launch": {"color": "#BBBBBB"}, "work": {"color": "#8C8C8C"},
               "wait": {"color": "#F4C7C3", "hatch": "///", "edgecolor": "#C44E52"}}


def host_timeline(timelines: Mapping[str, Sequence[Mapping]], *, unit: str = "time units") -> Figure:
    """Each timeline (label -> spans) as two lanes, the CPU above the GPU: spans are dicts with "lane" ("CPU" or
    "GPU"), "kind" ("launch", "work", "wait" or "kernel"), "name", "start" and "end". Kernels are coloured in the
    order they first run (a legend names them); a hatched CPU span is the host waiting for the GPU; a white gap on
    the GPU lane is the GPU waiting for the CPU. The GPU's idle share is in each timeline's title."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.55 * len(timelines) + 0.5), sharex=True,
                             squeeze=False)
    names = list(dict.fromkeys(s["name"] for spans in timelines.values() for s in spans if s["kind"] == "kernel"))
    for ax, (label, spans) in zip(axes[:, 0], timelines.items(), strict=True):
        end = max(s["end"] for s in spans)
        busy = sum(s["end"] - s["start"] for s in spans if s["kind"] == "kernel")
        for s in spans:
            y = 1 if s["lane"] == "CPU" else 0
            style = _SPAN_STYLE.get(s["kind"], {"color": _color(names.index(s["name"]) if s["name"] in names else 0)})
            ax.broken_barh([(s["start"], s["end"] - s["start"])], (y - 0.35, 0.7), linewidth=0.6,
                           **{"edgecolor": "white", **style})
            if s["kind"] in ("kernel", "wait") and s["end"] - s["start"] >= 1.5:
                ax.text((s["start"] + s["end"]) / 2, y, s["name"], ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["GPU", "CPU"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_title(f"{label}: the GPU idles {1 - busy / end:.0%} of {end:g} {unit}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.legend(handles=[Patch(color=_color(i), label=name) for i, name in enumerate(names)], loc="lower center",
               ncol=len(names), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
