"""Notebook 09's pictures: the roofline, data parallelism's crossover, its compute/communication ratio at scale."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from cs336_parallel import viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_roofline_draws_one_roof_per_bandwidth_flat_at_the_peak_with_its_ridge_point():
    fig = viz.roofline([{"title": "chip", "peak_flops": 100.0, "bandwidths": {"fast": 50.0, "slow": 2.0},
                         "points": [("a kernel", 1.0, 2.0)]},
                        {"title": "other", "peak_flops": 10.0, "bandwidths": {"memory": 5.0}}])
    left, right = fig.axes
    roofs = [line for line in left.get_lines() if line.get_label() and not line.get_label().startswith("_")]
    assert [line.get_label() for line in roofs] == ["fast: ridge at 2 FLOPs/byte", "slow: ridge at 50 FLOPs/byte"]
    for roof, bandwidth in zip(roofs, (50.0, 2.0), strict=True):
        xs, ys = roof.get_data()
        assert max(ys) == pytest.approx(100.0)  # flat at the peak beyond the ridge
        assert ys[0] == pytest.approx(xs[0] * bandwidth)  # the slope below it
    ridges = [tuple(line.get_data()) for line in left.get_lines() if line.get_marker() == "o"]
    assert ridges == [([2.0], [100.0]), ([50.0], [100.0])]
    points = [tuple(line.get_data()) for line in left.get_lines() if line.get_marker() == "s"]
    assert points == [([1.0], [2.0])] and [t.get_text() for t in left.texts] == ["a kernel"]
    assert left.get_xscale() == left.get_yscale() == "log" and right.get_title() == "other"


def test_dp_crossover_shows_medians_with_their_spread_and_both_crossovers():
    measured = {"batches": [1, 2, 4], "compute_s": [[1e-3, 3e-3, 2e-3], [2e-3], [3e-3, 5e-3]],
                "comm_s": [[5e-3], [5e-3, 7e-3, 6e-3], [5e-3]], "crossover": 3.0, "predicted": 2.5, "title": "here"}
    model = {"batches": [10, 100], "compute_s": [1e-3, 1e-2], "comm_s": [5e-3, 5e-3], "crossover": 50.0,
             "title": "model"}
    fig = viz.dp_crossover(measured, model)
    left, right = fig.axes
    errorbars = left.containers
    compute_line = errorbars[0].lines[0]
    assert list(compute_line.get_ydata()) == pytest.approx([2.0, 2.0, 4.0])  # medians, in ms
    assert list(errorbars[1].lines[0].get_ydata()) == pytest.approx([5.0, 6.0, 5.0])
    bars = [y for seg in errorbars[0].lines[2][0].get_segments() for y in (seg[0][1], seg[1][1])]
    assert bars == pytest.approx([1.0, 3.0, 2.0, 2.0, 3.0, 5.0])  # from the lowest repeat to the highest
    labels = [line.get_label() for line in left.get_lines()]
    assert "crossover: 3" in labels and "predicted: 2.5" in labels
    assert "crossover: 50" in [line.get_label() for line in right.get_lines()]
    assert "predicted" not in " ".join(line.get_label() for line in right.get_lines())
    assert len(viz.dp_crossover(measured).axes) == 1  # the model's panel is optional


def test_dp_ratio_vs_gpus_marks_each_layouts_last_point_and_the_line_of_equality():
    fig = viz.dp_ratio_vs_gpus({"DP": ([8, 16, 32], [4.0, 2.0, 1.0]), "TP": ([64, 128], [3.0, 0.5])},
                               mark_gpus=128, end_label="one sequence per replica")
    (ax,) = fig.axes
    ends = [tuple(line.get_data()) for line in ax.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert ends == [([32], [1.0]), ([128], [0.5])]
    labels = [line.get_label() for line in ax.get_lines()]
    assert {"DP", "TP", "one sequence per replica", "computation = all-reduce", "128 GPUs"} <= set(labels)
    equality = next(line for line in ax.get_lines() if line.get_label() == "computation = all-reduce")
    assert list(equality.get_ydata()) == [1.0, 1.0]
