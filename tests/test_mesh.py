"""Notebook 07's package pieces: the mesh, plan and layout pictures, the layout explorer, and the notebook's
training function launched under torchrun by `python -m cs336_parallel.run`."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from common import ROOT

MASTER = ROOT / "grading/source/07_4d_parallelism/07_4d_parallelism.ipynb"


@pytest.fixture(autouse=True)
def _agg():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")


def row_major_groups(shape: dict[str, int], axis: str) -> list[list[int]]:
    """The groups of `axis`, written out without tensors: ranks that agree on every other coordinate."""
    sizes, names = list(shape.values()), list(shape)
    k = names.index(axis)
    stride = math.prod(sizes[k + 1:])
    starts = [r for r in range(math.prod(sizes)) if (r // stride) % sizes[k] == 0]
    return [[start + i * stride for i in range(sizes[k])] for start in starts]


def test_mesh_diagram_draws_one_row_per_axis_and_says_which_links_it_crosses():
    import matplotlib.pyplot as plt

    from cs336_parallel import viz

    shape = {"dp": 2, "pp": 2, "tp": 2}
    groups = {axis: row_major_groups(shape, axis) for axis in shape}
    assert groups["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    fig = viz.mesh_diagram(shape, groups, gpus_per_node=2)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert len(titles) == 3
    assert titles[0].startswith("dp = 2: 4 groups of 2, across nodes")
    assert titles[1].startswith("pp = 2: 4 groups of 2, across nodes")
    assert titles[2].startswith("tp = 2: 4 groups of 2, inside a node")
    styles = [[line.get_linestyle() for line in ax.get_lines() if line.get_linewidth() == 3] for ax in fig.axes]
    assert styles == [["--"] * 4, ["--"] * 4, ["-"] * 4]  # one bar per group; dashed where it crosses nodes
    plt.close(fig)
    wide = viz.mesh_diagram(shape, groups, gpus_per_node=4)  # pp now stays inside a node
    assert "inside a node" in wide.axes[1].get_title(loc="left")
    plt.close(wide)
    with pytest.raises(ValueError, match="gpus_per_node"):
        viz.mesh_diagram(shape, groups, gpus_per_node=0)


def fake_plan(*, fits: bool = True, total_gb: float = 60.0, mfu: float = 0.4) -> SimpleNamespace:
    quarter = total_gb * 1e9 / 4
    return SimpleNamespace(params_bytes=quarter, grads_bytes=quarter, optimizer_bytes=quarter,
                           activations_bytes=quarter, total_bytes=4 * quarter, memory_limit_bytes=80e9, fits=fits,
                           compute_s=5.0,
                           bubble_s=1.0, comm_s={"tp": 0.5, "cp": 0.0, "ep": 0.0, "pp": 0.1, "dp": 0.0},
                           step_s=6.6, mfu=mfu)


def test_plan_breakdown_stacks_memory_and_time_with_units():
    import matplotlib.pyplot as plt

    from cs336_parallel import viz

    fig = viz.plan_breakdown({"fits": fake_plan(), "too big": fake_plan(fits=False, total_gb=1000)}, title="t")
    memory_ax, time_ax = fig.axes
    assert memory_ax.get_xlabel() == "memory per GPU (GB)" and time_ax.get_xlabel() == "time per optimizer step (s)"
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "60.0 GB, fits" in texts and "1,000.0 GB, does not fit (clipped)" in texts
    assert "6.60 s, MFU 40%" in texts and "  does not fit" in texts
    legend = [t.get_text() for t in time_ax.get_legend().get_texts()]
    assert legend == ["compute", "bubble", "tp communication (exposed)", "pp communication (exposed)"]
    assert memory_ax.get_xlim()[1] < 1000  # the plan that does not fit is clipped, not squashing the others
    plt.close(fig)
    unjudged = viz.plan_breakdown({"fits": fake_plan(), "unknown": fake_plan(fits=False, total_gb=90)},
                                  unjudged=["unknown"])
    texts = [t.get_text() for ax in unjudged.axes for t in ax.texts]
    assert "90.0 GB, not judged" in texts and texts.count("6.60 s, MFU 40%") == 2  # and its time is drawn
    plt.close(unjudged)


def test_best_layout_heatmap_names_the_layout_or_says_nothing_fits():
    import matplotlib.pyplot as plt

    from cs336_parallel import viz

    cells = [{"model": "8B", "gpus": 8, "label": "TP1 PP1\nDP8", "mfu": 0.5},
             {"model": "8B", "gpus": 64, "label": "TP1 PP1\nDP64", "mfu": 0.45},
             {"model": "405B", "gpus": 8, "label": None, "mfu": None},
             {"model": "405B", "gpus": 64, "label": "TP8 PP8\nDP1", "mfu": 0.2}]
    fig = viz.best_layout_heatmap(cells)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "number of GPUs" and ax.get_ylabel() == "model"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "64"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["8B", "405B"]
    assert sorted(t.get_text() for t in ax.texts) == sorted(["TP1 PP1\nDP8\n50%", "TP1 PP1\nDP64\n45%",
                                                             "nothing fits", "TP8 PP8\nDP1\n20%"])
    assert "MFU" in fig.axes[1].get_ylabel()  # the colour bar
    plt.close(fig)


@dataclass(frozen=True)
class ToyLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    num_microbatches: int = 1
    virtual_stages: int = 1
    recompute: str = "selective"
    extra: dict = field(default_factory=dict)


def toy_planner(model, cluster, layout):
    if model.heads % layout.tp:
        raise ValueError(f"heads ({model.heads}) must be divisible by tp ({layout.tp})")
    plan = fake_plan(total_gb=model.gb / (layout.tp * layout.pp))
    plan.layout, plan.fits = layout, plan.params_bytes * 4 <= plan.memory_limit_bytes
    return plan


def test_layout_explorer_plans_the_layout_it_is_set_to():
    pytest.importorskip("ipywidgets")
    from cs336_parallel.widgets import LayoutExplorer

    models = {"big": SimpleNamespace(heads=8, gb=800.0), "odd": SimpleNamespace(heads=6, gb=10.0)}
    clusters = {"64 GPUs": SimpleNamespace(num_gpus=64, assumed_mfu=0.5)}
    explorer = LayoutExplorer(toy_planner, ToyLayout, models, clusters, initial={"tp": 8, "pp": 2})
    assert explorer.plan.layout == ToyLayout(dp=4, tp=8, pp=2, zero_stage=1, num_microbatches=16)
    assert "fits" in explorer.summary.value and "dp = 4" in explorer.summary.value
    assert bytes(explorer.picture.value[:4]) == b"\x89PNG"  # a PNG in an Image widget (no Output widget)
    explorer.controls["pp"].value = 1  # 800 GB / 8: does not fit
    assert explorer.plan.layout.dp == 8 and not explorer.plan.fits
    assert "does not fit" in explorer.summary.value
    explorer.controls["model"].value = "odd"  # 6 heads on tp = 8: the planner's error is shown
    assert explorer.plan is None and "heads (6) must be divisible by tp (8)" in explorer.summary.value
    assert explorer.picture.layout.display == "none"
    explorer.controls["tp"].value = 2
    explorer.controls["pp"].value = 32
    explorer.controls["cp"].value = 2  # 2 x 32 x 2 = 128 does not divide 64 GPUs
    assert explorer.plan is None and "does not divide" in explorer.error
    with pytest.raises(ValueError, match="at least one"):
        LayoutExplorer(toy_planner, ToyLayout, {}, clusters)


def test_the_notebooks_training_function_runs_under_torchrun():
    """`python -m cs336_parallel.run` loads train_on_mesh (and the mesh and TP pieces it needs) from the
    master notebook's definition cells and runs it on 2 ranks: dp = 1, tp = 2."""
    done = subprocess.run([sys.executable, "-m", "cs336_parallel.run", "--nproc-per-node", "2",
                           f"{MASTER}:train_on_mesh"], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("[rank"))
    expected = ["[rank 0] 'tp slice 0, peak tensor memory", "[rank 1] 'tp slice 1, peak tensor memory"]
    assert [line[:40] for line in lines] == expected, done.stdout


