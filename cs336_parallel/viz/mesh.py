"""Device meshes and layouts drawn: the groups of each mesh axis and the links they cross, a planned
layout's memory and step time broken down, and the best layout per model size and GPU count."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch

GROUP_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
                "#CCB974", "#64B5CD"]
MEMORY_PARTS = [("params_bytes", "parameters", "#4C72B0"), ("grads_bytes", "gradients", "#DD8452"),
                ("optimizer_bytes", "optimizer state", "#55A868"), ("activations_bytes", "activations", "#C44E52")]
TIME_PARTS = {"compute": "#4C72B0", "bubble": "#BBBBBB", "tp": "#DD8452", "cp": "#DA8BC3", "ep": "#8172B3",
              "pp": "#937860", "dp": "#55A868"}


def _inside_one_node(group: Sequence[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in group}) == 1


def _stack(axis_groups: Sequence[Sequence[int]], x: Sequence[float]) -> list[int]:
    """A depth for each group's bar, so that bars at one depth never overlap."""
    ends: list[float] = []  # the right end of the last bar at each depth
    depths = []
    for group in axis_groups:
        left, right = min(x[r] for r in group), max(x[r] for r in group)
        depth = next((k for k, end in enumerate(ends) if end < left - 0.2), len(ends))
        if depth == len(ends):
            ends.append(right)
        ends[depth] = right
        depths.append(depth)
    return depths


