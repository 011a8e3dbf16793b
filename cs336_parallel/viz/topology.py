"""Cluster topologies for notebook 00: a rail-optimized fat tree of GPU nodes beside a TPU-style torus."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from .collectives import RANK_COLORS

NVLINK, NETWORK, ICI = "#76B900", "#4477AA", "#CC6677"


def _fat_tree(ax, nodes: int, gpus: int) -> None:
    """Nodes of `gpus` GPUs joined by NVSwitch; NIC k of every node goes to leaf (rail) k; spines join the leaves."""
    width = nodes * (gpus + 1)
    leaves = [(width * (k + 0.5) / gpus - 0.5, 2.0) for k in range(gpus)]
    spines = [(width * (k + 0.5) / 2 - 0.5, 3.2) for k in range(2)]
    for x, y in leaves:
        for sx, sy in spines:
            ax.plot([x, sx], [y, sy], color=NETWORK, lw=1.2, zorder=1)
    for n in range(nodes):
        left = n * (gpus + 1)
        ax.add_patch(plt.Rectangle((left - 0.4, -0.5), gpus - 0.2, 1.5, fill=False, ec="#999999", lw=1))
        ax.plot([left - 0.2, left + gpus - 0.8], [0.55, 0.55], color=NVLINK, lw=4, zorder=1)  # NVSwitch
        for k in range(gpus):
            x = left + k
            ax.plot([x, x], [0.55, 0.0], color=NVLINK, lw=2, zorder=1)
            ax.plot([x, leaves[k][0]], [0.0, leaves[k][1]], color=RANK_COLORS[k % len(RANK_COLORS)], lw=1,
                    alpha=0.8, zorder=0)
            ax.scatter([x], [0.0], s=140, color=RANK_COLORS[k % len(RANK_COLORS)], zorder=2, ec="black", lw=0.5)
        ax.text(left + (gpus - 1) / 2 - 0.2, -0.85, f"node {n}", ha="center", fontsize=8)
    for k, (x, y) in enumerate(leaves):
        ax.add_patch(plt.Rectangle((x - 0.6, y - 0.2), 1.2, 0.4, color="#DDDDDD", ec="black", lw=0.5, zorder=2))
        ax.text(x, y, f"leaf {k}", ha="center", va="center", fontsize=7, zorder=3)
    for k, (x, y) in enumerate(spines):
        ax.add_patch(plt.Rectangle((x - 0.7, y - 0.2), 1.4, 0.4, color="#BBBBBB", ec="black", lw=0.5, zorder=2))
        ax.text(x, y, f"spine {k}", ha="center", va="center", fontsize=7, zorder=3)
    ax.plot([], [], color=NVLINK, lw=3, label="NVLink + NVSwitch (inside a node)")
    ax.plot([], [], color=NETWORK, lw=1.5, label="InfiniBand or RoCE (switches)")
    ax.legend(loc="upper left", fontsize=7, frameon=False, bbox_to_anchor=(0, -0.02))
    ax.set_title(f"GPU cluster: rail-optimized fat tree\n({nodes} nodes x {gpus} GPUs; GPU k's NIC on leaf k)",
                 fontsize=9)
    ax.set_xlim(-1, width)
    ax.set_ylim(-1.1, 3.6)


def _torus(ax, side: int) -> None:
    """A side x side torus: every chip wired to its 4 neighbours, the edges wrapping around (a 3D torus: 6)."""
    for i in range(side):
        for j in range(side):
            if j + 1 < side:
                ax.plot([i, i], [j, j + 1], color=ICI, lw=2, zorder=1)
            if i + 1 < side:
                ax.plot([i, i + 1], [j, j], color=ICI, lw=2, zorder=1)
    for k in range(side):  # wrap-around links: each edge chip's stub leads to the opposite edge's chip
        for (x0, y0), (dx, dy) in [((k, 0), (0, -1)), ((k, side - 1), (0, 1)), ((0, k), (-1, 0)),
                                   ((side - 1, k), (1, 0))]:
            ax.plot([x0, x0 + 0.45 * dx], [y0, y0 + 0.45 * dy], color=ICI, lw=2, ls=(0, (2, 1)), zorder=1)
    xs, ys = zip(*[(i, j) for i in range(side) for j in range(side)], strict=True)
    ax.scatter(xs, ys, s=140, color="#EEEEEE", ec="black", lw=0.5, zorder=2)
    ax.plot([], [], color=ICI, lw=2, label="chip-to-chip links (ICI), no switch")
    ax.plot([], [], color=ICI, lw=2, ls=(0, (2, 1)), label="wrap-around to the opposite edge")
    ax.legend(loc="upper left", fontsize=7, frameon=False, bbox_to_anchor=(0, -0.02))
    ax.set_title(f"TPU pod: a torus ({side} x {side} drawn; v4 and v5p are 3D)\neach chip wired to its neighbours, "
                 "edges wrap around", fontsize=9)
    ax.set_xlim(-0.8, side - 0.2)
    ax.set_ylim(-1.6, side - 0.2)


def fat_tree_and_torus(*, nodes: int = 4, gpus: int = 4, side: int = 4) -> Figure:
    """The two ways large clusters are wired, side by side."""
    fig, (tree, torus) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    _fat_tree(tree, nodes, gpus)
    _torus(torus, side)
    for ax in (tree, torus):
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig
