"""cs336_parallel.trace records compute and communication spans; viz.memory draws them and memory bars."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cs336_parallel import session_cluster, trace


def _traced_step() -> list[dict]:
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64)
    out = torch.empty(2 * 64 * 64)
    dist.barrier()
    with trace.record() as tr:
        loss = (x @ w).square().mean()
        work = dist.all_gather_single(out, w.detach().reshape(-1), async_op=True)
        loss.backward()
        work.wait()
        grad = w.grad.clone()
        dist.reduce_scatter_single(torch.empty(32 * 64), grad.reshape(-1))  # gloo: a work without a future
        dist.all_reduce(grad)
    return tr.as_dicts()


def test_spans_name_forward_backward_and_each_collective_in_order():
    for spans in session_cluster(2, backend="gloo").run(_traced_step):
        compute = [s["name"] for s in spans if s["lane"] == "compute"]
        comm = [s["name"] for s in spans if s["lane"] == "comm"]
        assert compute[0] == "forward" and "backward" in compute, compute
        assert comm == ["all_gather", "reduce_scatter", "all_reduce"], comm
        assert all(0 <= s["start_s"] <= s["end_s"] for s in spans)
        assert [s["start_s"] for s in spans] == sorted(s["start_s"] for s in spans)
        reduce_scatter = next(s for s in spans if s["name"] == "reduce_scatter")
        all_reduce = next(s for s in spans if s["name"] == "all_reduce")
        assert reduce_scatter["end_s"] <= all_reduce["start_s"] + 1e-3  # a synchronous call ends by the next op


def test_figures_have_labelled_axes():
    import matplotlib

    matplotlib.use("Agg")
    from cs336_parallel import viz

    spans = [{"lane": "compute", "name": "forward", "start_s": 0.0, "end_s": 0.01},
             {"lane": "comm", "name": "all_gather", "start_s": 0.0, "end_s": 0.02},
             {"lane": "comm", "name": "reduce_scatter", "start_s": 0.01, "end_s": 0.03}]
    fig = viz.fsdp_timeline({"prefetch=False": [spans, spans]})
    assert fig.axes[0].get_xlabel() == "time since the step began (ms)"
    bars = viz.zero_memory_bars([2, 4], {"DDP": [4e3, 4e3], "ZeRO-3": [2e3, 1e3]},
                                measured={"DDP": [4e3, 4e3], "ZeRO-3": [2e3, 1e3]},
                                peaks={"DDP": [5e3, 5e3], "ZeRO-3": [3e3, 2e3]}, unit="KB")
    assert bars.axes[0].get_ylabel() == "memory per rank (KB)" and bars.axes[0].get_xlabel()
