"""Notebook 02's tests: averaged gradients, the overlapped and bucketed wrappers, gradient accumulation.

Every check draws the initial weights and the batches from the test's own seed and sends each rank only what a
data-parallel rank holds: its initial weights and its rows of each batch (`training`). One process training on
the whole batches from rank 0's weights is the ground truth. What the ranks exchanged is checked twice: as each
rank reports it (`probes.count_collectives()`: which all-reduces, how many bytes, in which phase of a step), and
as measured outside the ranks: every rank must receive at least the bytes of the gradients it averages, and each
phase of a step (a backward, inside `no_sync()` or not; `finish_gradient_synchronization()`) must move the bytes
the ranks say it did.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_parallel import checks, models, probes
from cs336_parallel.testing.training import (
    Batch,
    initial_states,
    lm_loss,  # noqa: F401 - 02's test cells import it from here
    rows_per_rank,
    train_on_rank,
)

# -- the models, optimizers, losses and data of the tests -----------------------------------------------------

FEATURES, VOCAB, TOKENS = 8, 11, 5  # the regression models' width; the language model's vocabulary and sequence


def mlp() -> nn.Module:
    """Two residual MLP layers of width 8: 8 parameters, all used."""
    return models.MLPStack(FEATURES, depth=2, hidden=16)


def funnel() -> nn.Module:
    """Parameters of uneven sizes (bytes, in order: 1024, 128, 1024, 32, 256)."""
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.GELU(), nn.Linear(8, 8, bias=False))


class Shuffled(nn.Module):
    """Two layers registered in the opposite order to the one they run in: backward produces the gradients of the
    parameters registered first (`second`) before the others."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(16, 8)
        self.first = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(F.gelu(self.first(x)))


class TiedLM(nn.Module):
    """An embedding tied to the output layer (one parameter in two modules), a frozen parameter and a buffer;
    with `unused`, also a parameter that requires a gradient but never gets one."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.offset = nn.Parameter(torch.zeros(FEATURES), requires_grad=False)
        self.register_buffer("scale", torch.ones(FEATURES))
        self.spare = nn.Parameter(torch.zeros(FEATURES)) if unused else None
        self.head = nn.Linear(FEATURES, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: the same parameter in two modules
        self.mlp = models.MLP(FEATURES, 2 * FEATURES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale + self.offset
        return self.head(h + self.mlp(h))  # (B, T, D) -> (B, T, V)


def tied_lm_with_unused() -> nn.Module:
    return TiedLM(unused=True)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # unlike Adam's, SGD's steps show a gradient that is not averaged


def adamw(params) -> torch.optim.Optimizer:
    """AdamW with weight decay: it shrinks every parameter that has a gradient, even a zero one, so a parameter
    given a gradient it should not have moves. Its eps is large: Adam divides each step by the gradient's size, so
    with the default eps (1e-8) a gradient that the ranks' data nearly cancel, summed in another order, would move
    its parameter by far more than float32's rounding; eps = 1e-3 bounds that (rtol 1e-5 holds on any data)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)


def regression_batches(rows: int, steps: int = 3) -> list[Batch]:
    """`steps` batches of `rows` (inputs, targets) of 8 features, drawn from the test's secret seed."""
    g = checks.generator()
    return [(checks.random_tensor((rows, FEATURES), generator=g), checks.random_tensor((rows, FEATURES), generator=g))
            for _ in range(steps)]


def token_batches(rows: int, steps: int = 3) -> list[Batch]:
    """`steps` batches of `rows` sequences of token ids and their targets, drawn from the test's secret seed."""
    g = checks.generator()
    return [tuple(torch.randint(0, VOCAB, (rows, TOKENS), generator=g) for _ in range(2)) for _ in range(steps)]


def gradient_bytes(make_model: Callable[[], nn.Module], loss_fn: Callable, batch: Batch) -> int:
    """Bytes of the gradients one backward produces, each parameter once (one that gets no gradient adds
    nothing): what a rank must at least receive in each step to hold their average over ranks with other data."""
    model = make_model()
    loss_fn(model(batch[0]), batch[1]).backward()
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)


def _steps_text(batches: list, world_size: int, accumulate: int = 1) -> str:
    return f"after {len(batches)} steps on {world_size} ranks" + (f", A={accumulate}" if accumulate > 1 else "")


