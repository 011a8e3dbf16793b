"""Notebook 03's tests: ZeRO-1's `ShardedOptimizer`, ZeRO-2's `reduce_scatter_gradients`, ZeRO-3's `FSDP`.

Every check draws the initial weights and the batches itself (`checks.generator()`) and sends each rank only what a
data-parallel rank holds: the weights every rank starts from and its own rows of each batch (`training`). One
process training on the whole batches is the ground truth.

What the ranks exchanged is measured outside them: every rank must receive at least what its result needs
(`checks.assert_received`), and where a rule limits what a rank may receive (ZeRO-2's gradients go to their owners
only), no more than that. Which collectives a rank called is its own word (`probes`).

What the ranks held is measured twice. On each rank, `memory.track` counts the bytes of live tensors (its own
word). From outside, the grader's memory cgroup gives the ranks' peak together (`checks.last_memory`): there the
model is large enough (millions of parameters) that what sharding saves stands tens of MB above the noise, the
ranks hold their state at a barrier (so that their peaks add up), and each measured run starts from ranks that
gave back the memory an earlier test freed (`release_memory`). A memory test also checks the losses of the
training it measures: an answer that skips the work saves memory, and gains nothing by it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_parallel import checks, memory, models, probes
from cs336_parallel.testing.training import Batch, initial_states, lm_loss, nbytes, redraw, rows_per_rank
from cs336_parallel.trace import collective_name

MiB = 2**20
RANK_OVERHEAD = 4 * MiB  # what a rank's memory grows by in a run beyond its tensors (Python objects, gloo's buffers)
# AdamW at lr 1e-2 after a few steps, float32 gradients summed in another order: its division by the root of small
# second moments magnifies the rounding, step after step (up to about 1e-5 after 4 steps here): rtol 1e-3, atol 1e-4.
ADAMW_TOLERANCE = (1e-3, 1e-4)
# An element whose gradients stay near 0 divides their rounding by about eps: with torch's 1e-8, one such element
# once moved 8% of a step away from the reference. The tests' AdamW uses eps 1e-3, which bounds that magnification.
ADAMW_EPS = 1e-3


# -- shared by the three exercises ---------------------------------------------------------------------------

def mlp_stack(dim: int, depth: int, hidden: int | None = None) -> Callable[[], nn.Module]:
    """A factory of `MLPStack(dim, depth, hidden=hidden)`: it crosses to the ranks by name."""
    return functools.partial(models.MLPStack, dim, depth, hidden=hidden)


def draw_batches(g: torch.Generator, steps: int, rows: int, dim: int) -> list[Batch]:
    """`steps` regression batches of `rows` (inputs, targets) of `dim` features, drawn from `g`."""
    return [(checks.random_tensor((rows, dim), generator=g), checks.random_tensor((rows, dim), generator=g))
            for _ in range(steps)]


def expected_owners(params: list, world_size: int) -> list[int]:
    """Ground truth for the ownership rule: in order, each parameter to the rank owning the fewest elements so far
    (the lowest such rank on a tie)."""
    loads, owners = [0] * world_size, []
    for p in params:
        owners.append(min(range(world_size), key=lambda r: (loads[r], r)))
        loads[owners[-1]] += p.numel()
    return owners


def not_owned_bytes(params: list, world_size: int) -> list[int]:
    """For each rank, the bytes of the parameters it does not own: what it must receive from their owners."""
    owners = expected_owners(params, world_size)
    return [sum(p.numel() * p.element_size() for p, o in zip(params, owners, strict=True) if o != r)
            for r in range(world_size)]


def release_memory(exercise) -> int:
    """A driver, run before a run whose memory the grader measures: collect what earlier tests left in reference
    cycles, warm up what a training step allocates once per process (autograd's engine, AdamW's first step), and
    hand back to the system what this rank's allocator keeps of the memory freed so far; from now on, large blocks
    go back as soon as they are freed (glibc; elsewhere only the first two). Without it, the measured run would
    reuse memory an earlier test freed, or free some midway, and its peak measured outside would miss what it
    allocates. The rank's copy of what the rank server had imported (frozen there: cs336_parallel.in_rank_server) is
    collected too, so that the pages a collection writes to are copied now, not counted in the measured run.
    (`exercise` rides along unused: a test's requests that name the same exercises reuse the copy of them the
    ranks were sent.)"""
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    weight.square().sum().backward()
    optimizer.step()
    del weight, optimizer
    gc.unfreeze()
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: fixed at 128 KB (no longer raised as blocks are freed)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return 0


def measured_run(world_size: int, fn: Callable, exercise, *args, per_rank: list[tuple]) -> list:
    """`checks.run(world_size, fn, exercise, *args, ...)`, on new ranks that first gave back the memory they hold
    free (`release_memory`)."""
    checks.run(world_size, release_memory, exercise, fresh=True)  # new ranks: nothing of an earlier test is held
    return checks.run(world_size, fn, exercise, *args, per_rank=per_rank)


def settled_bytes(mem: memory.MemoryTracker, limit: int) -> int:
    """On a rank: the bytes held now above the tracker's start, read the same way on every run: after a barrier,
    and once gloo's thread has let go of what finished collectives held (at most 1 s for the count to come down to
    `limit`)."""
    dist.barrier()
    deadline = time.monotonic() + 1.0
    while mem.current_bytes - mem.start_bytes > limit and time.monotonic() < deadline:
        time.sleep(0.005)
    return mem.current_bytes - mem.start_bytes


def losses_of(model: nn.Module, batches: list[Batch], step: Callable[[torch.Tensor], None]) -> list[float]:
    """Each batch's loss before `step(loss)`, then the last batch's loss once more after the last step: each depends on
    every update before it (what a memory test compares, instead of millions of parameters)."""
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        step(loss)
    with torch.no_grad():
        losses.append(F.mse_loss(model(batches[-1][0]), batches[-1][1]).item())
    return losses


def expected_losses(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch],
                    world_size: int) -> list[list[float]]:
    """Ground truth for `losses_of` on each rank: one process steps on the whole batches; each rank's loss is that
    of the model then on its own rows."""
    shares = rows_per_rank(batches, world_size)
    losses = [[] for _ in range(world_size)]
    for i, (x, y) in enumerate(batches):
        with torch.no_grad():
            for rank in range(world_size):
                losses[rank].append(F.mse_loss(model(shares[rank][i][0]), shares[rank][i][1]).item())
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        for rank in range(world_size):
            losses[rank].append(F.mse_loss(model(shares[rank][-1][0]), shares[rank][-1][1]).item())
    return losses


def assert_losses(got: list, expected: list[float], what: str, rank: int) -> None:
    """A rank's losses (`losses_of`) against one process's. Float32 summed in another order, through AdamW's
    division by small second moments: rtol 1e-4, atol 1e-6."""
    checks.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                        name=f"the losses of {what} (each before its step, then after the last)", rank=rank,
                        rtol=1e-4, atol=1e-6)


# -- ShardedOptimizer (ZeRO-1) ---------------------------------------------------------------------------------

def zero_optimizers() -> int:
    """On a rank: how many of torch's ZeroRedundancyOptimizers exist, however they are held."""
    library = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # never imported: none exists
    if library is None:
        return 0
    return sum(issubclass(type(o), library.ZeroRedundancyOptimizer) for o in gc.get_objects())