def mesh_diagram(mesh_shape: Mapping[str, int], groups: Mapping[str, Sequence[Sequence[int]]], *,
                 gpus_per_node: int, links: tuple[str, str] = ("NVLink", "network")) -> Figure:
    """One row per mesh axis: the ranks in their nodes, and that axis's groups drawn as coloured bars
    under the ranks they join (solid inside a node, dashed where a group crosses nodes).

    `groups[name]` lists the groups of axis `name` (e.g. from `mesh_groups`); `links` names the
    intra-node and inter-node links for the titles."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    world = math.prod(mesh_shape.values())
    gap = 0.6  # extra space between nodes
    x = [r + gap * (r // gpus_per_node) for r in range(world)]
    names = list(mesh_shape)
    depths = {name: _stack(groups[name], x) for name in names}
    most = max(max(d, default=0) + 1 for d in depths.values())
    inch = 0.5  # per unit of the drawing (a rank is one unit wide), in every row
    size = (inch * (x[-1] + 1.6) + 0.4, len(names) * (inch * (1.9 + 0.3 * most) + 0.45) + 0.4)
    fig, axes = plt.subplots(len(names), 1, figsize=size, squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        axis_groups = [list(g) for g in groups[name]]
        for node in range(math.ceil(world / gpus_per_node)):
            first, last = node * gpus_per_node, min(world, (node + 1) * gpus_per_node) - 1
            ax.add_patch(FancyBboxPatch((x[first] - 0.45, -0.45), x[last] - x[first] + 0.9, 0.9,
                                        boxstyle="round,pad=0.05", facecolor="#F4F4F4", edgecolor="#AAAAAA"))
            ax.text((x[first] + x[last]) / 2, 0.62, f"node {node}", ha="center", va="bottom", fontsize=7,
                    color="#666666")
        for r in range(world):
            ax.add_patch(Circle((x[r], 0), 0.32, facecolor="white", edgecolor="#333333"))
            ax.text(x[r], 0, str(r), ha="center", va="center", fontsize=8)
        for i, (group, depth) in enumerate(zip(axis_groups, depths[name], strict=True)):
            xs = [x[r] for r in group]
            left, right = min(xs), max(xs)
            y = -0.75 - 0.3 * depth
            color = GROUP_COLORS[i % len(GROUP_COLORS)]
            style = "-" if _inside_one_node(group, gpus_per_node) else "--"
            ax.plot([left, right], [y, y], style, color=color, linewidth=3, solid_capstyle="round")
            for xr in xs:
                ax.plot([xr, xr], [-0.32, y], ":", color=color, linewidth=1)
                ax.plot(xr, y, "o", color=color, markersize=5)
        inside = all(_inside_one_node(g, gpus_per_node) for g in axis_groups)
        size = mesh_shape[name]
        where = f"inside a node ({links[0]})" if inside else f"across nodes ({links[1]})"
        ax.set_title(f"{name} = {size}: {len(axis_groups)} group{'s' * (len(axis_groups) != 1)} of {size}, "
                     f"{where}", fontsize=9, loc="left")
        ax.set_xlim(-0.8, x[-1] + 0.8)
        ax.set_ylim(-0.95 - 0.3 * most, 0.95)  # the same scale in every row
        ax.set_aspect("equal")
        ax.axis("off")
    shape = " x ".join(f"{n}={s}" for n, s in mesh_shape.items())
    fig.suptitle(f"mesh {shape}, {gpus_per_node} GPUs per node (dashed: a group that crosses nodes)", fontsize=10)
    fig.tight_layout()
    return fig


def plan_breakdown(plans: Mapping[str, object], *, title: str = "", unjudged: Collection[str] = ()) -> Figure:
    """Memory per GPU (GB, stacked: parameters, gradients, optimizer state, activations, against the GPU's
    memory) and step time (s, stacked: compute, bubble, exposed communication per mesh axis) of each plan;
    a plan that does not fit gets no time. The plans named in `unjudged` get no verdict on their memory (the
    planner's model does not describe them well enough), and their time.

    A plan has `params_bytes`, `grads_bytes`, `optimizer_bytes`, `activations_bytes`, `memory_limit_bytes`,
    `compute_s`, `bubble_s`, `comm_s` (a dict by axis), `step_s`, `mfu` and `fits`."""
    names = list(plans)
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2.4))
    limit = max(p.memory_limit_bytes for p in plans.values()) / 1e9
    totals = [sum(getattr(p, key) for key, *_ in MEMORY_PARTS) / 1e9 for p in plans.values()]
    clip = min(max(totals + [limit]) * 1.05, 2.5 * limit)  # a plan far over the limit runs off the chart
    for i, (name, plan) in enumerate(plans.items()):
        left = 0.0
        for key, label, color in MEMORY_PARTS:
            value = getattr(plan, key) / 1e9
            shown = min(left + value, clip) - min(left, clip)
            mem_ax.barh(i, shown, left=min(left, clip), color=color, label=label if i == 0 else None)
            left += value
        verdict = "not judged" if name in unjudged else "fits" if plan.fits else "does not fit"
        clipped = " (clipped)" if left > clip else ""
        mem_ax.text(min(left, clip) + clip * 0.01, i, f"{left:,.1f} GB, {verdict}{clipped}", va="center", fontsize=8)
    mem_ax.axvline(limit, color="#333333", linestyle="--", linewidth=1, label=f"{limit:g} GB per GPU")
    mem_ax.set_xlim(0, clip * 1.5)
    mem_ax.set_xlabel("memory per GPU (GB)")
    mem_ax.set_title("memory per GPU", fontsize=10)

    timed = {name: p.fits or name in unjudged for name, p in plans.items()}
    drawn = [p for name, p in plans.items() if timed[name]] or list(plans.values())
    time_max = max(p.step_s for p in drawn)
    used = {key for p in drawn for key, value in p.comm_s.items() if value > 0}
    for i, (name, plan) in enumerate(plans.items()):
        if not timed[name]:
            time_ax.text(0, i, "  does not fit", va="center", fontsize=8, color="#C44E52")
            continue
        parts = {"compute": plan.compute_s, "bubble": plan.bubble_s,
                 **{k: v for k, v in plan.comm_s.items() if k in used}}
        left = 0.0
        for key, value in parts.items():
            label = key if key in ("compute", "bubble") else f"{key} communication (exposed)"
            time_ax.barh(i, value, left=left, color=TIME_PARTS.get(key, "#333333"), label=label)
            left += value
        time_ax.text(left + time_max * 0.01, i, f"{left:.2f} s, MFU {plan.mfu:.0%}", va="center", fontsize=8)
    time_ax.set_xlim(0, time_max * 1.4)
    time_ax.set_xlabel("time per optimizer step (s)")
    time_ax.set_title("step time", fontsize=10)
    for ax in (mem_ax, time_ax):
        ax.set_yticks(range(len(names)), names if ax is mem_ax else [""] * len(names))
        ax.set_ylim(len(names) - 0.5, -0.5)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper center", ncol=3, frameon=False,
                  bbox_to_anchor=(0.5, -0.16 - 0.4 / len(names)))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def best_layout_heatmap(cells: Sequence[Mapping], *, title: str = "") -> Figure:
    """A grid of models (rows) by GPU counts (columns): each cell names the fastest layout that fits,
    coloured by its MFU; `cells` holds dicts with `model`, `gpus`, `label` and `mfu` (None: nothing fits)."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    gpus = sorted({c["gpus"] for c in cells})
    grid = [[math.nan] * len(gpus) for _ in models]
    fig, ax = plt.subplots(figsize=(1.7 * len(gpus) + 2.5, 0.9 * len(models) + 1.6))
    for c in cells:
        i, j = models.index(c["model"]), gpus.index(c["gpus"])
        grid[i][j] = math.nan if c["mfu"] is None else 100 * c["mfu"]
        text = "nothing fits" if c["mfu"] is None else f"{c['label']}\n{100 * c['mfu']:.0f}%"
        dark = c["mfu"] is not None and c["mfu"] > 0.35
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "#222222")
    image = ax.imshow(grid, cmap="YlGn", vmin=0, vmax=60, aspect="auto")
    ax.set_xticks(range(len(gpus)), [f"{g:,}" for g in gpus])
    ax.set_yticks(range(len(models)), models)
    ax.set_xlabel("number of GPUs")
    ax.set_ylabel("model")
    fig.colorbar(image, ax=ax, label="MFU of the fastest layout that fits (%)")
    ax.set_title(title or "fastest layout that fits, per model and GPU count", fontsize=10)
    fig.tight_layout()
    return fig
