"""Regenerate the pictures the READMEs show: `.venv/bin/python docs/figures.py`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from cs336_parallel import viz  # noqa: E402

HERE = Path(__file__).parent


def _box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="0.3"))
    ax.text(x + 0.02, y + h - 0.05, title, fontsize=10, weight="bold", va="top")
    for i, line in enumerate(lines):
        ax.text(x + 0.03, y + h - 0.14 - 0.075 * i, line, fontsize=9, va="top")


def trust_boundary() -> plt.Figure:
    """The grader's process and the sandbox: what lives where, and what crosses (grading/README.md)."""
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.set_xlim(0, 2.7)
    ax.set_ylim(0, 1)
    ax.axis("off")
    _box(ax, 0.02, 0.06, 0.92, 0.88, "the grader's process (the instructor's)", [
        "executes the notebook (nbclient), cell by cell",
        "runs the course's test cells, visible and hidden",
        "computes every expected value and compares",
        "reads the sandbox's loopback bytes from /proc",
        "writes the gradebook, the feedback, the report"], "#dbe9f6")
    _box(ax, 1.66, 0.06, 1.0, 0.88, "the sandbox (bubblewrap): student code", [
        "the kernel: the answers and every other cell",
        "drivers of %%test_helpers cells: call the exercise,",
        "    report what happened as plain data",
        "test ranks: gloo over the sandbox's own loopback",
        "no test code, no expected value, no network out"], "#fde2d6")
    middle = 1.3
    for y, text, start, end in [(0.66, "request:\nnames + plain data\n(%cs336_call)", 0.96, 1.64),
                                (0.3, "reply: plain data,\nread with torch.load\n(weights_only=True)", 1.64, 0.96)]:
        ax.add_patch(FancyArrowPatch((start, y), (end, y), arrowstyle="-|>", mutation_scale=18, color="0.2"))
        ax.text(middle, y + 0.04, text, ha="center", va="bottom", fontsize=8.5)
    ax.plot([middle, middle], [0.0, 0.2], ls="--", color="0.4")
    ax.text(middle, 0.1, "  the trust boundary", ha="left", va="center", fontsize=9, style="italic", color="0.3")
    return fig


if __name__ == "__main__":
    viz.collectives_gallery(world_size=4).savefig(HERE / "collectives.png", dpi=72)
    trust_boundary().savefig(HERE / "trust_boundary.png", dpi=80, bbox_inches="tight")
    print(f"wrote {HERE / 'collectives.png'} and {HERE / 'trust_boundary.png'}")
