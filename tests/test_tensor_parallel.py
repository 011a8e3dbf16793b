"""Notebook 04's helpers: the checks that compare a tensor-parallel module's shards with the unsplit module,
the merged collective counts, and the pictures."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_parallel import checks, session_cluster, viz


def _column_shards(shift: int, sum_replicated_grads: bool) -> None:
    """A column split of nn.Linear (rank r holds rows r of 2), its gradients from the same loss; `shift`
    takes another rank's rows instead, which assert_shards_close must catch."""
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Linear(4, 6)
    part = nn.Linear(4, 6 // n)
    mine = (r + shift) % n
    with torch.no_grad():
        part.weight.copy_(reference.weight.chunk(n, 0)[mine])
        part.bias.copy_(reference.bias.chunk(n, 0)[mine])
    x = torch.randn(3, 4)
    reference(x).sum().backward()
    part(x).sum().backward()
    checks.assert_shards_close(part, reference, sum_replicated_grads=sum_replicated_grads)


def _replicated_partial_grads() -> None:
    """A whole parameter whose gradient each rank computed on its half of the batch: the sum is right."""
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Linear(4, 2)
    part = nn.Linear(4, 2)
    part.load_state_dict(reference.state_dict())
    x = torch.randn(4, 4)
    reference(x).sum().backward()
    part(x.chunk(n, 0)[r]).sum().backward()
    checks.assert_shards_close(part, reference, sum_replicated_grads=True)
    checks.assert_raises(AssertionError, checks.assert_shards_close, part, reference)  # not summed: partial


def _renamed() -> None:
    reference = nn.Sequential(nn.Linear(2, 2))
    checks.assert_raises(AssertionError, checks.assert_shards_close, nn.Sequential(nn.Identity(), nn.Linear(2, 2)),
                         reference)


def _counts() -> dict:
    x = torch.ones(4)
    out = torch.empty(4 * dist.get_world_size())
    with checks.count_collectives() as comm:
        dist.all_gather_single(out, x)
        dist.all_gather([torch.empty(4) for _ in range(dist.get_world_size())], x)
        dist.reduce_scatter_single(torch.empty(2), torch.ones(2 * dist.get_world_size()))
        dist.all_reduce(x)
    return checks.collective_counts(comm)


def on_two_ranks(fn, *args) -> list:
    return session_cluster(2, backend="gloo").run(fn, *args)


def test_assert_shards_close_accepts_the_right_slices_and_names_a_wrong_one():
    assert on_two_ranks(_column_shards, 0, False) == [None, None]
    with pytest.raises(Exception, match="weight differs"):
        on_two_ranks(_column_shards, 1, False)


def test_replicated_gradients_are_summed_over_the_group_when_asked():
    assert on_two_ranks(_replicated_partial_grads) == [None, None]


def test_parameter_names_must_match_the_reference():
    assert on_two_ranks(_renamed) == [None, None]


def test_collective_counts_merge_the_forms_of_a_collective():
    assert on_two_ranks(_counts)[0] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


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
