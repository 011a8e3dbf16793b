"""Megatron's tensor-parallel regions: collectives inside autograd, each with its conjugate in backward.

Notebook 04 introduces them; notebook 07 composes layers from them on a device mesh. The process group is an
argument, never a global (None: the default group):

| operator | forward | backward |
|---|---|---|
| `copy_to_tp_region` (f) | identity | all-reduce |
| `reduce_from_tp_region` (g) | all-reduce | identity |
| `gather_from_tp_region` | all-gather, last dim | keep my slice |
| `scatter_to_tp_region` | keep my slice, last dim | all-gather |
| `gather_from_sequence_parallel_region` | all-gather, dim 1 | reduce-scatter |
| `reduce_scatter_to_sequence_parallel_region` | reduce-scatter, dim 1 | all-gather |
| `send_to_next_rank` (a ring step) | send to rank r + 1 | send the gradient to rank r - 1 |

(Shoeybi et al. 2019, "Megatron-LM", section 3; Korthikanti et al. 2022 for the sequence-parallel pair; ring
attention's step, Liu et al. 2023, for context parallelism.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class CopyToRegion(torch.autograd.Function):
    """f: identity in forward; the gradient is summed over `group` (all-reduce) in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x.view_as(x)  # the same values, as a new node autograd can attach the backward to

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce into autograd's tensor
        dist.all_reduce(grad, group=ctx.group)
        return grad, None  # one slot per forward input


class ReduceFromRegion(torch.autograd.Function):
    """g: sum over `group` (all-reduce) in forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # never reduce into the caller's tensor
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def copy_to_tp_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """f (Megatron): identity in forward, all-reduce of the gradient in backward."""
    return CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """g (Megatron): all-reduce in forward, identity in backward."""
    return ReduceFromRegion.apply(x, group)


def _all_gather(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order."""
    n = dist.get_world_size(group)
    # A flat output: gloo refuses a stacked (n, *x.shape) one ("invalid tensor size"), which PyTorch's documentation
    # of all_gather_into_tensor (all_gather_single) allows and NCCL takes.
    flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_single(flat, x.reshape(-1), group=group)  # rank r's piece at [r * numel, (r+1) * numel)
    return torch.cat(flat.view(n, *x.shape).unbind(0), dim=dim)


def _my_slice(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's contiguous 1/n of `x` along `dim`."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"size {x.shape[dim]} of dim {dim} must be divisible by the group size {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


def _reduce_scatter(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """The sum over ranks of `x`, of which this rank keeps its 1/n along `dim`."""
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"size {x.shape[dim]} of dim {dim} must be divisible by the group size {n}")
    pieces = torch.stack(x.chunk(n, dim=dim))  # (n, ...): piece r goes to rank r
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out.view(-1), pieces.view(-1), group=group)
    return out


class _Gather(torch.autograd.Function):
    """All-gather along `dim` in forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _my_slice(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's slice along `dim` in forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _my_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherReduceScatter(torch.autograd.Function):
    """All-gather along `dim` in forward; reduce-scatter the gradient in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterGather(torch.autograd.Function):
    """Reduce-scatter along `dim` in forward; all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_from_tp_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """(..., d/n) on each rank -> (..., d) on every rank; backward keeps my slice."""
    return _Gather.apply(x, -1, group)


def scatter_to_tp_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """(..., d) -> my (..., d/n); backward all-gathers."""
    return _Scatter.apply(x, -1, group)


def gather_from_sequence_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """(B, T/n, D) sequence shards -> (B, T, D) on every rank; backward reduce-scatters."""
    return _GatherReduceScatter.apply(x, 1, group)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """(B, T, D) partial sums -> my (B, T/n, D) block of their sum; backward all-gathers."""
    return _ReduceScatterGather.apply(x, 1, group)


def shard(t: Tensor, dim: int, group: ProcessGroup | None = None) -> Tensor:
    """A copy of this rank's contiguous 1/n of `t` along `dim` (n = the size of `group`)."""
    return _my_slice(t.detach(), dim, group).clone()


# -- the ring step of context parallelism ------------------------------------------------------------------------

def _ring_exchange(x: Tensor, step: int, group: ProcessGroup | None) -> Tensor:
    """Send `x` to rank r + step and return what rank r - step sent (ranks within `group`)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=(r + step) % n),  # both at once: no deadlock
           dist.P2POp(dist.irecv, received, group=group, group_peer=(r - step) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class SendToNextRank(torch.autograd.Function):
    """Ring step: forward passes `x` to the next rank; backward passes the gradient to the previous one."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _ring_exchange(x, +1, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _ring_exchange(grad, -1, ctx.group), None


_ring_steps: list[list] = []  # the lists of `recording_ring_steps` blocks now open


def send_to_next_rank(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """Rank r's `x` goes to rank r + 1; returns rank r - 1's. Backward runs the ring the other way."""
    received = SendToNextRank.apply(x, group)
    for steps in _ring_steps:
        steps.append(received.grad_fn)
    return received


@contextmanager
def recording_ring_steps() -> Iterator[list]:
    """`with recording_ring_steps() as steps:`: the autograd node of each `send_to_next_rank` made in the block.

    Backward sends a block's gradient back only if the block was used: before it runs backward, a test checks that
    the ranks' outputs leave out the same steps, where one left out by one rank only would leave its neighbour
    waiting forever."""
    steps: list = []
    _ring_steps.append(steps)
    try:
        yield steps
    finally:
        _ring_steps.remove(steps)
