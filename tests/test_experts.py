"""The pictures of notebook 06 (mixture of experts): each returns a Figure, with labelled axes."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from cs336_parallel import viz  # noqa: E402


def test_host_timeline_draws_both_lanes_and_the_gpus_idle_share():
    import matplotlib.pyplot as plt

    spans = [{"lane": "CPU", "kind": "launch", "name": "launch", "start": 0, "end": 1},
             {"lane": "GPU", "kind": "kernel", "name": "counts", "start": 1, "end": 3},
             {"lane": "CPU", "kind": "wait", "name": "waits", "start": 1, "end": 3},
             {"lane": "CPU", "kind": "launch", "name": "launch", "start": 3, "end": 4},
             {"lane": "GPU", "kind": "kernel", "name": "rows", "start": 4, "end": 6}]
    fig = viz.host_timeline({"one layer": spans}, unit="launches")
    try:
        (ax,) = fig.axes
        assert ax.get_xlabel() == "time (launches)"
        assert [t.get_text() for t in ax.get_yticklabels()] == ["GPU", "CPU"]
        assert "idles 33% of 6 launches" in ax.get_title(loc="left")  # 4 of 6 units busy
    finally:
        plt.close(fig)
