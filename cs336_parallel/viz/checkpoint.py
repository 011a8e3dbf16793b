"""Pictures of failures and checkpoints: a job's mean time between failures against its size, the
Young/Daly trade-off, the atomic save protocol, which files each rank reads when resharding, and a
resumed run's loss curve over the uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .collectives import RANK_COLORS

CRASH_COLOR = "#C44E52"


def _ranges(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's piece: `tensor_split`'s (the first numel % world_size ranks one more)."""
    base, extra = divmod(numel, world_size)
    starts = [r * base + min(r, extra) for r in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def mtbf_vs_gpus(gpu_mtbf_h: float, *, observed: Mapping[str, tuple[int, float]] | None = None,
                 gpus: Sequence[int] = (8, 64, 512, 4096, 16384, 131072)) -> Figure:
    """A job's mean time between failures, gpu_mtbf_h / N hours, against its number of GPUs N (log-log);
    `observed` adds labelled points (label -> (GPUs, hours))."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = [gpus[0] * (gpus[-1] / gpus[0]) ** (i / 100) for i in range(101)]
    ax.plot(xs, [gpu_mtbf_h / x for x in xs], color=RANK_COLORS[0],
            label=f"one GPU fails every {gpu_mtbf_h / 24 / 365:.0f} years: MTBF / N")
    for i, (label, (n, hours)) in enumerate((observed or {}).items()):
        ax.scatter([n], [hours], color=RANK_COLORS[(i + 1) % len(RANK_COLORS)], zorder=3, label=label)
    for hours, text in ((24 * 7, "a week"), (24, "a day"), (1, "an hour")):
        ax.axhline(hours, color="#BBBBBB", linewidth=0.8, linestyle=":")
        ax.text(gpus[-1], hours, f" {text}", fontsize=8, color="#777777", va="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs in the job (log scale)")
    ax.set_ylabel("mean time between failures (hours, log scale)")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def young_daly(write_s: float, job_mtbf_h: Mapping[str, float], *, restart_s: float = 0.0) -> Figure:
    """Fraction of the time lost against the checkpoint interval tau, for each job (label -> MTBF M):
    write_s / tau (writing checkpoints) + (tau / 2 + restart_s) / M (on average half an interval of work
    is lost per failure, plus the restart). The minimum sits near tau = sqrt(2 write_s M) (Young 1974,
    Daly 2006), marked on each curve."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    taus_s = [write_s * 1.5 * (1e4 / 1.5) ** (i / 200) for i in range(201)]
    lowests = []
    for i, (label, hours) in enumerate(job_mtbf_h.items()):
        m = hours * 3600
        waste = [100 * (write_s / t + (t / 2 + restart_s) / m) for t in taus_s]
        color = RANK_COLORS[i % len(RANK_COLORS)]
        ax.plot([t / 60 for t in taus_s], waste, color=color, label=f"{label} (MTBF {hours:.3g} h)")
        best = math.sqrt(2 * write_s * m)
        lowest = 100 * (write_s / best + (best / 2 + restart_s) / m)
        lowests.append(lowest)
        ax.scatter([best / 60], [lowest], color=color, zorder=3)
        ax.annotate(f"{best / 60:.2g} min, {lowest:.1f}%", (best / 60, lowest), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8, color=color)
    ax.set_xscale("log")
    ax.set_ylim(0, min(40, 5 * max(lowests)))  # the minima, and enough of the curves to see them rise
    ax.set_xlabel("checkpoint interval τ (minutes, log scale)")
    ax.set_ylabel("time lost (% of the run)")
    ax.set_title(f"writing a checkpoint takes {write_s:g} s; dots: τ = √(2 · write time · MTBF)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def save_protocol(world_size: int = 4, *, crashed_rank: int = 2) -> Figure:
    """The atomic save, twice: every rank writes its shard, the SHA-256 digests go to rank 0, and rank 0
    commits by renaming metadata.pt into place; below, `crashed_rank` dies mid-write and nothing commits."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 1.1 * world_size + 1.8), sharex=True)
    lengths = [3.0 + 0.8 * ((5 * r) % 3) for r in range(world_size)]  # shard writes take different times
    end = max(lengths) + 1.6
    for ax, crash in zip(axes, (None, crashed_rank), strict=True):
        for r in range(world_size):
            y = world_size - 1 - r
            ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
            length = lengths[r] if crash != r else lengths[r] / 2
            ax.add_patch(Rectangle((1.0, y + 0.1), length, 0.6, color=RANK_COLORS[r % len(RANK_COLORS)], alpha=0.85))
            ax.text(1.0 + length / 2, y + 0.4, f"shard_{r}.pt", ha="center", va="center", fontsize=8, color="white")
            if crash == r:
                ax.text(1.0 + length, y + 0.4, " ✗ killed", color=CRASH_COLOR, va="center", fontsize=10,
                        fontweight="bold")
            elif r:
                ax.annotate("", xy=(end, world_size - 0.6), xytext=(1.0 + lengths[r], y + 0.4),
                            arrowprops={"arrowstyle": "->", "color": "#999999", "linewidth": 0.8})
        top = world_size - 1
        ax.add_patch(Rectangle((0.1, top + 0.1), 0.8, 0.6, color="#8C8C8C"))
        ax.text(0.5, top + 0.4, "rm old\nmetadata", ha="center", va="center", fontsize=6, color="white")
        ax.axvline(1.0, color="#555555", linestyle=":", linewidth=1)
        ax.axvline(end, color="#555555", linestyle=":", linewidth=1)
        ax.text(end, world_size + 0.05, "gather sha256 digests", ha="center", fontsize=8, color="#555555")
        if crash is None:
            ax.add_patch(Rectangle((end + 0.1, top + 0.1), 2.4, 0.6, color="#333333"))
            ax.text(end + 1.3, top + 0.4, "metadata.pt.tmp → metadata.pt", ha="center", va="center", fontsize=7,
                    color="white")
            ax.set_title("a complete save: metadata.pt appears last, in one rename (the commit)", fontsize=10)
        else:
            ax.text(end + 0.2, top - 0.6, "the others wait for rank "
                    f"{crash}'s digest:\nmetadata.pt is never written,\nthe checkpoint stays incomplete",
                    fontsize=8, color=CRASH_COLOR, va="center")
            ax.set_title(f"rank {crash} dies mid-write: nothing commits, the previous checkpoint is used",
                         fontsize=10)
        ax.set_xlim(-1.2, end + 3.0)
        ax.set_ylim(-0.2, world_size + 0.4)
        ax.set_yticks([])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlabel("time (arbitrary units) →")
    axes[-1].set_xticks([])
    fig.tight_layout()
    return fig


def reshard_map(numel: int, saved_by: int, loaded_by: int) -> Figure:
    """Which shard files each rank of the new world size reads: the flattened tensor cut into `saved_by`
    pieces (one file each) above; below, each new rank's range, coloured by the file each part comes from."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    old, new = _ranges(numel, saved_by), _ranges(numel, loaded_by)
    for r, (start, stop) in enumerate(old):
        ax.add_patch(Rectangle((start, 1.5), stop - start, 0.6, facecolor=RANK_COLORS[r % len(RANK_COLORS)],
                               edgecolor="white", linewidth=2))
        ax.text((start + stop) / 2, 1.8, f"shard_{r}.pt\n[{start}, {stop})", ha="center", va="center", fontsize=7,
                color="white")
    for n, (start, stop) in enumerate(new):
        files = []
        for r, (old_start, old_stop) in enumerate(old):
            lo, hi = max(start, old_start), min(stop, old_stop)
            if lo < hi:
                files.append(f"shard_{r}")
                color = RANK_COLORS[r % len(RANK_COLORS)]
                ax.add_patch(Rectangle((lo, 0.4), hi - lo, 0.6, facecolor=color, alpha=0.55, edgecolor="none"))
                ax.plot([lo, hi, hi, lo], [1.0, 1.0, 1.5, 1.5], color=color, linewidth=0.6, alpha=0.6)
        ax.add_patch(Rectangle((start, 0.4), stop - start, 0.6, facecolor="none", edgecolor="black", linewidth=1.5))
        ax.text((start + stop) / 2, 0.7, f"rank {n}: [{start}, {stop})", ha="center", va="center", fontsize=7)
        ax.text((start + stop) / 2, 0.2, "reads " + ", ".join(files), ha="center", va="center", fontsize=7)
    ax.text(-0.01 * numel, 1.8, f"saved by {saved_by} ranks", ha="right", va="center", fontsize=9)
    ax.text(-0.01 * numel, 0.7, f"loaded by {loaded_by} ranks", ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.2 * numel, numel * 1.01)
    ax.set_ylim(0.0, 2.2)
    ax.set_yticks([])
    ax.set_xlabel(f"element of the flattened tensor ({numel} elements)")
    ax.set_title(f"resharding {saved_by} → {loaded_by}: each rank reads only the files that overlap its range",
                 fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def resume_curves(uninterrupted: Sequence[float], first_attempt: Sequence[float], resumed: Sequence[float], *,
                  resumed_from: int, crashed_at: int, others: Mapping[str, Sequence[float]] | None = None) -> Figure:
    """Loss per step: the uninterrupted run (a line), the attempt that crashed after `crashed_at` steps and
    the run resumed from the checkpoint of step `resumed_from` (markers), plus `others` (label -> losses
    from step resumed_from + 1 on). Step s is the loss of the s-th step (1-based)."""
    fig, ax = plt.subplots(figsize=(7.5, 4))
    steps = range(1, len(uninterrupted) + 1)
    ax.plot(steps, uninterrupted, color="#BBBBBB", linewidth=5, label="uninterrupted run")
    ax.plot(range(1, len(first_attempt) + 1), first_attempt, "o", color=RANK_COLORS[0], markersize=4,
            label=f"first attempt (killed during step {crashed_at + 1})")
    after = range(resumed_from + 1, len(resumed) + 1)
    ax.plot(after, resumed[resumed_from:], "x", color=RANK_COLORS[1], markersize=6,
            label=f"resumed from the checkpoint of step {resumed_from}")
    for i, (label, losses) in enumerate((others or {}).items()):
        ax.plot(range(resumed_from + 1, resumed_from + 1 + len(losses)), losses, "+", markersize=7,
                color=RANK_COLORS[(i + 2) % len(RANK_COLORS)], label=label)
    ax.axvspan(resumed_from + 0.5, crashed_at + 0.5, color=CRASH_COLOR, alpha=0.12,
               label="steps computed twice (lost work)")
    ax.axvline(crashed_at + 0.5, color=CRASH_COLOR, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE, log scale)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