def _assert_received_gradients(make_model, loss_fn, batches: list, world_size: int, what: str) -> None:
    """Each rank received at least one step's gradient bytes per step (measured outside the ranks)."""
    needed = len(batches) * gradient_bytes(make_model, loss_fn, batches[0])
    checks.assert_received(needed, f"{what}: averaging the gradients of {len(batches)} steps")


# -- allreduce_gradients ----------------------------------------------------------------------------------------

def train_allreduced(allreduce_gradients, make_model, make_optimizer, loss_fn, state: dict, batches: list) -> dict:
    """On a rank: from its initial `state`, train on its rows of each batch, calling allreduce_gradients after each
    backward; the model's state_dict()."""
    def step(model, optimizer, inputs, targets):
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        allreduce_gradients(model)
        optimizer.step()

    return train_on_rank(lambda model: model, step, make_model, make_optimizer, state, batches)


def check_allreduce_gradients(allreduce_gradients, world_size: int, make_model, make_optimizer, loss_fn,
                              batches: list) -> None:
    """Every rank's model, the ranks started equal, against one process training on the whole batches (rtol 1e-5,
    atol 1e-6: float32, summed in another order)."""
    states = initial_states(make_model, world_size, checks.generator(), same=True)
    got = checks.run(world_size, train_allreduced, allreduce_gradients, make_model, make_optimizer, loss_fn,
                     per_rank=list(zip(states, rows_per_rank(batches, world_size), strict=True)))
    expected = checks.train_one_process(make_model, make_optimizer, loss_fn, batches, state=states[0])
    what = _steps_text(batches, world_size)
    for rank, state in enumerate(got):
        checks.assert_state_close(state, expected, what=what, rank=rank, rtol=1e-5, atol=1e-6)
    _assert_received_gradients(make_model, loss_fn, batches, world_size, what)


# -- the wrappers: training ---------------------------------------------------------------------------------------

@contextmanager
def torch_ddps_built() -> Iterator[list[int]]:
    """On a rank: `[count]` of the torch DistributedDataParallel objects built inside the block, however they are
    held or built (a subclass's too: the class's own __init__ counts them)."""
    built, original = [0], DistributedDataParallel.__init__

    @functools.wraps(original)
    def counting(self, *args, **kwargs):
        built[0] += 1
        original(self, *args, **kwargs)

    DistributedDataParallel.__init__ = counting
    try:
        yield built
    finally:
        DistributedDataParallel.__init__ = original


def train_wrapped(DDP, options: dict, make_model, make_optimizer, loss_fn, accumulate: int, state: dict,
                  batches: list) -> dict:
    """On a rank: wrap a model with this rank's initial `state` (the ranks start different), then train on its rows
    of each batch in `accumulate` micro-batches, all but the last in no_sync. The wrapper's state_dict(), whether
    it kept the model as .module, and how many torch DDPs it built."""
    seen = {}

    def wrap(model):
        ddp = DDP(model, **options)
        seen["kept"] = getattr(ddp, "module", None) is model
        return ddp

    def step(ddp, optimizer, inputs, targets):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True)):
            with ddp.no_sync() if i < accumulate - 1 else nullcontext():
                (loss_fn(ddp(x), y) / accumulate).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()

    with torch_ddps_built() as built:
        trained = train_on_rank(wrap, step, make_model, make_optimizer, state, batches)
    return {"state": trained, "torch_ddps": built[0], **seen}


def assert_built_itself(result: dict, rank: int) -> None:
    """The wrappers' rule, checked in every test of theirs: no torch DDP inside."""
    assert result["torch_ddps"] == 0, (
        f"rank {rank}: build the wrapper yourself: torch's DistributedDataParallel is not allowed inside it")
    checks.count_comparison()