def assert_built_optimizer_itself(result: dict, rank: int) -> None:
    """ShardedOptimizer's rule, checked in every test of it (the rank's word)."""
    checks.count_comparison()
    assert result["zero_optimizers"] == 0, (
        f"rank {rank}: build it yourself: torch's ZeroRedundancyOptimizer is not allowed inside ShardedOptimizer")


def optimizer_order(model: nn.Module, groups: bool) -> list[nn.Parameter]:
    """The parameters in the order the optimizer is given them: all of them, or the weights then the biases."""
    if not groups:
        return list(model.parameters())
    named = list(model.named_parameters())
    return [p for n, p in named if n.endswith("weight")] + [p for n, p in named if not n.endswith("weight")]


def unsharded(params, optimizer_cls, **kwargs) -> torch.optim.Optimizer:
    return optimizer_cls(params, **kwargs)


def build_optimizer(make: Callable, model: nn.Module, optimizer_cls, kwargs: dict,
                    groups: bool) -> torch.optim.Optimizer:
    """`make(params, optimizer_cls, **kwargs)` over the model's parameters; with `groups`, over its weights, the
    biases added later as a second group without weight decay."""
    if not groups:
        return make(model.parameters(), optimizer_cls, **kwargs)
    params = optimizer_order(model, groups=True)
    weights = len([n for n, _ in model.named_parameters() if n.endswith("weight")])
    optimizer = make([{"params": params[:weights]}], optimizer_cls, **kwargs)
    optimizer.add_param_group({"params": params[weights:], "weight_decay": 0.0})
    return optimizer


def train_regression(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch], *, average: bool,
                     halve_lr: bool) -> dict:
    """Train on `batches`, the gradients averaged over the ranks first (`average`: DDP's all-reduce); with
    `halve_lr`, every group's learning rate halved halfway, as a scheduler would. The parameters afterwards."""
    for step, (x, y) in enumerate(batches):
        if halve_lr and step == len(batches) // 2:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        if average:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def train_sharded(ShardedOptimizer, make_model: Callable, optimizer_cls, kwargs: dict, groups: bool, state: dict,
                  batches: list[Batch]) -> dict:
    """A driver: ShardedOptimizer over `make_model()` from `state`, a step on each of this rank's `batches` with
    the gradients averaged (DDP); the parameters afterwards, and how many ZeroRedundancyOptimizers exist then."""
    model = make_model()
    model.load_state_dict(state)
    optimizer = build_optimizer(ShardedOptimizer, model, optimizer_cls, kwargs, groups)
    params = train_regression(model, optimizer, batches, average=True, halve_lr=groups)
    return {"params": params, "zero_optimizers": zero_optimizers()}


def check_sharded_optimizer(ShardedOptimizer, world_size: int, optimizer_cls, kwargs: dict, *, groups: bool = False,
                            dim: int = 32, depth: int = 2, hidden: int = 64, steps: int = 4) -> None:
    """Every rank's parameters against one process stepping the unsharded optimizer on the whole batches. With
    `groups`, the biases are added later as a second group without weight decay, and the learning rate is halved
    halfway. Each rank must receive each step's gradients (DDP's all-reduce), and each parameter the N - 1 ranks that
    do not own it (measured outside: the parameters are large enough to stand well above gloo's framing)."""
    if optimizer_cls is torch.optim.AdamW:
        kwargs = {"eps": ADAMW_EPS, **kwargs}
    g = checks.generator()
    make = mlp_stack(dim, depth, hidden)
    states = initial_states(make, world_size, g, same=True)  # every rank starts from the same weights
    batches = draw_batches(g, steps, 2 * world_size, dim)
    got = checks.run(world_size, train_sharded, ShardedOptimizer, make, optimizer_cls, kwargs, groups,
                     per_rank=list(zip(states, rows_per_rank(batches, world_size), strict=True)))
    reference = make()
    reference.load_state_dict(states[0])
    expected = train_regression(reference, build_optimizer(unsharded, reference, optimizer_cls, kwargs, groups),
                                batches, average=False, halve_lr=groups)
    what = "with a second group added later and the learning rate halved halfway" if groups else "one group"
    # Float32, summation order differs: rtol 1e-5, atol 1e-6 (AdamW: ADAMW_TOLERANCE).
    rtol, atol = ADAMW_TOLERANCE if optimizer_cls is torch.optim.AdamW else (1e-5, 1e-6)
    for rank, result in enumerate(got):
        assert_built_optimizer_itself(result, rank)
        checks.assert_state_close(result["params"], expected, rank=rank, rtol=rtol, atol=atol,
                                  what=f"after {steps} {optimizer_cls.__name__} steps on {world_size} ranks ({what})")
    params = optimizer_order(reference, groups)
    what = f"{steps} steps of ShardedOptimizer on {world_size} ranks"
    checks.assert_received(steps * nbytes(params), f"{what}: each step's averaged gradients")
    # Whoever owns what, each parameter reaches the N - 1 ranks that do not own it, every step.
    checks.assert_received_together(steps * (world_size * nbytes(params) + (world_size - 1) * nbytes(params)),
                             f"{what}: the averaged gradients, and every parameter from its owner")


