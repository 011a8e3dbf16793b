"""Notebook 07's tests: coordinates on a mesh, the groups of an axis, the gradients of an EP x DP mesh, and the
planner's three parts.

`rank_to_coords`, `mesh_groups` and the planner are functions of plain values: the test calls them (many cases in
one request) and compares what comes back with values it computes itself. `reduce_moe_gradients` runs on ranks:
the test draws each rank's own gradients (a real rank holds nothing else), sends each rank only those, and checks
the result against the mean over every rank computed here, and that the ranks exchanged at least what that mean
needs, measured outside them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_parallel import checks, memory, models, planning
from cs336_parallel.testing.training import nbytes

# -- rank_to_coords and coords_to_rank ----------------------------------------------------------------------------


def grid_coords(shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Ground truth: where each rank sits in `torch.arange(N).view(shape)`, PyTorch's row-major layout."""
    grid = torch.arange(math.prod(shape)).view(tuple(shape))
    return [tuple(int(i) for i in (grid == rank).nonzero()[0]) for rank in range(grid.numel())]


def check_mesh(rank_to_coords: Callable, coords_to_rank: Callable, shape: Sequence[int]) -> None:
    """Every rank's coordinates (a tuple of ints), and back to the rank, each direction in one request."""
    expected = grid_coords(shape)
    for rank, got in enumerate(checks.call_each(rank_to_coords, [(rank, shape) for rank in range(len(expected))])):
        checks.count_comparison()
        plain = type(got) is tuple and all(type(c) is int for c in got)
        assert plain and got == expected[rank], (
            f"rank_to_coords({rank}, {shape}) = {got!r}, expected the tuple {expected[rank]}")
    for rank, back in enumerate(checks.call_each(coords_to_rank, [(coords, shape) for coords in expected])):
        checks.assert_number(back, rank, name=f"coords_to_rank({expected[rank]}, {shape})")


# -- mesh_groups ---------------------------------------------------------------------------------------------------


