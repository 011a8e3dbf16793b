"""Training under test, shared by the notebooks on data parallelism and sharding (02, 03): the test draws the
initial weights and the batches, each rank trains on its own rows only, and one process training on whole
batches from rank 0's weights is the ground truth (`checks.train_one_process`).

    states = initial_states(mlp, 4, g)                      # rank 0's weights, and different ones for the others
    shares = rows_per_rank(batches, 4)                       # rank r's rows of every batch, and nothing else
    got = checks.run(4, my_driver, exercise, ..., per_rank=list(zip(states, shares)))
    expected = checks.train_one_process(mlp, sgd, loss, batches, state=states[0])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


def redraw(model: nn.Module, generator: torch.Generator) -> dict:
    """New values for `model`'s parameters (uniform in +-1/sqrt(fan-in), as nn.Linear draws them) and floating
    buffers (in [0.5, 1.5)), from `generator`; its state_dict."""
    with torch.no_grad():
        for p in model.parameters():
            bound = 1 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.5
            p.copy_((2 * torch.rand(p.shape, generator=generator, dtype=torch.float64) - 1) * bound)
        for b in model.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=generator, dtype=torch.float64) + 0.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def initial_states(make_model: Callable[[], nn.Module], world_size: int, generator: torch.Generator, *,
                   same: bool = False) -> list[dict]:
    """One initial state_dict per rank, drawn by the test: rank 0's is the one the ground truth starts from; the
    others are the same (`same`), or drawn anew (the ranks start different, and the wrapper must make them agree)."""
    first = redraw(make_model(), generator)
    return [first if same or rank == 0 else redraw(make_model(), generator) for rank in range(world_size)]


def rows_per_rank(batches: list[Batch], world_size: int) -> list[list[Batch]]:
    """Rank r's equal share of the rows of every batch (what a data-parallel rank is given), for each rank."""
    for inputs, _ in batches:
        if len(inputs) % world_size:
            raise ValueError(f"a batch of {len(inputs)} rows does not split evenly over {world_size} ranks")
    return [[(x.chunk(world_size)[rank].clone(), y.chunk(world_size)[rank].clone()) for x, y in batches]
            for rank in range(world_size)]


def train_on_rank(wrap: Callable, step: Callable, make_model: Callable[[], nn.Module], make_optimizer: Callable,
                  state: dict, batches: list[Batch]) -> dict:
    """On a rank: `wrap(make_model())` with this rank's initial `state` loaded, trained with
    `step(wrapped, optimizer, inputs, targets)` on this rank's `batches`; the wrapped model's `state_dict()`."""
    model = make_model()
    model.load_state_dict(state)
    wrapped = wrap(model)
    optimizer = make_optimizer(wrapped.parameters())
    for inputs, targets in batches:
        step(wrapped, optimizer, inputs, targets)
    return dict(wrapped.state_dict())


def state_bytes(state: dict) -> int:
    """Bytes of a state_dict's tensors (what a rank that averages gradients must at least receive per step)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A language model's loss: cross-entropy over every token of (batch, tokens, vocab) logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nbytes(tensors) -> int:
    """The bytes of these tensors together."""
    return sum(t.nbytes for t in tensors)