def owners_update(ShardedOptimizer, make_model: Callable, state: dict, batch: Batch) -> dict:
    """A driver: one SGD step on this rank's own batch, the gradients NOT averaged (so each rank's update differs),
    the first five parameters in a group and the rest added later; the parameters afterwards."""
    model = make_model()
    model.load_state_dict(state)
    params = list(model.parameters())
    optimizer = ShardedOptimizer([{"params": params[:5]}], torch.optim.SGD, lr=0.1)
    optimizer.add_param_group({"params": params[5:]})
    optimizer.zero_grad()
    F.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()
    return {"params": {name: p.detach() for name, p in model.named_parameters()}, "zero_optimizers": zero_optimizers()}


def check_each_from_its_owner(ShardedOptimizer, world_size: int, dim: int = 10, depth: int = 3,
                              hidden: int = 14) -> None:
    """After a step, every parameter on every rank is its owner's update (owner_ranks over all parameters)."""
    g = checks.generator()
    make = mlp_stack(dim, depth, hidden)
    state = initial_states(make, 1, g)[0]
    batches = draw_batches(g, world_size, 2, dim)  # each rank's own, different data
    got = checks.run(world_size, owners_update, ShardedOptimizer, make, per_rank=[(state, b) for b in batches])
    updated = []  # ground truth: each rank's own update, computed here for every rank
    for x, y in batches:
        reference = make()
        reference.load_state_dict(state)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
        updated.append({name: p.detach() for name, p in reference.named_parameters()})
    params = list(updated[0].values())
    owners = expected_owners(params, world_size)
    for rank, result in enumerate(got):
        assert_built_optimizer_itself(result, rank)
        for name, owner in zip(updated[0], owners, strict=True):
            checks.assert_close(result["params"][name], updated[owner][name], rtol=1e-5, atol=1e-6, rank=rank,
                                name=f"{name} (owned by rank {owner}: its update, on every rank)")
    checks.assert_received(not_owned_bytes(params, world_size),
                           f"a ShardedOptimizer step on {world_size} ranks: every parameter from its owner")


def sharded_state_held(ShardedOptimizer, make_model: Callable, wait_below: int, seed: int,
                       batches: list[Batch]) -> dict:
    """A driver: `make_model()` drawn from `seed` (its weights, the same on every rank), AdamW steps through the
    sharded optimizer on this rank's `batches` (DDP gradients); the tensor bytes held after them above those held
    before the model existed (read once they settle below `wait_below`, or after 1 s), and the losses
    (`losses_of`). Then, as the next step's forward would, a buffer as large as the parameters, held by all ranks at
    once: the peak measured outside is then what each rank holds between steps, and not a step's transients (an
    owner's flat copy of its parameters, say)."""
    with memory.track(count_existing=False) as mem:  # everything it counts is made inside
        model = make_model()
        redraw(model, torch.Generator().manual_seed(seed))
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

        def step(loss: torch.Tensor) -> None:
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()

        losses = losses_of(model, batches, step)
        held = settled_bytes(mem, wait_below)
    buffer = torch.ones(sum(p.numel() for p in model.parameters()))
    dist.barrier()
    del buffer
    return {"held": held, "losses": losses, "zero_optimizers": zero_optimizers()}


def check_sharded_state(ShardedOptimizer, world_size: int, dim: int = 256, depth: int = 8, steps: int = 2) -> None:
    """float32 weights and gradients stay whole (8 bytes per parameter); Adam's two moments (8 bytes) only for the
    parameters this rank owns: on each rank (its own count), at most Psi/N + the largest parameter's elements; all
    ranks together (measured outside), with a buffer of the parameters' size on every rank afterwards, at most
    12 Psi N + 8 Psi, with half of what keeping the moments whole would add (8 Psi (N - 1)) to spare."""
    g = checks.generator()
    make = mlp_stack(dim, depth)
    params = list(make().parameters())
    psi, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    limit = 8 * psi + 8 * (psi // world_size + largest) + 4096  # + 4 KB: the input, Adam's step counters
    seed = int(torch.randint(2**62, (), generator=g))
    batches = draw_batches(g, steps, 2 * world_size, dim)
    got = measured_run(world_size, sharded_state_held, ShardedOptimizer, make, limit, seed,
                       per_rank=[(b,) for b in rows_per_rank(batches, world_size)])
    reference = make()
    redraw(reference, torch.Generator().manual_seed(seed))
    expected = expected_losses(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3), batches, world_size)
    case = f"MLPStack({dim}, {depth}), {psi:,} parameters, AdamW on {world_size} ranks"
    for rank, result in enumerate(got):
        assert_built_optimizer_itself(result, rank)
        assert_losses(result["losses"], expected[rank], case, rank)
        checks.count_comparison()
        assert result["held"] <= limit, (
            f"rank {rank} of {world_size}: holds {result['held'] / 1e6:.1f} MB after the steps, at most "
            f"{limit / 1e6:.1f} MB expected (8 + 8/N bytes per parameter): is the optimizer state sharded, by "
            "owner_ranks?")
    # Together: weights, gradients and the buffer on every rank, Adam's state once; whole, it adds 8 Psi (N - 1).
    together = 12 * psi * world_size + 8 * psi + 4 * psi * (world_size - 1) + RANK_OVERHEAD * world_size
    checks.assert_memory_at_most(together, f"{case}: Adam's state sharded (8 + 8/N bytes per parameter per rank)")


