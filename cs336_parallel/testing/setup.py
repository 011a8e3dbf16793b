"""Notebook 00's tests: `shard_range`, one rank's share of n items.

The ground truth is torch's own split (`torch.tensor_split`), or the same rule in integers where n is too large
for a tensor. Each bound may come back as any kind of integer-valued number (int, numpy integer, a float or
Fraction that equals it), as a tuple or a list."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cs336_parallel import checks

LARGEST_SPLIT_TENSOR = 10**6  # items: beyond this the ground truth splits in integers rather than with a tensor


def expected_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Ground truth: torch.tensor_split's split of n items (too many for a tensor: the same rule in integers)."""
    if n <= LARGEST_SPLIT_TENSOR:
        sizes = [len(piece) for piece in torch.arange(n).tensor_split(world_size)]
    else:
        sizes = [n // world_size + (r < n % world_size) for r in range(world_size)]
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def assert_range(got, call: str, expected: tuple[int, int]) -> None:
    """`got` is a (start, stop) pair, a tuple or a list, of numbers (any kind) equal to `expected`."""
    checks.count_comparison()
    pair = isinstance(got, (tuple, list)) and len(got) == 2
    if not (pair and all(checks.is_number(v) and v == w for v, w in zip(got, expected, strict=True))):
        raise AssertionError(f"{call} returned {got!r}, expected {expected}")


def check_ranges(shard_range, cases: list) -> None:
    """shard_range(n, rank, world_size) for every rank of each (n, world_size) of `cases`, in one request."""
    calls = [(n, rank, world_size) for n, world_size in cases for rank in range(world_size)]
    for call, got in zip(calls, checks.call_each(shard_range, calls), strict=True):
        assert_range(got, f"shard_range{call}", expected_range(*call))


def my_range(shard_range, n: int):
    """On a rank: this rank's share of n items, from its own rank and world size."""
    return shard_range(n, dist.get_rank(), dist.get_world_size())


def check_on_ranks(shard_range, world_size: int, n: int) -> None:
    """On `world_size` ranks, each asks for its own share: together they cover 0 .. n in order."""
    for rank, got in enumerate(checks.run(world_size, my_range, shard_range, n)):
        assert_range(got, f"on {world_size} ranks, rank {rank}'s shard_range({n}, {rank}, {world_size})",
                     expected_range(n, rank, world_size))
