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
    """The grader's process and the two sandboxes: what lives where, what crosses, what is measured from outside
    (grading/README.md)."""
    fig, ax = plt.subplots(figsize=(13, 5.4))
    ax.set_xlim(0, 2.9)
    ax.set_ylim(0, 1.4)
    ax.axis("off")
    _box(ax, 0.02, 0.08, 0.88, 1.26, "the grader's process (the instructor's)", [
        "executes the notebook (nbclient), cell by cell",
        "runs the course's test cells, hidden ones too,",
        "    with the package's test code",
        "draws each test's data from seeds it keeps",
        "computes every expected value and compares",
        "measures from outside the ranks: bytes per",
        "    rank pair (TCP_INFO), peak memory (cgroup)",
        "writes the gradebook, the feedback, the report"], "#dbe9f6")
    _box(ax, 2.0, 0.78, 0.88, 0.56, "sandbox 1: the notebook's kernel", [
        "the answers, and every other cell",
        "of the student's; no test code, no",
        "test data, no expected value"], "#fde2d6")
    _box(ax, 2.0, 0.08, 0.88, 0.56, "sandbox 2: the grader's test ranks", [
        "a relay that runs no student code;",
        "rank r: a driver, the exercise and",
        "its own share of the data, nothing else"], "#fde2d6")
    arrows = [(1.2, "requests: names and plain data", 0.93, 1.97),
              (1.01, "replies: plain data, rebuilt from a short list of\ntypes, within the output limit", 1.97,
               0.93),
              (0.86, "the exercise, pickled (never unpickled here)", 1.97, 0.93),
              (0.46, "rank r: its own share of the data, the exercise", 0.93, 1.97),
              (0.25, "one plain result per rank", 1.97, 0.93)]
    for y, text, start, end in arrows:
        ax.add_patch(FancyArrowPatch((start, y), (end, y), arrowstyle="-|>", mutation_scale=16, color="0.2"))
        ax.text(1.45, y + 0.02, text, ha="center", va="bottom", fontsize=8.5)
    ax.plot([1.45, 1.45], [0.0, 0.16], ls="--", color="0.4")
    ax.text(1.45, 0.08, "  the trust boundary", ha="left", va="center", fontsize=9, style="italic", color="0.3")
    return fig


if __name__ == "__main__":
    viz.collectives_gallery(world_size=4).savefig(HERE / "collectives.png", dpi=72)
    trust_boundary().savefig(HERE / "trust_boundary.png", dpi=80, bbox_inches="tight")
    print(f"wrote {HERE / 'collectives.png'} and {HERE / 'trust_boundary.png'}")