def check_training(DDP, world_size: int, options: dict, make_model, make_optimizer, loss_fn, batches: list,
                   accumulate: int = 1) -> None:
    """Train with the wrapper on `world_size` ranks that start from different weights; compare each rank's
    state_dict() with one process training on the whole batches from rank 0's initial weights."""
    states = initial_states(make_model, world_size, checks.generator())
    got = checks.run(world_size, train_wrapped, DDP, options, make_model, make_optimizer, loss_fn, accumulate,
                     per_rank=list(zip(states, rows_per_rank(batches, world_size), strict=True)))
    expected = checks.train_one_process(make_model, make_optimizer, loss_fn, batches, state=states[0])
    what = _steps_text(batches, world_size, accumulate)
    for rank, result in enumerate(got):
        assert_built_itself(result, rank)
        assert result["kept"], f"rank {rank}: keep the wrapped model as .module, as torch's DDP does"
        checks.count_comparison()
        # Float32, summation order differs: rtol 1e-5, atol 1e-6 on every parameter and buffer.
        checks.assert_state_close(result["state"], expected, what=what, rank=rank, rtol=1e-5, atol=1e-6)
    _assert_received_gradients(make_model, loss_fn, batches, world_size, what)


# -- the wrappers: what each phase of a step launches, as reported and as measured ---------------------------------

_kept: dict[str, nn.Module] = {}  # on a rank: the wrapper a test built in one request, for its next requests


def mean_square(outputs: torch.Tensor, targets: object = None) -> torch.Tensor:
    """The loss of the launch tests, which need no targets."""
    return outputs.float().square().mean()


def build_wrapper(DDP, options: dict, make_model, key: str, state: dict) -> dict:
    """On a rank: wrap a model with this rank's initial `state`, and keep the wrapper for the next requests; what
    the construction launched, and how many torch DDPs it built."""
    model = make_model()
    model.load_state_dict(state)
    with torch_ddps_built() as built, probes.count_collectives() as comm:
        _kept[key] = DDP(model, **options)
    return {"comm": comm.record(), "torch_ddps": built[0]}


def backward_phase(key: str, in_no_sync: bool, inputs: torch.Tensor) -> dict:
    """On a rank: forward and backward of the kept wrapper on this rank's micro-batch, inside no_sync or not; what
    it launched, and how many torch DDPs it built. A barrier follows, outside the count: gloo's waits for the work
    launched before it, so the bytes of what backward launched cross during this request, not a later one."""
    ddp = _kept[key]
    with torch_ddps_built() as built, probes.count_collectives() as comm:
        with ddp.no_sync() if in_no_sync else nullcontext():
            mean_square(ddp(inputs)).backward()
    dist.barrier()
    return {"comm": comm.record(), "torch_ddps": built[0]}


def finish_phase(key: str) -> dict:
    """On a rank: finish_gradient_synchronization() of the kept wrapper, which is then dropped; what it launched
    (then a barrier, as in `backward_phase`), and how many torch DDPs it built."""
    ddp = _kept.pop(key)
    with torch_ddps_built() as built, probes.count_collectives() as comm:
        ddp.finish_gradient_synchronization()
    dist.barrier()
    return {"comm": comm.record(), "torch_ddps": built[0]}


