"""Rows exchanged between ranks by an all-to-all inside autograd: how a mixture of experts sends tokens to their
experts and the results back (notebook 06 introduces it; notebook 07 runs it on a group of a mesh).

The backward of an all-to-all is the same all-to-all with the split sizes swapped: the gradient of a row that went
from rank s to rank r comes back from r to s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class AllToAll(torch.autograd.Function):
    """All-to-all of rows with uneven splits; backward sends every gradient row back where its row came from."""

    @staticmethod
    def forward(ctx, rows: Tensor, output_splits: list[int], input_splits: list[int],
                group: ProcessGroup | None) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None  # the routes, reversed


def all_to_all(rows: Tensor, output_splits: list[int], input_splits: list[int],
               group: ProcessGroup | None = None) -> Tensor:
    """Send input_splits[r] rows (in order) to rank r of `group`; receive output_splits[r] rows from rank r,
    concatenated in rank order. Differentiable."""
    return AllToAll.apply(rows, output_splits, input_splits, group)
