"""Pictures of the hierarchy, the collectives, rings and trees, and measured bandwidth."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
SUM_COLOR = "#333333"


def hierarchy_chart(rows: Sequence[tuple[str, float | None, float | None]], *, title: str = "") -> Figure:
    """Horizontal bars, log scale: (label, datasheet GB/s, measured GB/s) per link or memory."""
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    for i, (_label, datasheet, measured) in enumerate(rows):
        if datasheet:
            ax.barh(i + 0.2, datasheet, height=0.4, color="#BBBBBB", label="datasheet" if i == 0 else None)
            ax.text(datasheet * 1.1, i + 0.2, _gbps(datasheet), va="center", fontsize=8, color="#555555")
        if measured:
            ax.barh(i - 0.2, measured, height=0.4, color=RANK_COLORS[0], label="measured here")
            ax.text(measured * 1.1, i - 0.2, _gbps(measured), va="center", fontsize=8, color=RANK_COLORS[0])
    ax.set_yticks(range(len(rows)), [label for label, *_ in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(v for _, *vs in rows for v in vs if v) * 8)  # room for the labels
    ax.set_xlabel("bandwidth (GB/s, log scale)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def _gbps(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


# Each buffer slot is (source rank, chunk) or ("sum", chunk); chunk None means the whole buffer.
def _collective_states(op: str, n: int) -> tuple[list[list], list[list]]:
    ranks = range(n)
    whole = [[(r, None)] for r in ranks]
    if op == "broadcast":
        return [[(0, None)]] + [[None]] * (n - 1), [[(0, None)] for _ in ranks]
    if op == "scatter":
        return [[(0, c) for c in ranks]] + [[None] * n] * (n - 1), [[(0, r)] for r in ranks]
    if op == "gather":
        return whole, [[(s, None) for s in ranks]] + [[None] * n] * (n - 1)
    if op == "reduce":
        return whole, [[("sum", None)]] + [[None]] * (n - 1)
    if op == "all_gather":
        return whole, [[(s, None) for s in ranks] for _ in ranks]
    if op == "reduce_scatter":
        return [[(r, c) for c in ranks] for r in ranks], [[("sum", r)] for r in ranks]
    if op == "all_reduce":
        return whole, [[("sum", None)] for _ in ranks]
    if op == "all_to_all":
        return [[(r, c) for c in ranks] for r in ranks], [[(s, r) for s in ranks] for r in ranks]
    raise ValueError(f"unknown collective {op!r}")


COLLECTIVES = ["broadcast", "scatter", "gather", "reduce", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def _draw_buffers(ax, states: list[list], x0: float) -> None:
    for r, slots in enumerate(states):
        for j, slot in enumerate(slots):
            color, text = "white", ""
            if slot is not None:
                src, chunk = slot
                color = SUM_COLOR if src == "sum" else RANK_COLORS[src % len(RANK_COLORS)]
                text = ("Σ" if src == "sum" else f"x{src}") + ("" if chunk is None else f"[{chunk}]")
            ax.add_patch(Rectangle((x0 + j, -r - 1), 1, 0.8, facecolor=color, edgecolor="#999999"))
            ax.text(x0 + j + 0.5, -r - 0.6, text, ha="center", va="center", fontsize=7, color="white")


def collectives_gallery(world_size: int = 4) -> Figure:
    """Before and after, per rank, for the eight collectives (root 0; x_r is rank r's data, Σ the sum)."""
    fig, axes = plt.subplots(2, 4, figsize=(15, 5.5))
    for ax, op in zip(axes.flat, COLLECTIVES, strict=True):
        before, after = _collective_states(op, world_size)
        _draw_buffers(ax, before, 0)
        _draw_buffers(ax, after, world_size + 1.5)
        ax.add_patch(FancyArrowPatch((world_size + 0.15, -world_size / 2 - 0.1),
                                     (world_size + 1.35, -world_size / 2 - 0.1), arrowstyle="->", mutation_scale=15))
        for r in range(world_size):
            ax.text(-0.2, -r - 0.6, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-1.6, 2 * world_size + 1.6)
        ax.set_ylim(-world_size - 0.4, 0.6)
        ax.text(world_size / 2, 0.25, "before", ha="center", fontsize=8)
        ax.text(world_size * 1.5 + 1.5, 0.25, "after", ha="center", fontsize=8)
        ax.set_title(op, fontsize=11)
        ax.axis("off")
    fig.tight_layout()
    return fig


def ring_reduce_scatter_steps(world_size: int = 4) -> Figure:
    """How many ranks' contributions each rank holds for each chunk, after each step of a ring
    reduce-scatter; at step s rank r sends chunk (r - s - 1) mod n to rank r + 1."""
    n = world_size
    counts = [[1] * n for _ in range(n)]
    snapshots = [[row[:] for row in counts]]
    for step in range(n - 1):
        sent = [(r, (r - step - 1) % n, counts[r][(r - step - 1) % n]) for r in range(n)]
        for r, chunk, value in sent:
            counts[(r + 1) % n][chunk] += value
        snapshots.append([row[:] for row in counts])
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.2))
    for s, (ax, grid) in enumerate(zip(axes, snapshots, strict=True)):
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=n + 1)
        for r in range(n):
            for c in range(n):
                done = grid[r][c] == n and c == r
                ax.text(c, r, f"{grid[r][c]}", ha="center", va="center", fontsize=11,
                        fontweight="bold" if done else None, color="white" if grid[r][c] > n / 2 else "black")
        ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=8)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
        ax.set_title("start" if s == 0 else f"after step {s}", fontsize=10)
    fig.suptitle("Ring reduce-scatter: contributions summed into each chunk (n = done)", fontsize=11)
    fig.tight_layout()
    return fig