def replay(calls: list) -> None:
    """On a rank: the all-reduces a rank reported, of float32 tensors of their sizes, then a barrier, as a phase
    ends: measured outside the ranks, they move the bytes the report implies."""
    for op, nbytes, _ in calls:
        if op == "all_reduce":
            dist.all_reduce(torch.zeros(nbytes // 4))
    dist.barrier()


def model_inputs(make_model, rows: int, generator: torch.Generator) -> torch.Tensor:
    """A micro-batch of `rows` inputs: token ids for the language model, 8 features for the others."""
    if isinstance(make_model(), TiedLM):
        return torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
    return checks.random_tensor((rows, FEATURES), generator=generator)


# Gloo moves the same bytes for the same collectives, to the byte (measured on 2 to 4 ranks); an all-reduce of even
# one element adds its framing, about 100 bytes per message, to every rank's count.
PHASE_SLACK_BYTES = 32


def _received(traffic: list[list[int]]) -> list[int]:
    """The bytes each rank received from the others."""
    n = len(traffic)
    return [sum(traffic[src][dst] for src in range(n) if src != dst) for dst in range(n)]


def replayed_traffic(world_size: int, records: list[dict], cache: dict | None = None) -> list[list[int]] | None:
    """The bytes between the ranks, measured outside them, when the test's own driver replays the collectives each
    rank reported (`records`); `cache` keeps the replays already made (the same calls move the same bytes)."""
    key = repr([record["calls"] for record in records])
    if cache is None or key not in cache:
        checks.run(world_size, replay, per_rank=[(record["calls"],) for record in records])
        if cache is None:
            return checks.last_traffic()
        cache[key] = checks.last_traffic()
    return cache[key]


def assert_wire_agrees(world_size: int, records: list[dict], measured: list[list[int]] | None, what: str,
                       cache: dict | None = None) -> None:
    """The bytes a phase moved, measured outside the ranks, are those of the collectives its ranks reported
    (`records`), replayed on the ranks by the test's own driver: within PHASE_SLACK_BYTES, rank by rank. Nothing
    is checked where traffic cannot be measured."""
    replayed = replayed_traffic(world_size, records, cache)
    if measured is None or replayed is None:
        return
    checks.count_comparison()
    for rank, (got, want) in enumerate(zip(_received(measured), _received(replayed), strict=True)):
        if abs(got - want) > PHASE_SLACK_BYTES:
            raise AssertionError(f"{what}: rank {rank} received {got} bytes from the other ranks (measured outside "
                                 f"them), the collectives the ranks reported move {want}: they did not communicate "
                                 "as they report")


def launches(DDP, world_size: int, options: dict, make_model, rows: int, accumulate: int = 1) -> list:
    """One step of the wrapper, phase by phase, each in a request of its own: construction, the backward of each of
    `accumulate` micro-batches of `rows` rows per rank (all but the last inside no_sync), then
    finish_gradient_synchronization(). Checks the rules every test of the wrappers checks (no torch DDP, nothing
    hidden from the count); that each phase moved, measured outside the ranks, the bytes of what the ranks
    reported; that in the last backward each rank received at least the gradients' bytes. Returns each rank's
    phases: for each backward, then for finish, the sorted (op, bytes) of the collectives it launched."""
    g = checks.generator()
    key = secrets.token_hex(8)
    states = initial_states(make_model, world_size, g)
    results = [checks.run(world_size, build_wrapper, DDP, options, make_model, key, per_rank=[(s,) for s in states])]
    needed = 0
    reports, measured = [], []
    for i in range(accumulate):
        inputs = [model_inputs(make_model, rows, g) for _ in range(world_size)]
        needed = gradient_bytes(make_model, mean_square, (inputs[0], None))
        results.append(checks.run(world_size, backward_phase, key, i < accumulate - 1,
                                  per_rank=[(x,) for x in inputs]))
        measured.append(checks.last_traffic())
    checks.assert_received(needed, f"{DDP.__name__} on {world_size} ranks, the backward outside no_sync")
    results.append(checks.run(world_size, finish_phase, key))
    measured.append(checks.last_traffic())
    for phase in results:
        for rank, result in enumerate(phase):
            assert_built_itself(result, rank)
            checks.assert_nothing_hidden(result["comm"], DDP.__name__, rank=rank)
    reports = [[result["comm"] for result in phase] for phase in results[1:]]
    names = [f"the backward of micro-batch {i + 1} of {accumulate}" + (" (in no_sync)" if i < accumulate - 1 else "")
             for i in range(accumulate)] + ["finish_gradient_synchronization()"]
    phases, replays = [[] for _ in range(world_size)], {}
    for name, records, traffic in zip(names, reports, measured, strict=True):
        for rank, record in enumerate(records):
            phases[rank].append(sorted((op, nbytes) for op, nbytes, _ in record["calls"]))
        assert_wire_agrees(world_size, records, traffic, f"{DDP.__name__} on {world_size} ranks, {name}", replays)
    return phases


def all_reduces_of(sizes: list, accumulate: int = 1) -> list:
    """The phases `launches` expects: all-reduces of `sizes` bytes in the last backward, nothing elsewhere."""
    return [[]] * (accumulate - 1) + [sorted(("all_reduce", s) for s in sizes), []]


def assert_deferred(one_step: list, accumulated: list, what: str) -> None:
    """Rank by rank, the micro-batches in no_sync launched nothing, and the last backward and finish launched what
    a step without no_sync launches (`launches`' phases of both)."""
    for rank, (single, phases) in enumerate(zip(one_step, accumulated, strict=True)):
        deferred = len(phases) - len(single)
        assert phases == [[]] * deferred + single, (
            f"{what}: expected nothing launched before the last backward, then what a step without no_sync "
            f"launches ({single[0]}); rank {rank} launched, per backward and then in finish: {phases}")
        checks.count_comparison()


def parameter_bytes(make_model) -> list:
    """The bytes of each parameter that requires a gradient (each once), in registration order."""
    return [p.numel() * p.element_size() for p in make_model().parameters() if p.requires_grad]


def assert_launched(phases_per_rank: list, expected: list, what: str) -> None:
    """Every rank launched, phase by phase, the collectives (op, bytes) expected."""
    for rank, phases in enumerate(phases_per_rank):
        assert phases == expected, (
            f"{what}: expected the collectives (op, bytes) {expected[:-1]} launched during backward and none "
            f"in finish_gradient_synchronization; rank {rank} launched {phases[:-1]}, then {phases[-1]} in finish")
        checks.count_comparison()


# -- DDPBucketed --------------------------------------------------------------------------------------------------

# Bucket sizes of the tests, in bucket_size_mb (1 MB = 2^20 bytes), on funnel's parameters of 256, 32, 1024, 128
# and 1024 bytes in reverse order:
ONE_PER_PARAMETER = 1e-6  # 1 byte: every parameter fills a bucket
IN_BETWEEN = 200 / 2**20  # buckets of 256, 32 + 1024, 128 + 1024 bytes (in registration order: 1024, 1152, 288)
ONE_BUCKET = 100.0
EXACTLY_FULL = 1312 / 2**20  # 256 + 32 + 1024 fills the first bucket exactly: [1312, 1152] (1440, 1024 when a
#                              bucket closes only above its size)
DECIMAL_MB = 0.0013  # 1,363 bytes: [1440, 1024] (1,300 bytes, a decimal megabyte's share, gives 1312, 1152)


def bucket_bytes(make_model, bucket_size_mb: float) -> list:
    """Ground truth: the sizes of the buckets the exercise's rule makes."""
    buckets = []
    for nbytes in reversed(parameter_bytes(make_model)):
        if not buckets or buckets[-1] >= bucket_size_mb * 2**20:
            buckets.append(0)
        buckets[-1] += nbytes
    return buckets


def refused_bucket_size(DDPBucketed, bucket_size_mb: float) -> dict:
    """On a rank: what DDPBucketed(model, bucket_size_mb) did (the test wants ValueError); a wrapper it built
    stays on the rank."""
    result = probes.outcome(DDPBucketed, mlp(), bucket_size_mb)
    result.pop("returned", None)
    return result


# -- train_step_accumulate --------------------------------------------------------------------------------------

class RecordingDDP(nn.Module):
    """A stand-in DDP for these tests, with DDPOverlap's interface: at the end of each backward outside no_sync it
    launches one all-reduce of every gradient, flattened; finish_gradient_synchronization() waits for it and leaves
    the averages in `.grad` (until then they are this rank's own). It logs each backward and each finish."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module, self.sync, self.log = module, True, []
        self._queued, self._launched = False, None
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not self._queued:  # once per backward: at its end, every gradient is ready
            self._queued = True
            synchronize = self.sync
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(synchronize))

    def _backward_done(self, synchronize: bool) -> None:
        self._queued = False
        self.log.append("backward" if synchronize else "backward in no_sync")
        if synchronize:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            self._launched = (grads, flat, dist.all_reduce(flat, async_op=True))

    def forward(self, *args):
        return self.module(*args)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_gradient_synchronization(self) -> None:
        self.log.append("finish")
        if self._launched is not None:
            grads, flat, work = self._launched
            work.wait()
            for g, total in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(total.view_as(g) / dist.get_world_size())
            self._launched = None


def train_accumulating(train_step_accumulate, accumulate: int, make_model, make_optimizer, loss_fn, state: dict,
                       batches: list) -> dict:
    """On a rank: one train_step_accumulate per batch, on this rank's rows in `accumulate` micro-batches, through
    RecordingDDP (the ranks start equal); the state_dict(), the losses it returned, and RecordingDDP's log."""
    losses, log = [], []

    def step(ddp, optimizer, inputs, targets):
        microbatches = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True))
        losses.append(train_step_accumulate(ddp, optimizer, microbatches, loss_fn))
        log.append(list(ddp.log))
        ddp.log.clear()

    def wrap(model):
        return RecordingDDP(model)

    state = train_on_rank(wrap, step, make_model, make_optimizer, state, batches)
    dist.barrier()  # as `replay` ends
    return {"state": state, "losses": losses, "log": log}