def test_the_master_planner_reproduces_the_frontier_verdicts():
    """The master notebook's planner, loaded from its definition cells: Llama 3 405B's published layout
    fits in 80 GB (by hand: 2 bytes x 405e9/128 weights, ZeRO-2 over 128, 34 s b h / t activations for
    126 layers), the same model without tensor or pipeline parallelism does not."""
    from cs336_parallel.notebook import load_definitions

    ns = load_definitions(MASTER, ["plan_parallelism", "ModelSpec", "ClusterSpec", "Layout"])
    llama = ns["ModelSpec"]("Llama 3 405B", 405e9, 126, 16384, 128, 8192, kv_heads=8)
    h100s = ns["ClusterSpec"]("16,384 H100", num_gpus=16384)
    published = ns["plan_parallelism"](llama, h100s, ns["Layout"](dp=128, tp=8, pp=16, zero_stage=2,
                                                                   num_microbatches=16, virtual_stages=4))
    weights = 405e9 / 128
    by_hand = 2 * weights + 14 * weights / 128 + 34 * 8192 * 16384 / 8 * 126
    assert published.fits and published.total_bytes == pytest.approx(by_hand, rel=1e-12)
    assert 0.38 <= published.mfu <= 0.43  # the reported band, with the notebook's assumptions
    flat = ns["plan_parallelism"](llama, h100s, ns["Layout"](dp=16384, zero_stage=2))
    assert not flat.fits and flat.params_bytes == pytest.approx(810e9)
    with pytest.raises(ValueError, match="heads"):
        ns["plan_parallelism"](llama, ns["ClusterSpec"]("6 GPUs", num_gpus=6), ns["Layout"](tp=6))