def expected_groups(sizes: Sequence[int], axis: int) -> list[list[int]]:
    """Ground truth, without tensors: for each rank whose coordinate along `axis` is 0, in rank order, the ranks
    that differ from it only along `axis`, in order of that coordinate."""
    sizes = list(sizes)
    stride = math.prod(sizes[axis + 1:])
    starts = [r for r in range(math.prod(sizes)) if (r // stride) % sizes[axis] == 0]
    return [[start + i * stride for i in range(sizes[axis])] for start in starts]


def check_groups(mesh_groups: Callable, cases: list[tuple]) -> None:
    """`mesh_groups(mesh, dim)` for every `(mesh, dim, expected)` of `cases`, in one request."""
    replies = checks.call_each(mesh_groups, [(mesh, dim) for mesh, dim, _ in cases])
    for (mesh, dim, want), got in zip(cases, replies, strict=True):
        checks.count_comparison()
        assert got == want, f"mesh_groups({mesh}, {dim!r}) = {got}, expected {want}"


# -- reduce_moe_gradients ----------------------------------------------------------------------------------------

# The shapes of the test's gradients: two dense weights, and one per expert (two experts on each rank of an ep
# group). Large enough that what the mean needs (tens of kB) stands well above the bytes that creating the dp groups
# sends between the ranks.
DENSE_SHAPES = ((48, 64), (320,))
EXPERT_SHAPE = (64, 48)
EXPERTS_PER_RANK = 2


def moe_gradients_driver(reduce_moe_gradients: Callable, dp: int, ep: int, dense: list[torch.Tensor],
                         experts: list[torch.Tensor]) -> dict:
    """On each rank of a dp x ep mesh (row-major: ranks d·ep ... d·ep + ep - 1 form an ep group): reduce this rank's
    own gradients (`dense` from its loss alone, `experts` already summed over its ep group) over the dp groups the
    mesh defines. The tensors passed in, after the call, and what the lists held then."""
    ranks = [[d * ep + e for d in range(dp)] for e in range(ep)]
    dp_groups = [dist.new_group(members) for members in ranks]  # every rank creates every group, in one order
    given = {"dense": list(dense), "experts": list(experts)}
    reduce_moe_gradients(dense, experts, dp_groups[dist.get_rank() % ep])
    return {"given": given, "lists": {"dense": dense, "experts": experts}}


def check_moe_gradients(reduce_moe_gradients: Callable, dp: int, ep: int, dtype: torch.dtype) -> None:
    """Draw what every rank's loss contributes to each dense weight and each expert; send rank r (at dp coordinate
    d, ep coordinate e) its own dense gradients and, for its experts, the sums over its ep group (what the
    all-to-all's backward leaves there). Ground truth: the gradients of the mean loss over all ranks, 1/world x
    the sum of every rank's contributions, in the tensors the rank passed in (in place)."""
    world, g = dp * ep, checks.generator()
    num_experts = EXPERTS_PER_RANK * ep
    dense = [[checks.random_tensor(shape, dtype, generator=g) for shape in DENSE_SHAPES] for _ in range(world)]
    contributions = [[checks.random_tensor(EXPERT_SHAPE, dtype, generator=g) for _ in range(num_experts)]
                     for _ in range(world)]

    def mine(rank: int) -> list[int]:
        e = rank % ep
        return list(range(EXPERTS_PER_RANK * e, EXPERTS_PER_RANK * (e + 1)))

    def ep_sum(rank: int, expert: int) -> torch.Tensor:
        d = rank // ep
        return torch.stack([contributions[r][expert] for r in range(d * ep, (d + 1) * ep)]).sum(0)

    per_rank = [(dense[r], [ep_sum(r, j) for j in mine(r)]) for r in range(world)]
    got = checks.run(world, moe_gradients_driver, reduce_moe_gradients, dp, ep, per_rank=per_rank)
    case = f"dp {dp} x ep {ep}, {dtype}"
    mean_dense = [torch.stack([dense[r][p] for r in range(world)]).sum(0) / world for p in range(len(DENSE_SHAPES))]
    for rank, result in enumerate(got):
        expected = {"dense": mean_dense,
                    "experts": [torch.stack([contributions[r][j] for r in range(world)]).sum(0) / world
                                for j in mine(rank)]}
        for kind, tensors in expected.items():
            for i, want in enumerate(tensors):
                _check_in_place(result, kind, i, want, rank, f"{kind} gradient {i} ({case})")
    # The dense mean needs the other ranks' dense gradients; an expert's, the other ep groups' sums (its dp group).
    needed = nbytes(mean_dense) * (world > 1) + nbytes(per_rank[0][1]) * (dp > 1)
    checks.assert_received(needed, f"reduce_moe_gradients, {case}")


def _check_in_place(result: dict, kind: str, i: int, want: torch.Tensor, rank: int, name: str) -> None:
    """The tensor the rank passed in holds `want` (float sums in another order: rtol 1e-5, atol 1e-6); a right value
    only in the list is named as such."""
    got, listed = result["given"][kind][i], result["lists"][kind][i]
    if isinstance(listed, torch.Tensor) and listed.shape == want.shape and not torch.equal(got, listed):
        checks.count_comparison()
        assert not torch.allclose(listed, want, rtol=1e-5, atol=1e-6), (
            f"rank {rank}: {name} is right in the list, but the tensor passed in is unchanged: reduce each gradient "
            "in place (the training loop reads p.grad, not your list)")
    checks.assert_close(got, want, name=name, rank=rank, rtol=1e-5, atol=1e-6)


# -- the planner ---------------------------------------------------------------------------------------------------

# A toy to plan by hand: Ψ = 48M, L = 8, h = 512, a = 8, s = 1024 on 16 GPUs (4 per node), BF16 Adam.
TOY = planning.ModelSpec("toy", num_params=48_000_000, num_layers=8, hidden=512, heads=8, seq_len=1024)
TOY_CLUSTER = planning.ClusterSpec("toy", num_gpus=16, gpus_per_node=4, gpu_memory_bytes=1e9, peak_flops=1e14,
                                   assumed_mfu=0.5, intra_node_bytes_per_s=100e9, inter_node_bytes_per_s=10e9,
                                   intra_node_latency_s=2e-6, inter_node_latency_s=2e-5)
TOY_LAYOUT = planning.Layout(dp=2, tp=4, pp=2, zero_stage=1, micro_batch=2, num_microbatches=4, recompute="selective")
# A toy mixture of experts: Ψ = 64M, of which Ψe = 48M in 8 experts, top-2, 28M used per token.
TOY_MOE = planning.ModelSpec("toy MoE", num_params=64_000_000, num_layers=4, hidden=256, heads=8, seq_len=512,
                             kv_heads=2, num_experts=8, expert_params=48_000_000, active_params=28_000_000, top_k=2)


def check_parts(exercise: Callable, cases: list[tuple]) -> None:
    """`exercise(*args)` for every `(case, args, expected)` of `cases`, in one request: a dict in which each key of
    `expected` holds a number (any kind) within a relative 1e-9 of its expected value."""
    results = checks.call_each(exercise, [args for _, args, _ in cases])
    for (case, _, expected), got in zip(cases, results, strict=True):
        checks.count_comparison()
        assert isinstance(got, dict), f"{case}: {exercise.__name__} returned a {type(got).__name__}, not a dict"
        for key, value in expected.items():
            assert key in got, f"{case}: {exercise.__name__} returned no {key!r} (its keys: {sorted(got)})"
            checks.assert_number(got[key], value, name=f"{case}: {key}", rel=1e-9, abs_=1e-15)


def alpha_beta_s(cluster: planning.ClusterSpec, op: str, nbytes: float, n: int, *, inside: bool) -> float:
    """A ring collective's time by hand (notebook 01) over n GPUs, inside a node (NVLink) or across nodes."""
    if n == 1:
        return 0.0
    alpha = cluster.intra_node_latency_s if inside else cluster.inter_node_latency_s
    beta = cluster.intra_node_bytes_per_s if inside else cluster.inter_node_bytes_per_s
    steps, share = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "send": (1, 1)}.get(op, (n - 1, (n - 1) / n))
    return steps * alpha + share * nbytes / beta


def measured_peak_bytes(dim: int, heads: int, batch: int, seq: int) -> int:
    """Peak tensor memory of training `models.TransformerBlock(dim, heads)` in this process (fp32, SGD with momentum,
    two steps), counted as a GPU counts it (`cs336_parallel.memory`)."""
    with memory.track("cpu") as mem:
        block = models.TransformerBlock(dim, heads, seed=0)
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            x = checks.random_tensor((batch, seq, dim), seed=step)
            optimizer.zero_grad()
            F.mse_loss(block(x), x).backward()
            optimizer.step()
    return mem.peak_bytes - mem.start_bytes