def losses_before_each_step(make_model, make_optimizer, loss_fn, batches: list, world_size: int,
                            state: dict) -> list:
    """Ground truth of the returned losses: one process trained on the whole batches from `state`; before each
    step, the mean loss over each rank's rows ([step][rank])."""
    model = make_model()
    model.load_state_dict(state)
    optimizer = make_optimizer(model.parameters())
    losses = []
    for inputs, targets in batches:
        with torch.no_grad():
            losses.append([loss_fn(model(x), y).item()
                           for x, y in zip(inputs.chunk(world_size), targets.chunk(world_size), strict=True)])
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return losses


def run_accumulating(train_step_accumulate, world_size: int, accumulate: int, make_model, make_optimizer, loss_fn,
                     batches: list) -> tuple[list, dict]:
    """One train_step_accumulate per batch on every rank (`train_accumulating`), from the same initial weights:
    each rank's result, and those weights."""
    states = initial_states(make_model, world_size, checks.generator(), same=True)
    got = checks.run(world_size, train_accumulating, train_step_accumulate, accumulate, make_model, make_optimizer,
                     loss_fn, per_rank=list(zip(states, rows_per_rank(batches, world_size), strict=True)))
    return got, states[0]


def check_accumulate(train_step_accumulate, world_size: int, accumulate: int, make_model, make_optimizer, loss_fn,
                     batches: list) -> None:
    """Train with one train_step_accumulate per batch; compare the returned losses and the parameters with one
    process, one optimizer step per whole batch (n x A micro-batches)."""
    got, state = run_accumulating(train_step_accumulate, world_size, accumulate, make_model, make_optimizer, loss_fn,
                                  batches)
    what = _steps_text(batches, world_size, accumulate)
    _assert_received_gradients(make_model, loss_fn, batches, world_size, what)
    expected = checks.train_one_process(make_model, make_optimizer, loss_fn, batches, state=state)
    expected_losses = losses_before_each_step(make_model, make_optimizer, loss_fn, batches, world_size, state)
    for rank, result in enumerate(got):
        for step, loss in enumerate(result["losses"]):
            # The mean of A float32 losses, each of an equal share of the rows: rtol 1e-5, atol 1e-6.
            checks.assert_number(loss, expected_losses[step][rank], rel=1e-5, abs_=1e-6,
                                 name=f"A={accumulate}, rank {rank}, step {step}: the returned loss (the mean over "
                                      "the micro-batches)")
        # Float32, summation order differs: rtol 1e-5, atol 1e-6.
        checks.assert_state_close(result["state"], expected, what=what, rank=rank, rtol=1e-5, atol=1e-6)


