"""The package's collectives inside autograd: Megatron's regions (`regions`) and the all-to-all of rows
(`exchange`), each checked on ranks against the same computation done in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cs336_parallel import Cluster


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, backend="gloo", timeout=60) as c:
        yield c


def _regions_on_a_group() -> dict:
    """On the group of this rank's pair ({0, 1} or {2, 3}): each operator's forward value and the gradient it
    sends back, for a loss that weighs each rank's output by (its rank in the pair + 1)."""
    from cs336_parallel import regions

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    group, me = pairs[rank // 2], rank % 2
    results = {}
    for name in ("copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region", "scatter_to_tp_region",
                 "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region"):
        x = (torch.arange(8.0).view(1, 2, 4) + 10 * rank).requires_grad_()
        y = getattr(regions, name)(x, group)
        (y * (me + 1)).sum().backward()
        results[name] = (y.detach(), x.grad)
    results["shard"] = regions.shard(torch.arange(6.0).view(2, 3), 0, group)
    return results


def test_each_region_does_its_collective_in_forward_and_its_conjugate_in_backward(cluster):
    for rank, got in enumerate(cluster.run(_regions_on_a_group)):
        me, partner = rank % 2, rank - rank % 2 + 1 - rank % 2
        xs = {r: torch.arange(8.0).view(1, 2, 4) + 10 * r for r in (rank, partner)}
        pair = [xs[r] for r in sorted(xs)]
        weight_sum = torch.full((1, 2, 4), 3.0)  # both ranks' weights, 1 + 2
        expected = {
            "copy_to_tp_region": (xs[rank], weight_sum),
            "reduce_from_tp_region": (pair[0] + pair[1], torch.full((1, 2, 4), me + 1.0)),
            "gather_from_tp_region": (torch.cat(pair, dim=-1), torch.full((1, 2, 4), me + 1.0)),
            "scatter_to_tp_region": (xs[rank].chunk(2, -1)[me],
                                     torch.cat([torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 2.0)], -1)),
            "gather_from_sequence_parallel_region": (torch.cat(pair, dim=1), weight_sum),
            "reduce_scatter_to_sequence_parallel_region": ((pair[0] + pair[1]).chunk(2, 1)[me],
                                                           torch.cat([torch.full((1, 1, 4), 1.0),
                                                                      torch.full((1, 1, 4), 2.0)], 1)),
        }
        for name, (value, grad) in expected.items():
            assert torch.equal(got[name][0], value), (rank, name, "forward")
            assert torch.equal(got[name][1], grad), (rank, name, "backward")
        assert torch.equal(got["shard"], torch.arange(6.0).view(2, 3)[me:me + 1])


def _exchange_rows() -> dict:
    """Rank r sends r + 1 rows to each rank (rows tagged 100 r + destination), then a loss weighs the received rows
    by (receiver + 1): each sent row's gradient must be its receiver's weight."""
    from cs336_parallel.exchange import all_to_all

    n, r = dist.get_world_size(), dist.get_rank()
    rows = torch.cat([torch.full((r + 1, 2), 100.0 * r + d) for d in range(n)]).requires_grad_()
    received = all_to_all(rows, output_splits=[s + 1 for s in range(n)], input_splits=[r + 1] * n)
    (received * (r + 1)).sum().backward()
    return {"received": received.detach(), "grad": rows.grad}


def test_all_to_all_delivers_rows_in_rank_order_and_returns_their_gradients(cluster):
    for r, got in enumerate(cluster.run(_exchange_rows)):
        expected = torch.cat([torch.full((s + 1, 2), 100.0 * s + r) for s in range(4)])
        assert torch.equal(got["received"], expected), r
        assert torch.equal(got["grad"], torch.cat([torch.full((r + 1, 2), d + 1.0) for d in range(4)])), r


def _ring_steps() -> dict:
    """Rank r passes a tensor of r's to the next rank twice (recording the steps), and a loss weighs what arrives by
    (r + 1): each rank gets rank r - 1's, then r - 2's, and its own tensor's gradient is the weight of the rank two
    ahead; only the second step's output is used directly, but both steps are in its graph."""
    from cs336_parallel.regions import recording_ring_steps, send_to_next_rank

    r = dist.get_rank()
    x = torch.full((3,), float(r), requires_grad=True)
    with recording_ring_steps() as steps:
        once = send_to_next_rank(x)
        twice = send_to_next_rank(once)
    (twice * (r + 1)).sum().backward()
    return {"once": once.detach(), "twice": twice.detach(), "grad": x.grad, "steps": len(steps),
            "recorded": [step is node for step, node in zip(steps, (once.grad_fn, twice.grad_fn), strict=True)]}


def test_send_to_next_rank_passes_around_the_ring_and_its_gradient_back(cluster):
    for r, got in enumerate(cluster.run(_ring_steps)):
        assert torch.equal(got["once"], torch.full((3,), float((r - 1) % 4))), r
        assert torch.equal(got["twice"], torch.full((3,), float((r - 2) % 4))), r
        assert torch.equal(got["grad"], torch.full((3,), (r + 2) % 4 + 1.0)), r
        assert got["steps"] == 2 and all(got["recorded"]), r
