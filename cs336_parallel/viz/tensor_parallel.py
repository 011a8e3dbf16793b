"""Pictures for tensor, sequence and context parallelism: matrix splits, where a block communicates,
step time against link bandwidth, activation memory, and the steps of ring attention."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Rectangle

from .collectives import RANK_COLORS

FULL_COLOR = "#BBBBBB"  # a tensor every rank holds whole
MASKED_COLOR = "#EEEEEE"


def _matrix(ax, x: float, y: float, w: float, h: float, parts: int, axis: str, label: str, *,
            colors: Sequence[str] | None = None, texts: Sequence[str] | None = None) -> None:
    """A w x h rectangle at (x, y) cut into `parts` pieces along `axis` ("cols" or "rows")."""
    for i in range(parts):
        if axis == "cols":
            box = (x + i * w / parts, y, w / parts, h)
        else:
            box = (x, y + h - (i + 1) * h / parts, w, h / parts)
        color = colors[i] if colors else FULL_COLOR
        ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor=color, edgecolor="white", lw=2))
        if texts:
            ax.text(box[0] + box[2] / 2, box[1] + box[3] / 2, texts[i], ha="center", va="center", color="white",
                    fontsize=9)
    ax.text(x + w / 2, y - 0.25, label, ha="center", va="top", fontsize=9)


def column_row_split(world_size: int = 2) -> Figure:
    """Y = X W split two ways: by the columns of W (each rank computes a slice of Y's columns) and by
    the rows of W (each rank multiplies its slice of X's columns and holds a partial sum of all of Y)."""
    n = world_size
    ranks = [RANK_COLORS[r % len(RANK_COLORS)] for r in range(n)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.6))
    # Column-parallel: X (whole) @ [W_0 | W_1 | ...] = [Y_0 | Y_1 | ...]
    _matrix(top, 0, 0, 2, 1.2, 1, "cols", "X  (T x D_in), whole on every rank", texts=["X"])
    top.text(2.35, 0.6, "@", fontsize=16, ha="center", va="center")
    _matrix(top, 2.7, 0, 2, 2, n, "cols", "W split by columns", colors=ranks, texts=[f"W{r}" for r in range(n)])
    top.text(5.05, 0.6, "=", fontsize=16, ha="center", va="center")
    _matrix(top, 5.4, 0, 2, 1.2, n, "cols", "Y split by columns: no communication", colors=ranks,
            texts=[f"Y{r}" for r in range(n)])
    top.set_title("Column-parallel: rank r computes Y_r = X W_r", fontsize=11, loc="left")
    # Row-parallel: [X_0 | X_1] @ [W_0 ; W_1] = X_0 W_0 + X_1 W_1
    _matrix(bottom, 0, 0, 2, 1.2, n, "cols", "X split by columns", colors=ranks, texts=[f"X{r}" for r in range(n)])
    bottom.text(2.35, 0.6, "@", fontsize=16, ha="center", va="center")
    _matrix(bottom, 2.7, 0, 2, 2, n, "rows", "W split by rows", colors=ranks, texts=[f"W{r}" for r in range(n)])
    bottom.text(5.05, 0.6, "=", fontsize=16, ha="center", va="center")
    height = 1.2 / n - 0.08
    for r in range(n):  # the partial products, one per rank, each the full size of Y
        y0 = 1.2 - (r + 1) * (height + 0.08) + 0.08
        bottom.add_patch(Rectangle((5.4, y0), 2, height, facecolor=ranks[r], edgecolor="white", lw=1))
        bottom.text(6.4, y0 + height / 2, f"X{r} W{r}", ha="center", va="center", color="white", fontsize=8)
    bottom.text(6.4, -0.25, "partial sums, one per rank", ha="center", va="top", fontsize=9)
    bottom.text(8.05, 0.6, "all-reduce\n→", fontsize=9, ha="center", va="center")
    _matrix(bottom, 8.7, 0, 2, 1.2, 1, "cols", "Y = Σ_r X_r W_r on every rank", texts=["Y"])
    bottom.set_title("Row-parallel: rank r computes X_r W_r; the sum needs an all-reduce", fontsize=11, loc="left")
    for ax in (top, bottom):
        ax.set_xlim(-0.2, 11.2)
        ax.set_ylim(-0.8, 2.2)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def _flow(ax, y: float, steps: Sequence[tuple[str, str, str]], title: str) -> None:
    """One row of boxes: (text, kind, shape label of the tensor leaving the box); kind is
    "compute", "local" (on the sequence shard), "comm" or "residual"."""
    styles = {"compute": "#4C72B0", "local": "#55A868", "comm": "#C44E52", "residual": "#8C8C8C"}
    x = 0.0
    for i, (text, kind, shape) in enumerate(steps):
        width = 1.55 if kind == "comm" else 1.35
        ax.add_patch(FancyBboxPatch((x, y - 0.35), width, 0.7, boxstyle="round,pad=0.02,rounding_size=0.1",
                                    facecolor=styles[kind], edgecolor="none", alpha=0.9))
        ax.text(x + width / 2, y, text, ha="center", va="center", color="white", fontsize=7.5)
        if i < len(steps) - 1:
            ax.annotate("", (x + width + 0.25, y), (x + width, y), arrowprops={"arrowstyle": "->", "lw": 1})
        if shape:
            ax.text(x + width + 0.12, y + 0.45, shape, ha="center", va="bottom", fontsize=6.5, color="#333333")
        x += width + 0.25
    ax.text(-0.1, y + 0.75, title, fontsize=10, ha="left", va="bottom", fontweight="bold")


def tp_block_flow() -> Figure:
    """Where a transformer block communicates under tensor parallelism (f and g around each half) and
    under tensor + sequence parallelism (all-gather and reduce-scatter; norms on sequence shards)."""
    full, shard = "(B,T,D)", "(B,T/t,D)"
    tp = [("LayerNorm", "compute", full), ("f\nfwd: identity\nbwd: all-reduce", "comm", full),
          ("attention\nheads split", "compute", "partial sums"),
          ("g\nfwd: all-reduce\nbwd: identity", "comm", full), ("+ residual", "residual", full),
          ("LayerNorm", "compute", full), ("f", "comm", full), ("MLP\nhidden split", "compute", "partial sums"),
          ("g", "comm", full), ("+ residual", "residual", full)]
    sp = [("LayerNorm\non my tokens", "local", shard), ("all-gather\n(bwd: reduce-\nscatter)", "comm", full),
          ("attention\nheads split", "compute", "partial sums"),
          ("reduce-scatter\n(bwd: all-\ngather)", "comm", shard), ("+ residual", "local", shard),
          ("LayerNorm\non my tokens", "local", shard), ("all-gather", "comm", full),
          ("MLP\nhidden split", "compute", "partial sums"), ("reduce-scatter", "comm", shard),
          ("+ residual", "local", shard)]
    fig, ax = plt.subplots(figsize=(15, 3.6))
    _flow(ax, 2.3, tp, "Tensor parallel: norms and residuals repeated on every rank, 2 all-reduces forward, 2 backward")
    _flow(ax, 0.3, sp, "Tensor + sequence parallel: the same bytes as reduce-scatter + all-gather; "
                       "norms, residuals (and dropout) on T/t tokens")
    ax.set_xlim(-0.2, 16.6)
    ax.set_ylim(-0.3, 3.4)
    ax.axis("off")
    fig.tight_layout()
    return fig


def tp_step_time_vs_bandwidth(bandwidths_gbps: Sequence[float], curves: dict[str, tuple[list, list]],
                              links: dict[str, float], *, title: str = "") -> Figure:
    """Time per layer against link bandwidth: `curves[label] = (compute_s, total_s)` per bandwidth,
    vertical lines at the bandwidths of named `links` (GB/s per direction)."""
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (label, (compute_s, total_s)) in enumerate(curves.items()):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        ax.plot(bandwidths_gbps, [t * 1e3 for t in total_s], "-", color=color, lw=2,
                label=f"{label}: compute + TP comm")
        ax.plot(bandwidths_gbps, [t * 1e3 for t in compute_s], "--", color=color, lw=1, label=f"{label}: compute only")
    for name, gbps in links.items():
        ax.axvline(gbps, color="#888888", lw=0.8, ls=":")
        ax.text(gbps, ax.get_ylim()[1], name, rotation=90, ha="right", va="top", fontsize=8, color="#555555")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth per direction (GB/s, log scale)")
    ax.set_ylabel("time per layer, forward + backward (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def activation_memory_chart(formula: dict[str, list[tuple[float, float]]], measured: dict[str, list[float]],
                            predicted: dict[str, list[float]], tps: Sequence[int], *,
                            formula_title: str = "", measured_title: str = "") -> Figure:
    """Two panels of bars per tensor-parallel size t. Left, the paper's formula in GB per layer:
    `formula[mode]` holds (everything else, the s x s attention scores) in bytes per t, stacked. Right,
    what autograd saved in this notebook's block (units of s·b·h elements), the hand count marked."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(formula), 1)
    for i, (label, values) in enumerate(formula.items()):
        xs = [j + (i - (len(formula) - 1) / 2) * width for j in range(len(tps))]
        rest, scores = [v[0] / 1e9 for v in values], [v[1] / 1e9 for v in values]
        left.bar(xs, rest, width, color=RANK_COLORS[i], label=f"{label}: norms, linears, dropout")
        left.bar(xs, scores, width, bottom=rest, color=RANK_COLORS[i], alpha=0.45, hatch="//", edgecolor="white",
                 label=f"{label}: s x s attention scores")
    left.set_ylabel("activation memory per layer (GB, 16-bit)")
    left.set_title(formula_title, fontsize=10)
    width = 0.8 / max(len(measured), 1)
    for i, (label, values) in enumerate(measured.items()):
        xs = [j + (i - (len(measured) - 1) / 2) * width for j in range(len(tps))]
        right.bar(xs, values, width, color=RANK_COLORS[i], label=f"{label}: measured")
        right.scatter(xs, predicted[label], marker="_", s=400, color="black", zorder=3,
                      label="counted by hand" if i == 0 else None)
    right.set_ylabel("saved for backward, per rank (units of s·b·h elements)")
    right.set_title(measured_title, fontsize=10)
    for ax in (left, right):
        ax.set_xticks(range(len(tps)), [f"t = {t}" for t in tps])
        ax.set_xlabel("tensor-parallel size")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def ring_attention_steps(world_size: int = 4, causal: bool = True) -> Figure:
    """Left: the attention score matrix in blocks (query block i on rank i, key block j), each labelled
    with the ring step at which rank i meets key block j; masked blocks grey when `causal`.
    Right: which rank's key/value block each rank holds at each step."""
    n = world_size
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for i in range(n):
        for j in range(n):
            step = (i - j) % n
            masked = causal and j > i
            color = MASKED_COLOR if masked else plt.cm.viridis(step / max(n - 1, 1) * 0.85)
            left.add_patch(Rectangle((j, n - 1 - i), 1, 1, facecolor=color, edgecolor="white", lw=2))
            if causal and j == i:  # the upper triangle of a diagonal block is masked
                left.add_patch(plt.Polygon([(j, n - i), (j + 1, n - i), (j + 1, n - 1 - i)], facecolor=MASKED_COLOR,
                                           edgecolor="white", lw=1))
            text = "masked" if masked else f"step {step}"
            tx, ty = (j + 0.35, n - 0.7 - i) if causal and j == i else (j + 0.5, n - 0.5 - i)
            left.text(tx, ty, text, ha="center", va="center", fontsize=8,
                      color="#888888" if masked else "white")
    left.set_xlim(0, n)
    left.set_ylim(0, n)
    left.set_xticks([j + 0.5 for j in range(n)], [f"K,V block {j}" for j in range(n)], fontsize=8)
    left.set_yticks([n - 0.5 - i for i in range(n)], [f"Q block {i}\n(rank {i})" for i in range(n)], fontsize=8)
    left.set_title("Scores Q Kᵀ in blocks: when each one is computed" + (" (causal)" if causal else ""), fontsize=10)
    left.set_aspect("equal")
    for r in range(n):
        for s in range(n):
            src = (r - s) % n
            right.add_patch(Rectangle((s, n - 1 - r), 1, 1, facecolor=RANK_COLORS[src % len(RANK_COLORS)],
                                      edgecolor="white", lw=2))
            right.text(s + 0.5, n - 0.5 - r, f"K,V {src}", ha="center", va="center", fontsize=8, color="white")
    right.set_xlim(0, n)
    right.set_ylim(0, n)
    right.set_xticks([s + 0.5 for s in range(n)], [f"step {s}" for s in range(n)], fontsize=8)
    right.set_yticks([n - 0.5 - r for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    right.set_title("Block held by each rank: after each step it goes to rank r + 1", fontsize=10)
    right.set_aspect("equal")
    fig.tight_layout()
    return fig
