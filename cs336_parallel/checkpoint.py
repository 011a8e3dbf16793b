"""The unit of notebook 08's sharded checkpoints: one rank's piece of a tensor.

A data type, not a checkpointer (`save_sharded` and `load_resharded` are the notebook's exercises). It lives in
the package so that the notebook, its answers and its tests share one `Shard`, and so that a loaded state is a
value a test can trust (`checks.plain` rebuilds the package's dataclasses from their fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)  # two shards compare by their tensors, never with ==
class Shard:
    """This rank's piece of a tensor of `shape`: elements [start, stop) of the flattened tensor, as a 1-D tensor
    `local`, where [start, stop) is the rank's range as `tensor_split` cuts `numel` elements over the ranks
    (the first numel % world_size ranks get one element more)."""

    local: torch.Tensor
    shape: tuple[int, ...]