def bandwidth_plot(results: Sequence[dict], *, fits: dict | None = None) -> Figure:
    """busbw against message size, one line per (op, world size); optional alpha-beta model lines.

    `results` rows: op, world_size, size_bytes, time_s, busbw_gbps. `fits[(op, n)]` is a function
    size_bytes -> predicted time_s."""
    keys = sorted({(r["op"], r["world_size"]) for r in results})
    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, key in enumerate(keys):
        rows = sorted((r for r in results if (r["op"], r["world_size"]) == key), key=lambda r: r["size_bytes"])
        sizes = [r["size_bytes"] for r in rows]
        color = RANK_COLORS[i % len(RANK_COLORS)]
        label = f"{key[0]}, n={key[1]}"
        ax_t.plot(sizes, [r["time_s"] * 1e3 for r in rows], "o", color=color, label=label)
        if fits and key in fits:
            ax_t.plot(sizes, [fits[key](s) * 1e3 for s in sizes], "-", color=color, alpha=0.6)
        ax_bw.plot(sizes, [r["busbw_gbps"] for r in rows], "o-", color=color, label=label)
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size S (bytes)")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per call (ms); lines: alpha-beta fit")
    ax_bw.set_ylabel("bus bandwidth busbw (GB/s)")
    ax_bw.legend(fontsize=8)
    fig.tight_layout()
    return fig


def binomial_tree(world_size: int = 8, src: int = 0) -> Figure:
    """Broadcast by a binomial tree: in round k every rank that has the data sends it 2^k ranks on;
    ceil(log2 n) rounds in all."""
    fig, ax = plt.subplots(figsize=(1.2 * world_size + 1, 2.8))
    k, rounds = 0, []
    while (1 << k) < world_size:
        mask = 1 << k
        rounds.append([(v, v + mask) for v in range(mask) if v + mask < world_size])
        k += 1
    for r in range(world_size):
        ax.add_patch(plt.Circle((r, 0), 0.3, color=RANK_COLORS[0] if r == src else "#BBBBBB"))
        ax.text(r, 0, str(r), ha="center", va="center", color="white", fontsize=10)
    for k, sends in enumerate(rounds):
        color = RANK_COLORS[(k + 1) % len(RANK_COLORS)]
        for v, w in sends:
            a, b = (v + src) % world_size, (w + src) % world_size
            ax.add_patch(FancyArrowPatch((a, 0.35), (b, 0.35), connectionstyle=f"arc3,rad={-0.35 - 0.05 * k}",
                                         arrowstyle="->", mutation_scale=12, color=color, lw=1.5))
        ax.plot([], [], color=color, label=f"round {k + 1}: {len(sends)} send{'s' * (len(sends) > 1)}")
    ax.set_xlim(-0.7, world_size - 0.3)
    ax.set_ylim(-0.6, 0.6 + 0.45 * world_size / 2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.set_title(f"Binomial-tree broadcast from rank {src} to {world_size} ranks: {len(rounds)} rounds")
    fig.tight_layout()
    return fig