NOT_OPTIMIZER_CLASSES = {"the string 'AdamW'": lambda: "AdamW", "nn.Linear": lambda: nn.Linear,
                         "an AdamW optimizer": lambda: torch.optim.AdamW([nn.Parameter(torch.ones(2))])}


def refused_optimizer_cls(ShardedOptimizer, which: str) -> dict:
    """A driver: what ShardedOptimizer(params, optimizer_cls) did with one of NOT_OPTIMIZER_CLASSES (the test wants
    ValueError)."""
    result = probes.outcome(ShardedOptimizer, [nn.Parameter(torch.ones(2))], NOT_OPTIMIZER_CLASSES[which]())
    result.pop("returned", None)  # an optimizer stays on the rank
    return result


def check_refuses_optimizer_cls(ShardedOptimizer, world_size: int, which: str) -> None:
    for rank, result in enumerate(checks.run(world_size, refused_optimizer_cls, ShardedOptimizer, which)):
        checks.assert_raised(result, ValueError, f"ShardedOptimizer(params, {which})", rank=rank)


# -- reduce_scatter_gradients (ZeRO-2) -------------------------------------------------------------------------

def zero2_model(make_model: Callable, state: dict, frozen: bool, unused: bool) -> nn.Module:
    """`make_model()` from `state`; `frozen`: its first bias needs no gradient; `unused`: an extra parameter needs
    one but never gets one."""
    model = make_model()
    model.load_state_dict(state)
    if frozen:
        model.layers[0].fc1.bias.requires_grad_(False)
    if unused:
        model.spare = nn.Parameter(torch.ones(3))
    return model


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def reduce_scatter_steps(reduce_scatter_gradients, make_model: Callable, frozen: bool, unused: bool, state: dict,
                         batches: list[Batch]) -> dict:
    """A driver: a step on each of this rank's `batches`, reduce_scatter_gradients after each backward, then AdamW
    on what has a gradient and every parameter broadcast from its owner. Returns each step's gradients after
    reduce_scatter_gradients (None where there is none), by name, and the parameters at the end."""
    model = zero2_model(make_model, state, frozen, unused)
    params = trainable(model)
    owners = expected_owners([p for _, p in params], dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAMW_EPS)  # skips grad=None
    grads = []
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        reduce_scatter_gradients(model)
        grads.append({name: None if p.grad is None else p.grad.clone() for name, p in params})
        optimizer.step()
        for (_, p), owner in zip(params, owners, strict=True):
            dist.broadcast(p.detach(), src=owner)
    return {"grads": grads, "params": {name: p.detach() for name, p in model.named_parameters()}}


def zero2_reference(make_model: Callable, state: dict, frozen: bool, unused: bool, batches: list[Batch]) -> tuple:
    """Ground truth: one process on the whole batches; each step's gradients by name, and the final parameters."""
    model = zero2_model(make_model, state, frozen, unused)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAMW_EPS)
    grads = []
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append({name: None if p.grad is None else p.grad.clone() for name, p in trainable(model)})
        optimizer.step()
    return grads, {name: p.detach() for name, p in model.named_parameters()}


def check_reduce_scatter(reduce_scatter_gradients, world_size: int, *, dim: int = 16, depth: int = 2,
                         hidden: int = 24, steps: int = 4, frozen: bool = False, unused: bool = False) -> None:
    """After each backward on a rank's rows: the owner's gradient equals one process's gradient on the whole batch,
    the others are None; after `steps` steps the model equals the one-process model. Each rank must receive the
    others' gradients of what it owns, and (from the driver's broadcast) the parameters it does not own."""
    g = checks.generator()
    make = mlp_stack(dim, depth, hidden)
    state = initial_states(make, 1, g)[0]
    batches = draw_batches(g, steps, 2 * world_size, dim)
    got = checks.run(world_size, reduce_scatter_steps, reduce_scatter_gradients, make, frozen, unused,
                     per_rank=[(state, share) for share in rows_per_rank(batches, world_size)])
    expected_grads, expected_params = zero2_reference(make, state, frozen, unused, batches)
    params = trainable(zero2_model(make, state, frozen, unused))
    owners = dict(zip([name for name, _ in params], expected_owners([p for _, p in params], world_size),
                      strict=True))
    for rank, result in enumerate(got):
        for step, (grads, expected) in enumerate(zip(result["grads"], expected_grads, strict=True)):
            for name, owner in owners.items():
                if owner == rank and expected[name] is not None:
                    # Float32, summation order differs: rtol 1e-5, atol 1e-6 at the first step; after AdamW's steps
                    # (its division by small second moments magnifies that rounding), ADAMW_TOLERANCE.
                    rtol, atol = (1e-5, 1e-6) if step == 0 else ADAMW_TOLERANCE
                    checks.assert_close(grads[name], expected[name], rank=rank, rtol=rtol, atol=atol,
                                        name=f"the gradient of {name} (owned), step {step}")
                else:
                    checks.count_comparison()
                    assert grads[name] is None, (
                        f"rank {rank}, step {step}: {name} belongs to rank {owner} (or has no gradient anywhere): its "
                        "grad must be None")
        rtol, atol = ADAMW_TOLERANCE
        checks.assert_state_close(result["params"], expected_params, what=f"after {steps} steps on {world_size} ranks",
                                  rank=rank, rtol=rtol, atol=atol)
    with_grad = {name for name, grad in expected_grads[0].items() if grad is not None}
    sizes = {name: p.numel() * p.element_size() for name, p in params}
    needed = [steps * sum(size if owners[name] != rank else size * (name in with_grad) for name, size in sizes.items())
              for rank in range(world_size)]
    checks.assert_received(needed, f"{steps} steps with reduce_scatter_gradients on {world_size} ranks: the gradients "
                                   "of what a rank owns (and, from the test's broadcast, the parameters it does not)")


