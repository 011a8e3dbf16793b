"""Notebook 04's helpers: the check that compares the shards a tensor-parallel module's ranks report with the
unsplit module, the merged collective counts, and the pictures."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_parallel import Cluster, checks, probes, viz

COLUMNS = {"weight": 0, "bias": 0}  # a column split: both parameters cut along their first dimension
WHOLE = {"weight": None, "bias": None}


def shards_of(reference: nn.Linear, size: int, *, shift: int = 0) -> list[dict]:
    """What the ranks of a column split of `reference` report (rank r holds rows r of `size`; `shift` takes another
    rank's rows instead), after the same loss as the reference's."""
    x = torch.randn(3, reference.in_features, generator=torch.Generator().manual_seed(1))
    reference(x).sum().backward()
    result = []
    for r in range(size):
        part = nn.Linear(reference.in_features, reference.out_features // size)
        with torch.no_grad():
            part.weight.copy_(reference.weight.chunk(size, 0)[(r + shift) % size])
            part.bias.copy_(reference.bias.chunk(size, 0)[(r + shift) % size])
        part(x).sum().backward()
        result.append({name: {"value": p.detach(), "grad": p.grad} for name, p in part.named_parameters()})
    return result


def test_assert_shards_close_accepts_the_right_slices_and_names_a_wrong_one():
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    checks.assert_shards_close(shards_of(reference, 2), reference, COLUMNS)
    reference.zero_grad()
    with pytest.raises(AssertionError, match="rank 2: weight differs"):
        checks.assert_shards_close(shards_of(reference, 2, shift=1), reference, COLUMNS, ranks=[2, 3])


def test_replicated_gradients_are_summed_over_the_group_when_asked():
    """A whole parameter whose gradient each rank computed on its half of the batch: the sum is right."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    x = torch.randn(4, 4)
    reference(x).sum().backward()
    shards = []
    for half in x.chunk(2):
        part = nn.Linear(4, 2)
        part.load_state_dict(reference.state_dict())
        part(half).sum().backward()
        shards.append({name: {"value": p.detach(), "grad": p.grad} for name, p in part.named_parameters()})
    checks.assert_shards_close(shards, reference, WHOLE, sum_replicated_grads=True)
    with pytest.raises(AssertionError, match="weight.grad differs"):  # not summed: partial
        checks.assert_shards_close(shards, reference, WHOLE)


def test_parameter_names_and_shapes_must_match_the_reference():
    reference = nn.Sequential(nn.Linear(2, 4))
    split = {"0.weight": 0, "0.bias": 0}
    renamed = nn.Sequential(nn.Identity(), nn.Linear(2, 4))
    with pytest.raises(AssertionError, match="rank 0: the parameters are named"):
        checks.assert_shards_close([{n: {"value": p.detach(), "grad": None} for n, p in renamed.named_parameters()}],
                                   reference, split)
    quarter = {n: {"value": p.detach()[:1], "grad": None} for n, p in reference.named_parameters()}
    with pytest.raises(AssertionError, match=r"0.weight has shape \(1, 2\): it should be slice 0 of 2"):
        checks.assert_shards_close([quarter, quarter], reference, split)


def test_a_whole_weight_is_not_taken_for_a_shard():
    """The spec says which parameters are split: a rank that keeps the whole layer fails, even though a whole
    parameter would do for a replicated one."""
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    reference(torch.randn(3, 4)).sum().backward()
    whole = {name: {"value": p.detach(), "grad": p.grad} for name, p in reference.named_parameters()}
    with pytest.raises(AssertionError, match=r"weight has shape \(6, 4\): it should be slice 0 of 2"):
        checks.assert_shards_close([whole, whole], reference, COLUMNS)


def _counts() -> dict:
    x = torch.ones(4)
    out = torch.empty(4 * dist.get_world_size())
    with probes.count_collectives() as comm:
        dist.all_gather_single(out, x)
        dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size())], x)
        dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * dist.get_world_size()))
        dist.all_reduce(x)
    return checks.collective_counts(comm.record())


def test_collective_counts_merge_the_forms_of_a_collective():
    with Cluster(2, backend="gloo", timeout=60) as cluster:
        assert cluster.run(_counts)[0] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


@pytest.mark.parametrize("make, plot", [
    (lambda: viz.column_row_split(world_size=4), False),
    (lambda: viz.tp_block_flow(), False),
    (lambda: viz.ring_attention_steps(world_size=3, causal=False), False),
    (lambda: viz.tp_step_time_vs_bandwidth([1, 10, 100], {"t = 2": ([1e-3] * 3, [3e-3, 2e-3, 1e-3])}, {"link": 10}),
     True),
    (lambda: viz.activation_memory_chart({"TP": [(2e9, 1e9)] * 2}, {"TP": [4.0, 2.0]}, {"TP": [4.0, 2.0]}, [1, 2]),
     True),
])
def test_pictures_draw_and_plots_label_their_axes(make, plot):
    fig = make()
    try:
        assert fig.axes
        if plot:
            assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
    finally:
        plt.close(fig)
