"""Notebook 04's tests: column- and row-parallel layers, Megatron's MLP and block, sequence parallelism, the
communication and memory formulas, ring attention.

Every check draws the weights and data from the test's own seed and sends each rank only what a rank of a real
job holds: its slice of each split weight (the rest of the tensor it is handed is NaN, so a layer that computes
with another rank's slice fails), the whole replicated parameters, and its own input (the whole activation under
tensor parallelism, its block of the sequence under sequence or context parallelism). Ground truth is the unsplit
layer on one process, here. What the ranks exchanged is checked twice: as each rank reports it (`probes`), and as
measured outside the ranks (`checks.assert_received`, `checks.assert_pairs`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_parallel import checks, models, probes, regions
from cs336_parallel.testing.training import redraw

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # the ranks sum in another order than one process


# -- on a rank ----------------------------------------------------------------------------------------------------

def rank_group(group_size: int | None) -> tuple:
    """(group, its size, this rank's place in it): the whole world for None, else this rank's group of `group_size`
    consecutive ranks (every rank makes every group, as dist.new_group requires)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if group_size is None:
        return None, n, rank
    groups = [dist.new_group(list(range(start, start + group_size))) for start in range(0, n, group_size)]
    return groups[rank // group_size], group_size, rank % group_size


def parameters(module: nn.Module) -> dict:
    """Each parameter of `module` by name: its value and its gradient (what checks.assert_shards_close reads)."""
    return {name: {"value": p.detach(), "grad": p.grad} for name, p in module.named_parameters()}


def forward_backward(layer: Callable, x: torch.Tensor, weights: torch.Tensor) -> dict:
    """A driver's step: `layer(x)`, then the backward of sum(output * weights), each under a collective counter.
    Returns the output, the input's gradient, the parameters and the two counters' records."""
    x = x.clone().requires_grad_()
    with probes.count_collectives() as forward:
        y = layer(x)
    loss = (y * weights).sum() if y.shape == weights.shape else y.sum()  # a wrong shape: the test says which
    with probes.count_collectives() as backward:
        loss.backward()
    return {"output": y, "input_grad": x.grad, "parameters": parameters(layer), "forward": forward.record(),
            "backward": backward.record()}


# -- on the test's side ---------------------------------------------------------------------------------------------

def only_mine(state: dict, split: dict[str, int | None], size: int, mine: int) -> dict:
    """What one rank of a group of `size` is handed of a state_dict: each parameter split along `split[name]` holds
    slice `mine` of `size` equal slices, and NaN where the other ranks' slices are; replicated ones are whole."""
    handed = {}
    for name, tensor in state.items():
        dim = split.get(name)
        if dim is None:
            handed[name] = tensor.detach().clone()
        else:
            width = tensor.shape[dim] // size
            handed[name] = torch.full_like(tensor, math.nan)
            handed[name].narrow(dim, mine * width, width).copy_(tensor.narrow(dim, mine * width, width))
    return handed


def per_group(world_size: int, group_size: int | None) -> list[tuple[int, int]]:
    """(first rank, size) of each group of `group_size` consecutive ranks (one group of all for None)."""
    size = group_size or world_size
    return [(start, size) for start in range(0, world_size, size)]


def ranks_phrase(world_size: int, group_size: int | None) -> str:
    """Where a case ran: "4 ranks", or "groups of 2 of 4 ranks"."""
    return f"{world_size} ranks" if group_size is None else f"groups of {group_size} of {world_size} ranks"


def reference_step(module: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> tuple:
    """Ground truth, on one process: `module(x)` and the input's gradient of sum(output * weights); the module's
    parameters keep their gradients."""
    x = x.clone().requires_grad_()
    y = module(x)
    (y * weights).sum().backward()
    return y.detach(), x.grad


def assert_received(needed: float, what: str, group_size: int | None) -> None:
    """`checks.assert_received`, for a run on the whole world only: the connections of a group that a driver makes
    during the run were once measured at 0 bytes, so a group's run is not judged by them (every concern has
    whole-world cases, which are)."""
    if group_size is None:
        checks.assert_received(needed, what)


def assert_collectives(results: list, expected: tuple, exercise, case: str) -> None:
    """Every rank's (forward, backward) collectives are `expected` ({name: count} each, the forms of a collective
    merged), and no call hid from the counter. (The ranks' own word: each check also measures the bytes.)"""
    for rank, result in enumerate(results):
        got = []
        for record in (result["forward"], result["backward"]):
            checks.assert_nothing_hidden(record, exercise.__name__, rank=rank)
            got.append(checks.collective_counts(record))
        checks.count_comparison()
        assert tuple(got) == expected, (f"rank {rank}: {case}: (forward, backward) collectives should be {expected}, "
                                        f"got {tuple(got)}")


def assert_slices(got: list, split: dict[str, int | None], shapes: dict[str, tuple], sizes: list[int],
                  what: str) -> None:
    """Each rank holds each parameter as the spec shards it: a slice of 1/size along its dimension (a whole
    parameter where a slice is required fails), or the whole of a replicated one."""
    for rank, (result, size) in enumerate(zip(got, sizes, strict=True)):
        expected = {}
        for name, shape in shapes.items():
            shape = list(shape)
            if split[name] is not None:
                shape[split[name]] //= size
            expected[name] = tuple(shape)
        held = {name: tuple(p["value"].shape) for name, p in result["parameters"].items()}
        checks.count_comparison()
        assert held == expected, (f"rank {rank}: {what}: the parameters should be this rank's slices, {expected}; "
                                  f"they are {held}")


# -- ColumnParallelLinear and RowParallelLinear ---------------------------------------------------------------

def linear_driver(layer_class, option: str, value: bool, group_size: int | None, state: dict, x: torch.Tensor,
                  weights: torch.Tensor) -> dict:
    """On a rank: `layer_class.from_linear(linear, **{option: value})` of an nn.Linear holding this rank's `state`,
    forward and backward on its `x` (its slice with input_is_parallel) and loss `weights` (its slice without
    gather_output)."""
    group, _, _ = rank_group(group_size)
    weight = state["weight"]
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in state, dtype=weight.dtype)
    linear.load_state_dict(state)
    return forward_backward(layer_class.from_linear(linear, **{option: value}, group=group), x, weights)


def check_linear(layer_class, world_size: int, option: str, value: bool, shape: tuple, out_features: int, *,
                 bias: bool = True, dtype: torch.dtype = torch.float32, group_size: int | None = None,
                 compare: bool = True) -> list:
    """Run the layer on `world_size` ranks (in groups of `group_size`), each given its slice of an nn.Linear drawn
    here, and compare each rank's output, input gradient, weight slices and their gradients with the unsplit layer
    on one process; the drivers' results (`compare=False`: only the bytes each rank needed are checked)."""
    g = checks.generator()
    reference = nn.Linear(shape[-1], out_features, bias=bias).to(dtype)
    redraw(reference, g)
    x = checks.random_tensor(shape, dtype, generator=g)
    weights = checks.random_tensor((*shape[:-1], out_features), dtype, generator=g)
    column = option == "gather_output"
    split = {"weight": 0 if column else 1, "bias": 0 if column else None}
    split_x, split_y = option == "input_is_parallel" and value, column and not value
    size = group_size or world_size
    per_rank = [(only_mine(reference.state_dict(), split, size, rank % size),
                 x.chunk(size, -1)[rank % size].clone() if split_x else x,
                 weights.chunk(size, -1)[rank % size].clone() if split_y else weights) for rank in range(world_size)]
    got = checks.run(world_size, linear_driver, layer_class, option, value, group_size, per_rank=per_rank)
    case = (f"{layer_class.__name__} {option}={value}, bias={bias}, {dtype}, input {shape}, "
            f"{ranks_phrase(world_size, group_size)}")
    # What a rank cannot compute from its own slice: the others' output slices (gather_output), the sum of the
    # others' partial products (a row layer's output), the others' shares of the input's gradient.
    y_bytes = math.prod(shape[:-1]) * out_features * x.element_size()
    if column:
        needed = x.nbytes + ((size - 1) * y_bytes // size if value else 0)
    else:
        needed = y_bytes + (0 if value else (size - 1) * x.nbytes // size)
    assert_received(needed, case, group_size)
    if not compare:
        return got
    y, x_grad = reference_step(reference, x, weights)
    for rank, result in enumerate(got):
        mine = rank % size  # this rank's place in its group
        expected_y = y.chunk(size, -1)[mine] if split_y else y
        expected_grad = x_grad.chunk(size, -1)[mine] if split_x else x_grad
        checks.assert_close(result["output"], expected_y, name=f"{case}: output", rank=rank, **TOLERANCE)
        checks.assert_close(result["input_grad"], expected_grad, name=f"{case}: input gradient", rank=rank,
                            **TOLERANCE)
    for start, size in per_group(world_size, group_size):  # each group holds the whole layer
        checks.assert_shards_close([r["parameters"] for r in got[start:start + size]], reference, split,
                                   ranks=range(start, start + size), **TOLERANCE)
    return got


def new_layer_driver(layer_class, in_features: int, out_features: int) -> dict:
    """On a rank: new layers' parameters, by dtype, and whether one made with bias=False has None for a bias."""
    torch.manual_seed(dist.get_rank())  # a fixed seed: the verdict is the same on every run (no data is compared)
    made = {str(dtype): parameters(layer_class(in_features, out_features, dtype=dtype))
            for dtype in (torch.float32, torch.float64)}
    return {**made, "bias=False": layer_class(in_features, out_features, bias=False).bias is None}


def check_new_layer(layer_class, world_size: int, in_features: int, out_features: int, split_dim: int) -> None:
    """A new layer's parameters: shapes (split along `split_dim`), dtype, and nn.Linear's uniform(±1/√in)."""
    shape = [out_features, in_features]
    shape[split_dim] //= world_size
    expected = {"weight": tuple(shape), "bias": (out_features // world_size,) if split_dim == 0 else (out_features,)}
    bound = 1 / math.sqrt(in_features)
    for rank, result in enumerate(checks.run(world_size, new_layer_driver, layer_class, in_features, out_features)):
        for dtype in (torch.float32, torch.float64):
            call = (f"rank {rank}: {layer_class.__name__}({in_features}, {out_features}, dtype={dtype}) on "
                    f"{world_size} ranks")
            for name, expected_shape in expected.items():
                p = result[str(dtype)].get(name, {}).get("value")
                checks.count_comparison()
                assert p is not None and tuple(p.shape) == expected_shape and p.dtype == dtype, (
                    f"{call}: {name} should be a {dtype} parameter of shape {expected_shape}, got "
                    f"{None if p is None else (p.dtype, tuple(p.shape))}")
                largest = p.abs().max().item()
                assert 0.5 * bound < largest <= bound, (
                    f"{call}: {name} should be uniform in ±1/√in_features = ±{bound:.3f}, like nn.Linear; its "
                    f"largest magnitude is {largest:.3f}")
        assert result["bias=False"], f"rank {rank}: {layer_class.__name__}(..., bias=False).bias should be None"


# -- what a constructor builds or refuses ---------------------------------------------------------------------------

def new_mlp(dim: int, hidden: int) -> models.MLP:
    """On a rank: a models.MLP of these sizes (its values do not matter: the argument tests look at shapes)."""
    return models.MLP(dim, hidden)


def new_block(dim: int, heads: int, hidden: int | None = None, *, causal: bool = True, norm: str = "layer"):
    """On a rank: a models.TransformerBlock of these sizes (LayerNorms, or RMSNorms with `norm="rms"`, as Llama
    has); a driver loads the test's weights into it."""
    block = models.TransformerBlock(dim, heads, hidden=hidden, causal=causal)
    if norm == "rms":
        block.ln1, block.ln2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
    return block


def _arguments_of(of, args: tuple) -> tuple:
    """A layer's arguments: `args`, or the one model `of(*args)` (a layer made from a model)."""
    return args if of is None else (of(*args),)


def built(make, *args, of=None) -> dict:
    """On a rank: the shapes of the parameters of `make(*args)` (or `make(of(*args))`), by name, and whether each
    of its submodules is a plain nn.Linear."""
    module = make(*_arguments_of(of, args))
    return {"shapes": {name: tuple(p.shape) for name, p in module.named_parameters()},
            "plain": {name: type(m) is nn.Linear for name, m in module.named_children()}}


def refused(make, *args, of=None) -> dict:
    """On a rank: what `make(*args)` (or `make(of(*args))`) did, as data (the test wants ValueError): what it
    raised, or the type of what it returned."""
    result = probes.outcome(make, *_arguments_of(of, args))
    if "returned" in result:
        result["returned"] = type(result["returned"]).__name__
    return result


def assert_refused(world_size: int, make, *args, of=None, rule: str) -> None:
    """On every rank, `make(*args)` (or `make(of(*args))`) raises ValueError: it breaks `rule`."""
    for rank, result in enumerate(checks.run(world_size, refused, make, *args, of=of)):
        checks.assert_raised(result, ValueError, f"{make.__name__} on {world_size} ranks with {rule}", rank=rank)


def assert_built(world_size: int, make, *args, of=None, shapes: dict) -> dict:
    """On every rank, `make(*args)` (or `make(of(*args))`) builds a module whose parameters have these shapes;
    rank 0's `built` record."""
    got = checks.run(world_size, built, make, *args, of=of)
    for rank, result in enumerate(got):
        checks.count_comparison()
        assert result["shapes"] == shapes, (f"rank {rank}: {make.__name__}{args} on {world_size} ranks: the "
                                            f"parameters should have the shapes {shapes}, got {result['shapes']}")
    return got[0]


# -- TensorParallelMLP ----------------------------------------------------------------------------------------------

MLP_SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}


def mlp_driver(TensorParallelMLP, group_size: int | None, state: dict, x: torch.Tensor,
               weights: torch.Tensor) -> dict:
    """On a rank: TensorParallelMLP of a models.MLP holding this rank's `state`, forward and backward on the whole
    input; also whether its fc1 and fc2 are plain nn.Linear."""
    group, _, _ = rank_group(group_size)
    hidden, dim = state["fc1.weight"].shape
    mlp = models.MLP(dim, hidden, bias="fc1.bias" in state)
    mlp.load_state_dict(state)
    layer = TensorParallelMLP(mlp, group=group)
    plain = {name: type(getattr(layer, name, None)) is nn.Linear for name in ("fc1", "fc2")}
    return {**forward_backward(layer, x, weights), "plain": plain}


def check_mlp(TensorParallelMLP, world_size: int, shape: tuple, *, hidden: int | None = None, bias: bool = True,
              group_size: int | None = None, compare: bool = True) -> list:
    """Run it on `world_size` ranks (in groups of `group_size`), each given its slices of a models.MLP drawn here:
    fc1 and fc2 must be plain nn.Linear holding this rank's slices (the spec's rule, checked by every test); compare
    outputs, input gradients, slices and their gradients with the MLP on one process. The drivers' results
    (`compare=False`: only the rule and the bytes each rank needed are checked)."""
    g = checks.generator()
    mlp = models.MLP(shape[-1], hidden, bias=bias)
    redraw(mlp, g)
    x, weights = checks.random_tensor(shape, generator=g), checks.random_tensor(shape, generator=g)
    size = group_size or world_size
    per_rank = [(only_mine(mlp.state_dict(), MLP_SPLIT, size, rank % size), x, weights) for rank in range(world_size)]
    got = checks.run(world_size, mlp_driver, TensorParallelMLP, group_size, per_rank=per_rank)
    case = f"input {shape}, hidden {mlp.fc1.out_features}, bias={bias}, {ranks_phrase(world_size, group_size)}"
    for rank, result in enumerate(got):
        checks.count_comparison()
        assert all(result["plain"].values()), (
            f"rank {rank}: fc1 and fc2 should be plain nn.Linear slices (so this exercise does not depend on the "
            f"others); plain nn.Linear: {result['plain']}")
    assert_slices(got, MLP_SPLIT, {name: tuple(p.shape) for name, p in mlp.named_parameters()},
                  [size] * world_size, f"TensorParallelMLP, {case}")
    # The sum of the others' partial products (g, forward) and of their input gradients (f, backward).
    assert_received(2 * x.nbytes, f"TensorParallelMLP, {case}", group_size)
    if not compare:
        return got
    y, x_grad = reference_step(mlp, x, weights)
    for rank, result in enumerate(got):
        checks.assert_close(result["output"], y, name=f"{case}: output", rank=rank, **TOLERANCE)
        checks.assert_close(result["input_grad"], x_grad, name=f"{case}: input gradient", rank=rank, **TOLERANCE)
    for start, size in per_group(world_size, group_size):
        checks.assert_shards_close([r["parameters"] for r in got[start:start + size]], mlp, MLP_SPLIT,
                                   ranks=range(start, start + size), **TOLERANCE)
    return got


# -- SequenceParallelBlock ------------------------------------------------------------------------------------------

_COLUMNS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc1")
_ROWS = ("attn.out_proj", "mlp.fc2")
BLOCK_SPLIT = {**{f"{norm}.{p}": None for norm in ("ln1", "ln2") for p in ("weight", "bias")},
               **{f"{layer}.{p}": 0 for layer in _COLUMNS for p in ("weight", "bias")},
               **{f"{layer}.weight": 1 for layer in _ROWS}, **{f"{layer}.bias": None for layer in _ROWS}}
TP_COUNTS = ({"all_reduce": 2}, {"all_reduce": 2})
SP_COUNTS = ({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2, "reduce_scatter": 2})


def make_block(dim: int, heads: int, hidden: int | None, causal: bool, norm: str,
               generator: torch.Generator) -> nn.Module:
    """The reference block, its weights drawn from `generator`; its norms' weights near 1, not ones and zeros, so
    that a mix-up shows."""
    block = new_block(dim, heads, hidden, causal=causal, norm=norm)
    redraw(block, generator)
    with torch.no_grad():
        for ln in (block.ln1, block.ln2):
            ln.weight.add_(1.0)
    return block


def block_driver(SequenceParallelBlock, heads: int, causal: bool, norm: str, sequence_parallel: bool,
                 group_size: int | None, state: dict, x: torch.Tensor, weights: torch.Tensor) -> dict:
    """On a rank: SequenceParallelBlock of a block holding this rank's `state`, forward and backward on this rank's
    input (its block of the sequence under sequence parallelism, else the whole)."""
    group, _, _ = rank_group(group_size)
    dim, hidden = state["ln1.weight"].shape[0], state["mlp.fc1.weight"].shape[0]
    block = new_block(dim, heads, hidden, causal=causal, norm=norm)
    block.load_state_dict(state)
    return forward_backward(SequenceParallelBlock(block, sequence_parallel=sequence_parallel, group=group), x, weights)


def check_block(SequenceParallelBlock, world_size: int, shape: tuple, heads: int, *, sequence_parallel: bool,
                causal: bool = True, hidden: int | None = None, group_size: int | None = None,
                compare: bool = True) -> list:
    """Run it on `world_size` ranks (in groups of `group_size`), each given its slices of a block drawn here, and
    compare outputs, input gradients, every parameter's slice and gradient with the block on one process
    (replicated parameters' gradients summed over the group under sequence parallelism); the drivers' results
    (`compare=False`: only the bytes each rank needed are checked)."""
    g = checks.generator()
    block = make_block(shape[-1], heads, hidden, causal, "layer", g)
    x, weights = checks.random_tensor(shape, generator=g), checks.random_tensor(shape, generator=g)
    size = group_size or world_size

    def mine(t: torch.Tensor, rank: int) -> torch.Tensor:  # this rank's input: its block of the sequence, or all
        return t.chunk(size, 1)[rank % size].clone() if sequence_parallel else t

    per_rank = [(only_mine(block.state_dict(), BLOCK_SPLIT, size, rank % size), mine(x, rank), mine(weights, rank))
                for rank in range(world_size)]
    got = checks.run(world_size, block_driver, SequenceParallelBlock, heads, causal, "layer", sequence_parallel,
                     group_size, per_rank=per_rank)
    case = (f"{'sequence' if sequence_parallel else 'tensor'} parallel, input {shape}, {heads} heads, causal={causal}, "
            f"{ranks_phrase(world_size, group_size)}")
    # The others' partial sums for this rank's tokens, in forward and in backward.
    assert_received(2 * mine(x, 0).nbytes, f"SequenceParallelBlock, {case}", group_size)
    if not compare:
        return got
    y, x_grad = reference_step(block, x, weights)
    for rank, result in enumerate(got):
        checks.assert_close(result["output"], mine(y, rank), name=f"{case}: output", rank=rank, **TOLERANCE)
        checks.assert_close(result["input_grad"], mine(x_grad, rank), name=f"{case}: input gradient", rank=rank,
                            **TOLERANCE)
    for start, size in per_group(world_size, group_size):
        checks.assert_shards_close([r["parameters"] for r in got[start:start + size]], block, BLOCK_SPLIT,
                                   ranks=range(start, start + size), sum_replicated_grads=sequence_parallel,
                                   **TOLERANCE)
    return got


def norms_driver(SequenceParallelBlock, heads: int, norm: str, sequence_parallel: bool, state: dict,
                 x: torch.Tensor) -> dict:
    """On a rank, forward only: the output, and the input shapes each norm module was called on."""
    dim = state["ln1.weight"].shape[0]
    block = new_block(dim, heads, state["mlp.fc1.weight"].shape[0], norm=norm)
    block.load_state_dict(state)
    layer = SequenceParallelBlock(block, sequence_parallel=sequence_parallel)
    seen = {"ln1": [], "ln2": []}
    for name, shapes in seen.items():
        getattr(layer, name).register_forward_hook(lambda module, args, out, shapes=shapes: shapes.append(
            tuple(args[0].shape)))
    with torch.no_grad():
        y = layer(x)
    return {"output": y, "seen": seen}


def check_norms(SequenceParallelBlock, world_size: int, shape: tuple, heads: int, *, sequence_parallel: bool,
                norm: str) -> None:
    """Each norm module is called once, on this rank's tokens under sequence parallelism (on the whole sequence
    otherwise), and the output matches the reference block with these norms."""
    g = checks.generator()
    block = make_block(shape[-1], heads, None, True, norm, g)
    x = checks.random_tensor(shape, generator=g)
    per_rank = [(only_mine(block.state_dict(), BLOCK_SPLIT, world_size, rank),
                 x.chunk(world_size, 1)[rank].clone() if sequence_parallel else x) for rank in range(world_size)]
    got = checks.run(world_size, norms_driver, SequenceParallelBlock, heads, norm, sequence_parallel,
                     per_rank=per_rank)
    with torch.no_grad():
        y = block(x)
    mode = "sequence parallel" if sequence_parallel else "tensor parallel"
    for rank, result in enumerate(got):
        expected = y.chunk(world_size, 1)[rank] if sequence_parallel else y
        where = "this rank's block of the sequence" if sequence_parallel else "the whole sequence"
        for name, shapes in result["seen"].items():
            checks.count_comparison()
            assert shapes == [tuple(expected.shape)], (
                f"rank {rank}: {mode}, {norm} norms, input {shape} on {world_size} ranks: {name} should be called "
                f"once, on {where} {tuple(expected.shape)}; it was called on {shapes}")
        checks.assert_close(result["output"], expected, name=f"{mode} with {norm} norms: output", rank=rank,
                            **TOLERANCE)
    checks.assert_received(per_rank[0][1].nbytes, f"SequenceParallelBlock forward, {mode}, {norm} norms")


# -- activation_memory_bytes ----------------------------------------------------------------------------------------

def assert_bytes(got, expected: int, call: str) -> None:
    """`got` is the int `expected`, exactly (a float, or a float rounded down, is not)."""
    checks.count_comparison()
    assert type(got) is int and got == expected, f"{call} returned {got!r}, expected the int {expected}"


# -- ring attention -------------------------------------------------------------------------------------------------

def _reachable(output: torch.Tensor) -> set[int]:
    """The ids of the autograd nodes `output`'s backward can reach (kept alive while the ids are compared)."""
    seen: dict[int, object] = {}
    pending = [output.grad_fn] if output.grad_fn is not None else []
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        pending += [nxt for nxt, _ in node.next_functions if nxt is not None]
    return set(seen)


def _unused_steps_on_each_rank(output, steps: list) -> list[list[int]]:
    """For each rank of the world, the ring steps (`regions.recording_ring_steps`) whose received block `output`'s
    graph does not reach; every rank must call it (an all-gather of one number each)."""
    reached = _reachable(output) if isinstance(output, torch.Tensor) else None
    mask = 0 if reached is None else sum(1 << i for i, step in enumerate(steps[:62])
                                         if step is not None and id(step) not in reached)
    masks = torch.empty(dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_single(masks, torch.tensor([mask], dtype=torch.int64))
    return [[i for i in range(62) if m >> i & 1] for m in masks.tolist()]


def ring_driver(ring_attention, causal: bool, group_size: int | None, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, weights: torch.Tensor) -> dict:
    """On a rank: ring attention of this rank's blocks of q, k and v, forward and backward, each under a collective
    counter. Before backward the ranks compare which received blocks their outputs use: where one rank leaves out a
    block its neighbour uses, backward would wait forever for a gradient that is never sent, so the driver stops
    and says so instead."""
    group, _, _ = rank_group(group_size)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with regions.recording_ring_steps() as steps, probes.count_collectives() as forward:
        y = ring_attention(q, k, v, causal, group=group)
    unused = _unused_steps_on_each_rank(y, steps)
    if any(u != unused[0] for u in unused):
        raise RuntimeError(
            f"the ranks' outputs leave out different blocks received from send_to_next_rank (by rank, the ring steps "
            f"not used: {unused}; a future block masked with torch.full_like, or skipped): in backward a rank would "
            "wait forever for a gradient its neighbour never sends. Mask with masked_fill or torch.where, which keep "
            "k in the graph")
    loss = (y * weights).sum() if y.shape == weights.shape else y.sum()  # a wrong shape: the test says which
    with probes.count_collectives() as backward:
        loss.backward()
    return {"output": y, "grads": [q.grad, k.grad, v.grad], "forward": forward.record(),
            "backward": backward.record()}


def check_ring(ring_attention, world_size: int, shape: tuple, causal: bool, *, group_size: int | None = None,
               compare: bool = True) -> list:
    """Run it on `world_size` ranks (in groups of `group_size`), each given its blocks of q, k and v drawn here:
    only point-to-point messages (the spec's rule, checked by every test), and every rank receives the others' key
    and value blocks; compare each rank's output and the gradients of its blocks with F.scaled_dot_product_attention
    over the whole sequence on one process. The drivers' results (`compare=False`: only the rule and the bytes)."""
    g = checks.generator()
    q, k, v, weights = (checks.random_tensor(shape, generator=g) for _ in range(4))
    size = group_size or world_size

    def mine(t: torch.Tensor, rank: int) -> torch.Tensor:  # this rank's block of the sequence (dim 2)
        return t.detach().chunk(size, 2)[rank % size].clone()

    per_rank = [tuple(mine(t, rank) for t in (q, k, v, weights)) for rank in range(world_size)]
    got = checks.run(world_size, ring_driver, ring_attention, causal, group_size, per_rank=per_rank)
    for rank, result in enumerate(got):
        for record in (result["forward"], result["backward"]):
            checks.assert_point_to_point(record, "ring_attention", rank=rank)
    case = f"causal={causal}, whole sequence {shape}, {ranks_phrase(world_size, group_size)}"
    assert_received(2 * (size - 1) * per_rank[0][0].nbytes, f"ring_attention, {case}: the others' key and value "
                    "blocks", group_size)
    if not compare:
        return got
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # ground truth: one process, plain PyTorch
    (y * weights).sum().backward()
    for rank, result in enumerate(got):
        checks.assert_close(result["output"], mine(y, rank), name=f"{case}: output", rank=rank, **TOLERANCE)
        for name, grad, expected in zip("qkv", result["grads"], (q.grad, k.grad, v.grad), strict=True):
            checks.assert_close(grad, mine(expected, rank), name=f"{case}: {name}.grad", rank=rank, **TOLERANCE)
    return got


def assert_ring_traffic(got: list, shape: tuple) -> None:
    """In forward each rank sent its key and value blocks on t - 1 times, and nothing else (as it reports); measured
    outside the ranks, each sent as many blocks to the next rank in forward and to the previous one in backward
    (their gradients), and nothing to any other rank."""
    n = len(got)
    block_bytes = math.prod(shape) // n * 4  # one (B, H, T/t, d) float32 block
    expected = 2 * (n - 1) * block_bytes
    sent = [sum(size for op, size, _ in result["forward"]["calls"] if op == "send") for result in got]
    checks.count_comparison()
    assert sent == [expected] * n, (
        f"{n} ranks, whole sequence {shape}: each rank passes its key and value blocks on t - 1 times in forward, "
        f"{expected} bytes; the ranks sent {sent}")
    pairs: dict[tuple[int, int], int] = {}
    messages: dict[tuple[int, int], int] = {}
    for rank in range(n):
        for peer in ((rank + 1) % n, (rank - 1) % n):  # forward to the next, backward to the previous
            pairs[rank, peer] = pairs.get((rank, peer), 0) + expected
            messages[rank, peer] = messages.get((rank, peer), 0) + 2 * (n - 1)
    checks.assert_pairs(pairs, messages, f"ring attention on {n} ranks, forward and backward")


def ring_refused(ring_attention, *shapes) -> dict:
    """On a rank: what ring_attention did with zero tensors of these shapes for q, k, v (the test wants ValueError)."""
    return probes.outcome(ring_attention, *(torch.zeros(s) for s in shapes), True)
