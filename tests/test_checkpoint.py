"""The pictures of notebook 08 (failures, the Young/Daly trade-off, the save protocol, resharding, resumed
runs): each returns a Figure, with labelled axes where there are axes to read."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("matplotlib")

from cs336_parallel import viz  # noqa: E402
from cs336_parallel.viz.checkpoint import _ranges  # noqa: E402


def test_ranges_are_tensor_splits():
    import torch

    for numel in (0, 1, 7, 1070):
        for n in (1, 2, 3, 4, 5):
            sizes = [stop - start for start, stop in _ranges(numel, n)]
            assert sizes == [len(p) for p in torch.arange(numel).tensor_split(n)]
            assert _ranges(numel, n)[0][0] == 0 and _ranges(numel, n)[-1][1] == numel


@pytest.mark.parametrize("make, labelled", [
    (lambda: viz.mtbf_vs_gpus(24 * 365 * 16, observed={"Llama 3": (16384, 8.76)}), True),
    (lambda: viz.young_daly(60, {"16K GPUs": 8.76, "1K GPUs": 140}, restart_s=30), True),
    (lambda: viz.save_protocol(world_size=3, crashed_rank=1), False),
    (lambda: viz.reshard_map(1070, saved_by=4, loaded_by=3), True),
    (lambda: viz.reshard_map(5, saved_by=2, loaded_by=7), True),
    (lambda: viz.resume_curves([math.exp(-s / 10) for s in range(40)], [math.exp(-s / 10) for s in range(25)],
                               [math.exp(-s / 10) for s in range(40)], resumed_from=20, crashed_at=25,
                               others={"2 ranks": [math.exp(-s / 10) for s in range(20, 40)]}), True),
])
def test_each_picture_is_a_figure(make, labelled):
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    fig = make()
    try:
        assert isinstance(fig, Figure)
        if labelled:
            assert all(ax.get_xlabel() for ax in fig.axes)
    finally:
        plt.close(fig)