def reduce_scatter_once(reduce_scatter_gradients, make_model: Callable, state: dict, batch: Batch) -> dict:
    """A driver: one backward on this rank's rows, then reduce_scatter_gradients, its collectives recorded; each
    gradient's sum and sum of magnitudes afterwards (None where there is none: the values themselves are the main
    test's), and the record."""
    model = make_model()
    model.load_state_dict(state)
    F.mse_loss(model(batch[0]), batch[1]).backward()
    with probes.count_collectives() as comm:
        reduce_scatter_gradients(model)
    return {"comm": comm.record(), "sums": {name: gradient_sums(p.grad) for name, p in model.named_parameters()}}


def gradient_sums(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's sum and sum of magnitudes, in float64."""
    return None if grad is None else torch.stack([grad.double().sum(), grad.double().abs().sum()])


def assert_sums(got, expected_grad: torch.Tensor, name: str, rank: int) -> None:
    """A rank's `gradient_sums` against those of the expected gradient. Float32 gradients summed in another order
    differ by rounding, element by element: up to 1e-5 of the sum of magnitudes (a sum of mixed signs can be small,
    so a relative tolerance alone would not do)."""
    expected = gradient_sums(expected_grad)
    checks.assert_close(got, expected, rank=rank, rtol=1e-5, atol=1e-5 * expected[1].item(),
                        name=f"{name}: its sum and sum of magnitudes")


TO_OWNERS = {"reduce", "reduce_scatter"}
TO_EVERY_RANK = {"all_reduce", "all_gather", "broadcast", "all_to_all"}
FLAG_BYTES = 8  # what a flag per parameter may take, from each rank: an int64 or a float64


def check_only_to_owners(reduce_scatter_gradients, world_size: int, dim: int = 128, hidden: int = 256) -> None:
    """Every gradient is reduced onto its owner (reduce or reduce-scatter), and what goes to every rank is at most a
    flag per parameter: the model's smallest gradient is larger than that allowance, so no gradient fits in it.

    The ranks' word (which collectives, how many bytes) is checked against what they received, measured outside:
    at least the others' gradients of what a rank owns, and at most what reducing each gradient onto its owner moves
    (gloo's reduce is a ring: its owner receives 2(N-1)/N of the gradient's bytes, every other rank (N-1)/N), with
    the flags and gloo's framing on top. Giving every rank every gradient (an all-reduce) moves 2(N-1)/N to all."""
    g = checks.generator()
    make = mlp_stack(dim, 2, hidden)
    state = initial_states(make, 1, g)[0]
    (x, y), = draw_batches(g, 1, 2 * world_size, dim)
    got = checks.run(world_size, reduce_scatter_once, reduce_scatter_gradients, make,
                     per_rank=[(state, share[0]) for share in rows_per_rank([(x, y)], world_size)])
    reference = make()
    reference.load_state_dict(state)
    F.mse_loss(reference(x), y).backward()
    named = list(reference.named_parameters())
    params = [p for _, p in named]
    owners = expected_owners(params, world_size)
    gradient_bytes = nbytes(params)
    allowance = FLAG_BYTES * len(params) * world_size
    assert allowance < min(p.numel() * p.element_size() for p in params), "the test's model is too small"
    for rank, result in enumerate(got):
        record = result["comm"]
        checks.assert_nothing_hidden(record, "reduce_scatter_gradients", rank=rank)
        for (name, p), owner in zip(named, owners, strict=True):
            if owner == rank:
                assert_sums(result["sums"][name], p.grad, f"the gradient of {name} (owned)", rank)
        moved = {}
        for op, size, _ in record["calls"]:
            moved[collective_name(op)] = moved.get(collective_name(op), 0) + size
        to_everyone = {op: size for op, size in moved.items() if op in TO_EVERY_RANK}
        checks.count_comparison()
        assert sum(to_everyone.values()) <= allowance, (
            f"rank {rank}: collectives that give every rank their result carried {to_everyone} bytes, more than a "
            f"flag per parameter ({allowance} bytes): gradients reached ranks that do not own them")
        to_owners = sum(size for op, size in moved.items() if op in TO_OWNERS)
        assert to_owners >= gradient_bytes, (
            f"rank {rank}: reduced {to_owners} bytes onto owners, but the gradients hold {gradient_bytes}: each must "
            "be summed onto its owner (dist.reduce, or a reduce-scatter)")
    owned = [sum(p.numel() * p.element_size() for p, o in zip(params, owners, strict=True) if o == rank)
             for rank in range(world_size)]
    what = f"reduce_scatter_gradients on {world_size} ranks"
    checks.assert_received(owned, f"{what}: the others' gradients of what a rank owns")
    ring = (world_size - 1) / world_size
    most = [ring * (owned[rank] + gradient_bytes) + allowance
            + checks.WIRE_BYTES_PER_MESSAGE * 3 * world_size * len(params) + checks.WIRE_BYTES_SLACK
            for rank in range(world_size)]
    checks.assert_received_at_most(most, f"{what}: each rank receives only the gradients it owns (reduced onto it), "
                                         "not the others'")


def gradient_bytes_held(reduce_scatter_gradients, make_model: Callable, wait_below: int, seed: int,
                        batch: Batch) -> dict:
    """A driver: `make_model()` drawn from `seed`, a backward on this rank's rows and reduce_scatter_gradients; the
    tensor bytes held then above those held before the model existed (read once they settle below `wait_below`,
    or after 1 s), and the owned gradients' sums. Then, as a rank goes on to use the memory ZeRO-2 frees (the next
    micro-batch's activations, say), a buffer as large as the gradients, held by all ranks at once: the peak
    measured outside counts the gradients a rank did not free on top of it."""
    with memory.track(count_existing=False) as mem:  # everything it counts is made inside
        model = make_model()
        redraw(model, torch.Generator().manual_seed(seed))
        F.mse_loss(model(batch[0]), batch[1]).backward()
        reduce_scatter_gradients(model)
        held = settled_bytes(mem, wait_below)
    sums = {name: gradient_sums(p.grad) for name, p in model.named_parameters()}
    buffer = torch.ones(sum(p.numel() for p in model.parameters()))
    dist.barrier()
    del buffer
    return {"held": held, "sums": sums}


def check_gradients_freed(reduce_scatter_gradients, world_size: int, dim: int = 256, depth: int = 16) -> None:
    """float32 weights whole (4 bytes per parameter), gradients only for the parameters a rank owns: on each rank
    (its own count), at most Psi/N + the largest parameter's elements; all ranks together (measured outside), with
    a buffer as large as the gradients on every rank afterwards, at most 4 Psi N + 4 Psi + 4 Psi N, with half of
    what not freeing the others' gradients adds (4 Psi (N - 1)) to spare."""
    g = checks.generator()
    make = mlp_stack(dim, depth)
    seed = int(torch.randint(2**62, (), generator=g))
    (x, y), = draw_batches(g, 1, 2 * world_size, dim)
    reference = make()
    redraw(reference, torch.Generator().manual_seed(seed))
    F.mse_loss(reference(x), y).backward()
    named = list(reference.named_parameters())
    params = [p for _, p in named]
    psi, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    limit = 4 * psi + 4 * (psi // world_size + largest) + 4096
    got = measured_run(world_size, gradient_bytes_held, reduce_scatter_gradients, make, limit, seed,
                       per_rank=[(share[0],) for share in rows_per_rank([(x, y)], world_size)])
    owners = expected_owners(params, world_size)
    case = f"MLPStack({dim}, {depth}), {psi:,} parameters, {world_size} ranks"
    for rank, result in enumerate(got):
        for (name, p), owner in zip(named, owners, strict=True):
            if owner == rank:
                assert_sums(result["sums"][name], p.grad, f"the gradient of {name} (owned)", rank)
        checks.count_comparison()
        assert result["held"] <= limit, (
            f"rank {rank} of {world_size}: holds {result['held'] / 1e6:.1f} MB after reduce_scatter_gradients, at "
            f"most {limit / 1e6:.1f} MB expected (4 + 4/N bytes per parameter): are the gradients of the others "
            "freed?")
    together = 8 * psi * world_size + 4 * psi + 2 * psi * (world_size - 1) + RANK_OVERHEAD * world_size
    checks.assert_memory_at_most(together, f"{case}: the gradients of the others freed (4 + 4/N bytes per parameter "
                                           "per rank, then a buffer as large as the gradients)")


# -- FSDP (ZeRO-3) ---------------------------------------------------------------------------------------------

def make_lm(vocab: int, dim: int, depth: int) -> nn.Sequential:
    """Embedding -> residual MLPs -> LayerNorm -> Linear head: Linear and Embedding units to shard, and a LayerNorm
    that stays whole."""
    return nn.Sequential(nn.Embedding(vocab, dim), models.MLPStack(dim, depth, hidden=2 * dim), nn.LayerNorm(dim),
                         nn.Linear(dim, vocab))


def lm(vocab: int, dim: int, depth: int) -> Callable[[], nn.Module]:
    return functools.partial(make_lm, vocab, dim, depth)


def token_batches(g: torch.Generator, steps: int, rows: int, vocab: int, tokens: int = 5) -> list[Batch]:
    """`steps` batches of `rows` sequences of token ids and their targets, drawn from `g`."""
    return [tuple(torch.randint(0, vocab, (rows, tokens), generator=g) for _ in range(2)) for _ in range(steps)]


ADAMW = (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1})
SGD = (torch.optim.SGD, {"lr": 0.5})  # unlike Adam's, SGD's steps show gradients that are not averaged


def torch_fsdps() -> int:
    """On a rank: how many of torch's FSDP modules (FullyShardedDataParallel, or a module that fully_shard made an
    FSDPModule) exist, however they are held."""
    library = sys.modules.get("torch.distributed.fsdp")  # never imported: none exists
    if library is None:
        return 0
    return sum(issubclass(type(o), (library.FSDPModule, library.FullyShardedDataParallel)) for o in gc.get_objects())


def assert_built_fsdp_itself(result: dict, rank: int) -> None:
    """FSDP's rule, checked in every test of it (the rank's word)."""
    checks.count_comparison()
    assert result["torch_fsdps"] == 0, (
        f"rank {rank}: build it yourself: torch's fully_shard and FullyShardedDataParallel are not allowed inside FSDP")


def unit_bytes(model: nn.Module) -> list[int]:
    """The bytes of each unit's parameters (each nn.Linear and nn.Embedding), in module order."""
    return [nbytes(m.parameters(recurse=False)) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def train_fsdp(FSDP, prefetch: bool, make_model: Callable, optimizer_cls, kwargs: dict, state: dict,
               batches: list[Batch]) -> dict:
    """A driver: FSDP over `make_model()` from `state`, an optimizer step on each of this rank's `batches`.
    Returns how many parameter elements it holds, whether it kept the model as .module, the collectives of the
    first step's forward and backward, the LayerNorm's gradients after each backward, gather_full_params() at the
    end, and how many of torch's FSDPs exist then."""
    model = make_model()
    model.load_state_dict(state)
    fsdp = FSDP(model, prefetch=prefetch)
    result = {"kept": getattr(fsdp, "module", None) is model,
              "held": sum(p.numel() for p in fsdp.parameters()), "layernorm_grads": []}
    optimizer = optimizer_cls(fsdp.parameters(), **kwargs)
    for step, (tokens, targets) in enumerate(batches):
        optimizer.zero_grad()
        with probes.count_collectives() as forward:
            loss = lm_loss(fsdp(tokens), targets)
        with probes.count_collectives() as backward:
            loss.backward()
        if step == 0:
            result["forward"] = checks.collective_counts(forward.record())
            result["backward"] = checks.collective_counts(backward.record())
        result["layernorm_grads"].append([None if p.grad is None else p.grad.clone() for p in model[2].parameters()])
        optimizer.step()
    result["full"] = fsdp.gather_full_params()
    result["torch_fsdps"] = torch_fsdps()
    return result


def check_fsdp(FSDP, world_size: int, prefetch: bool, optimizer_cls, kwargs: dict, *, vocab: int = 32,
               dim: int = 16, depth: int = 2, steps: int = 3) -> None:
    """FSDP trained on each rank's rows against one process on the whole batches: the shards held, one all-gather
    per unit in forward and one reduce-scatter per unit in backward (the rank's word, and the bytes they move,
    measured), the LayerNorm's gradients the same on every rank, and gather_full_params() at the end."""
    g = checks.generator()
    make = lm(vocab, dim, depth)
    state = initial_states(make, 1, g)[0]  # every rank starts from the same weights
    batches = token_batches(g, steps, 2 * world_size, vocab)
    got = checks.run(world_size, train_fsdp, FSDP, prefetch, make, optimizer_cls, kwargs,
                     per_rank=[(state, share) for share in rows_per_rank(batches, world_size)])
    expected = checks.train_one_process(make, functools.partial(optimizer_cls, **kwargs), lm_loss, batches,
                                        state=state)
    expected = {name: expected[name] for name, _ in make().named_parameters()}
    units = unit_bytes(make())
    whole, replicated = sum(t.numel() for t in expected.values()), 2 * dim
    what = f"after {steps} {optimizer_cls.__name__} steps on {world_size} ranks (prefetch={prefetch})"
    for rank, result in enumerate(got):
        assert_built_fsdp_itself(result, rank)
        checks.count_comparison()
        assert result["kept"], f"rank {rank}: FSDP keeps the wrapped model as .module"
        assert result["held"] <= (whole - replicated) / world_size + len(units) + replicated, (
            f"rank {rank} keeps {result['held']} of the {whole} parameters: FSDP keeps only its shard of each unit")
        forward, backward = result["forward"], result["backward"]
        assert forward.get("all_gather") == len(units) and "reduce_scatter" not in forward, (
            f"rank {rank}, forward: expected one all-gather per unit ({len(units)}) and no reduce-scatter, counted "
            f"{forward}")
        assert backward.get("reduce_scatter") == len(units), (
            f"rank {rank}, backward: expected one reduce-scatter per unit ({len(units)}), counted {backward}")
        for step, (grads, first) in enumerate(zip(result["layernorm_grads"], got[0]["layernorm_grads"], strict=True)):
            for name, grad, expected_grad in zip(("weight", "bias"), grads, first, strict=True):
                checks.assert_equal(grad, expected_grad, rank=rank,
                                    name=f"the LayerNorm's {name}.grad, step {step} (against rank 0's)")
        full = result["full"]
        assert isinstance(full, dict) and list(full) == list(expected), (
            f"rank {rank}: gather_full_params() has the keys {list(full) if isinstance(full, dict) else full!r}, "
            f"expected {list(expected)}")
        # Float32, summed in another order: rtol 1e-5, atol 1e-6; AdamW divides by the root of small second
        # moments, which magnifies that rounding: rtol 1e-4, atol 1e-5.
        rtol, atol = (1e-4, 1e-5) if optimizer_cls is torch.optim.AdamW else (1e-5, 1e-6)
        checks.assert_state_close(full, expected, what=what, rank=rank, rtol=rtol, atol=atol)
    # Each step gathers every unit in forward and reduce-scatters its gradient in backward; the end gathers them
    # once more: the others' (N-1)/N of the units' bytes each time, at least.
    gathered = (world_size - 1) / world_size * sum(units)
    checks.assert_received((2 * steps + 1) * gathered, f"FSDP, {what}: an all-gather of every unit in each forward, a "
                                                       "reduce-scatter of its gradient in each backward")


def prefetch_order(FSDP, make_model: Callable, state: dict, x: torch.Tensor) -> dict:
    """A driver: FSDP with prefetch=True over `make_model()` (one matrix product per unit in forward): at each matrix
    product of forward, how many all-gathers had been issued; then the collectives of backward, in order."""
    model = make_model()
    model.load_state_dict(state)
    model = FSDP(model, prefetch=True)
    with probes.count_collectives() as comm, ComputeMarks(comm) as marks:
        loss = model(x).square().mean()
    with probes.count_collectives() as comm:
        loss.backward()
    return {"forward_marks": marks.marks, "backward": [c.op for c in comm.calls], "torch_fsdps": torch_fsdps()}


class ComputeMarks(TorchDispatchMode):
    """At each matrix product or embedding lookup, notes how many all-gathers `comm` has counted so far."""

    def __init__(self, comm: probes.CommCounter):
        super().__init__()
        self.comm, self.marks = comm, []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled (else torch imports torch._dynamo on first use: seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "embedding"):
            self.marks.append(sum(c.op.startswith("all_gather") for c in self.comm.calls))
        return func(*args, **(kwargs or {}))


def check_prefetches(FSDP, world_size: int, dim: int = 8, depth: int = 3) -> None:
    """In forward, before unit j computes, the all-gathers of units 0..j+1 have been issued; in backward, before the
    k-th reduce-scatter, k + 2 of the all-gathers that backward issues (the rank's word: when a collective is issued
    cannot be told from the bytes)."""
    g = checks.generator()
    make = mlp_stack(dim, depth, 2 * dim)
    state = initial_states(make, 1, g)[0]
    inputs = [checks.random_tensor((4, dim), generator=g) for _ in range(world_size)]
    units = 2 * depth
    for rank, result in enumerate(checks.run(world_size, prefetch_order, FSDP, make,
                                             per_rank=[(state, x) for x in inputs])):
        assert_built_fsdp_itself(result, rank)
        forward = result["forward_marks"]
        assert len(forward) == units, (
            f"rank {rank}: expected {units} matrix products in forward (one per unit), saw {len(forward)}")
        for j, issued in enumerate(forward):
            checks.count_comparison()
            assert issued >= min(j + 2, units), (
                f"rank {rank}, forward, {units} units: when unit {j} computes, the all-gathers of units 0 to "
                f"{min(j + 1, units - 1)} should have been issued (the next one prefetched); {issued} were")
        gathered, before_each = 0, []
        for op in result["backward"]:
            if op.startswith("all_gather"):
                gathered += 1
            elif op.startswith("reduce_scatter"):
                before_each.append(gathered)
        for k, issued in enumerate(before_each):
            checks.count_comparison()
            assert issued >= min(k + 2, gathered), (
                f"rank {rank}, backward: when the gradient of the unit that runs backward {k + 1}. is "
                "reduce-scattered, "
                f"the all-gather of the unit whose backward comes next should have been issued; {issued} of the "
                f"{gathered} all-gathers in backward were")


def state_and_output(FSDP, make_model: Callable, state: dict, tokens: torch.Tensor) -> dict:
    """A driver: FSDP over `make_model()` from `state`: its output under torch.no_grad() for this rank's tokens, and
    its state_dict()."""
    model = make_model()
    model.load_state_dict(state)
    fsdp = FSDP(model)
    with torch.no_grad():
        output = fsdp(tokens)
    return {"output": output, "state": fsdp.state_dict(), "torch_fsdps": torch_fsdps()}


def check_state_dict_and_no_grad(FSDP, world_size: int, vocab: int = 32, dim: int = 16) -> None:
    """state_dict() is the wrapped module's, whole and bitwise; a forward under torch.no_grad() is the module's."""
    g = checks.generator()
    make = lm(vocab, dim, 1)
    state = initial_states(make, 1, g)[0]
    tokens = [torch.randint(0, vocab, (2, 5), generator=g) for _ in range(world_size)]
    reference = make()
    reference.load_state_dict(state)
    got = checks.run(world_size, state_and_output, FSDP, make, per_rank=[(state, t) for t in tokens])
    for rank, result in enumerate(got):
        assert_built_fsdp_itself(result, rank)
        with torch.no_grad():
            checks.assert_close(result["output"], reference(tokens[rank]), name="output under no_grad", rank=rank,
                                rtol=1e-5, atol=1e-6)
        checks.assert_state_close(result["state"], state, what="(state_dict, bitwise)", rank=rank, rtol=0, atol=0)
    checks.assert_received((world_size - 1) / world_size * sum(unit_bytes(reference)),
                           f"FSDP's forward and state_dict() on {world_size} ranks: the others' shards of every unit")


def refused_fsdp(FSDP) -> dict:
    """A driver: what FSDP did with a module that has no Linear or Embedding (the test wants ValueError)."""
    result = probes.outcome(FSDP, nn.Sequential(nn.LayerNorm(4)))
    result.pop("returned", None)  # a module stays on the rank
    return result


def check_refuses_nothing_to_shard(FSDP, world_size: int) -> None:
    for rank, result in enumerate(checks.run(world_size, refused_fsdp, FSDP)):
        checks.assert_raised(result, ValueError, "FSDP(nn.Sequential(nn.LayerNorm(4))): no unit to shard", rank=rank)


def memory_test_adamw(params) -> torch.optim.Optimizer:
    """AdamW whose step depends on the gradients' scale (eps = lr = 1e-3, about the gradients' size): plain Adam's
    hardly does, so the losses of an FSDP that sums the gradients instead of averaging them would come out almost
    the same, sometimes within tolerance."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-3)


def fsdp_peak(FSDP, prefetch: bool, make_model: Callable, seed: int, batches: list[Batch]) -> dict:
    """A driver: FSDP over `make_model()` drawn from `seed`, AdamW steps on this rank's `batches`: the peak tensor
    bytes of the last step above those held before the model existed, and the losses (`losses_of`)."""
    with memory.track(count_existing=False) as mem:  # everything it counts is made inside
        model = make_model()
        redraw(model, torch.Generator().manual_seed(seed))
        model = FSDP(model, prefetch=prefetch)
        optimizer = memory_test_adamw(model.parameters())

        def step(loss: torch.Tensor) -> None:
            mem.reset_peak()  # the last step's peak, from its forward on: the optimizer state exists by then
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        losses = losses_of(model, batches, step)
    return {"peak": mem.peak_bytes - mem.start_bytes, "losses": losses, "torch_fsdps": torch_fsdps()}


def check_fsdp_peak(FSDP, world_size: int, prefetch: bool = False, dim: int = 128, depth: int = 32,
                    steps: int = 2) -> None:
    """Everything sharded is 16 bytes per parameter / N. On each rank (its own count), 10% more, plus 6 x the
    largest unit's float32 bytes (the gathered units, a unit's whole gradient, temporaries); all ranks together
    (measured outside), the same, with less than half of what keeping every unit gathered adds (4 Psi N) to spare."""
    g = checks.generator()
    make = mlp_stack(dim, depth)
    reference = make()
    psi = sum(p.numel() for p in reference.parameters())
    largest = max(unit_bytes(reference))
    limit = 1.1 * 16 * psi / world_size + 6 * largest
    seed = int(torch.randint(2**62, (), generator=g))
    batches = draw_batches(g, steps, 2 * world_size, dim)
    got = measured_run(world_size, fsdp_peak, FSDP, prefetch, make, seed,
                       per_rank=[(share,) for share in rows_per_rank(batches, world_size)])
    redraw(reference, torch.Generator().manual_seed(seed))
    expected = expected_losses(reference, memory_test_adamw(reference.parameters()), batches, world_size)
    case = f"MLPStack({dim}, {depth}), {psi:,} parameters, prefetch={prefetch}, {world_size} ranks"
    for rank, result in enumerate(got):
        assert_built_fsdp_itself(result, rank)
        assert_losses(result["losses"], expected[rank], case, rank)
        checks.count_comparison()
        assert result["peak"] <= limit, (
            f"rank {rank} of {world_size}, {case}: peak {result['peak'] / 1e6:.1f} MB during a step, at most "
            f"{limit / 1e6:.1f} MB expected (16/N bytes per parameter and a few units): are the gathered parameters "
            "freed after each unit's forward and backward?")
    together = 1.1 * 16 * psi + world_size * (6 * largest + RANK_OVERHEAD) + 1.5 * psi * world_size
    checks.assert_memory_at_most(together, f"{case}: the gathered parameters freed after each unit's forward and "
                                           "backward (16/N bytes per parameter per rank, and a few units)")