def check_synchronizes_once(train_step_accumulate, world_size: int, accumulate: int) -> None:
    """One step: RecordingDDP's log says the first A - 1 backwards ran in no_sync, then one outside it, then one
    finish; measured outside the ranks, they exchanged one average of the gradients, not more."""
    batches = regression_batches(2 * accumulate * world_size, steps=1)
    got, _ = run_accumulating(train_step_accumulate, world_size, accumulate, mlp, sgd, F.mse_loss, batches)
    measured = checks.last_traffic()
    _assert_received_gradients(mlp, F.mse_loss, batches, world_size, f"A={accumulate}")
    expected = ["backward in no_sync"] * (accumulate - 1) + ["backward", "finish"]
    for rank, result in enumerate(got):
        log = result["log"][0] if result["log"] else []
        assert log == expected, f"A={accumulate}, rank {rank}: expected the calls {expected}, got {log}"
        checks.count_comparison()
    one_average = ("all_reduce", gradient_bytes(mlp, F.mse_loss, batches[0]), None)
    assert_wire_agrees(world_size, [{"calls": [one_average]}] * world_size, measured,
                       f"A={accumulate}, one step on {world_size} ranks (one average of the gradients)")


def refused_empty(train_step_accumulate) -> dict:
    """On a rank: what train_step_accumulate did with no micro-batches (the test wants ValueError)."""
    ddp = RecordingDDP(mlp())
    result = probes.outcome(train_step_accumulate, ddp, sgd(ddp.parameters()), [], F.mse_loss)
    result.pop("returned", None)
    return result
