"""What the notebooks' tests ask of a learner's code: run it on N ranks, compare it with ground truth
computed independently, and count (or forbid) the collectives it calls.

A test cell reads like this (the checking function runs on every rank):

    def check(ring_all_reduce):
        x = checks.random_tensor((1000,), seed=dist.get_rank())
        expected = x.clone(); dist.all_reduce(expected)      # ground truth: the library
        with checks.only_point_to_point("ring_all_reduce"):
            ring_all_reduce(x)
        checks.assert_close(x, expected, name="ring_all_reduce(x)")

    checks.run(4, check, ring_all_reduce)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .cluster import session_cluster
from .trace import C10D_OPS, collective_name, largest_tensor_bytes

TEST_TIMEOUT_S = 30.0  # a deadlocked exercise fails its test after this long, not the notebook's cell limit

POINT_TO_POINT = frozenset({"send", "recv"})  # isend, irecv and batch_isend_irecv call these too


class ForbiddenCallError(RuntimeError):
    """An exercise called a collective it was asked to implement without."""


@dataclass
class Call:
    op: str  # the torch.distributed name, e.g. "all_reduce", "send"
    nbytes: int  # message size S: the largest tensor the call touches
    peer: int | None = None  # for send and recv: the other rank (in the group)


class CommCounter(TorchDispatchMode):
    """Records every torch.distributed call made under it (op, bytes, peer); may forbid some.

    Works at the dispatcher, so it sees `dist.all_reduce` however it was imported, and the
    collectives that autograd hooks launch during backward."""

    def __init__(self, forbid: Iterable[str] = (), *, allow: Iterable[str] | None = None, exercise: str = ""):
        super().__init__()
        self.forbid, self.allow, self.exercise = set(forbid), None if allow is None else set(allow), exercise
        self.calls: list[Call] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled; without this torch wraps the method in torch._disable_dynamo,
        # whose first call imports torch._dynamo: about 2 s on every rank.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.split(".")[0] in C10D_OPS:
            op = C10D_OPS[func.__name__.split(".")[0]]
            if op in self.forbid or (self.allow is not None and op not in self.allow):
                allowed = ("; it may use only send, recv, isend, irecv and batch_isend_irecv"
                           if self.allow == POINT_TO_POINT else f"; it may use only {', '.join(sorted(self.allow))}"
                           if self.allow is not None else "")
                raise ForbiddenCallError(f"{self.exercise or 'this code'} called dist.{op}{allowed}.")
            peer = args[2] if op in POINT_TO_POINT and len(args) > 2 and isinstance(args[2], int) else None
            self.calls.append(Call(op, largest_tensor_bytes(args), peer))
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> Counter:
        """How many times each op was called, e.g. Counter({"all_reduce": 2})."""
        return Counter(c.op for c in self.calls)

    def bytes_sent(self) -> int:
        """Bytes this rank sent with send/isend (what a ring algorithm's cost model counts)."""
        return sum(c.nbytes for c in self.calls if c.op == "send")


def count_collectives() -> CommCounter:
    """`with count_collectives() as comm: ...`, then `comm.counts`, `comm.calls`, `comm.bytes_sent()`."""
    return CommCounter()


def only_point_to_point(exercise: str) -> CommCounter:
    """Fail with a clear message if `exercise` calls anything but send/recv/isend/irecv/batch_isend_irecv."""
    return CommCounter(allow=POINT_TO_POINT, exercise=exercise)


def run(world_size: int, fn: Callable, *args, timeout: float = TEST_TIMEOUT_S, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on every rank of this kernel's CPU cluster of `world_size` ranks.

    Tests always run on CPU ranks (gloo), so a grade does not depend on the machine's GPUs."""
    return session_cluster(world_size, backend="gloo").call(fn, args, kwargs, timeout=timeout)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic test data: normal floats, or integers in [-100, 100); different for each seed."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    return t.to(device)


def _where() -> str:
    return f"rank {dist.get_rank()}: " if dist.is_initialized() else ""


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "result",
                 rtol: float | None = None, atol: float | None = None) -> None:
    """`torch.testing.assert_close` (float32 default: rtol 1.3e-6, atol 1e-5; exact for integers), with a
    message that names the rank, the tensor and the largest error."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{_where()}{name} should be a tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{_where()}{name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{_where()}{name} has dtype {actual.dtype}, expected {expected.dtype}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().nan_to_num(math.inf)
        index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
        raise AssertionError(
            f"{_where()}{name} differs from the expected value: largest error {diff.max().item():.3g} at index "
            f"{list(index)} (got {actual[index].item()!r}, expected {expected[index].item()!r}); "
            f"{int((diff > 0).sum())} of {diff.numel()} elements differ") from None


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "result") -> None:
    """Bitwise equality (for gathers, broadcasts, copies), with the same message as `assert_close`."""
    assert_close(actual, expected, name=name, rtol=0.0, atol=0.0)


def assert_raises(exc_type: type[BaseException], fn: Callable, *args, **kwargs) -> None:
    """Check that `fn(*args, **kwargs)` raises `exc_type` (a bad argument must be refused, not ignored)."""
    call = f"{getattr(fn, '__name__', fn)}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"
    try:
        fn(*args, **kwargs)
    except exc_type:
        return
    raise AssertionError(f"{_where()}{call} should raise {exc_type.__name__}")


def assert_trains_like_one_process(wrap: Callable, step: Callable, make_model: Callable, make_optimizer: Callable,
                                   loss_fn: Callable, batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                                   same_init: bool = False, rtol: float = 1e-5, atol: float = 1e-6):
    """The ground truth of data parallelism: N ranks, each training on its share of every batch, end where
    one process ends that trains the same model on the whole batches. Returns the wrapped model.

    On this rank: `wrapped = wrap(make_model(seed))`, seed = the rank (the ranks start different, and the
    wrapper must make them agree) or 0 with `same_init`, and `optimizer = make_optimizer(wrapped.parameters())`;
    then, for each global batch `(inputs, targets)`, `step(wrapped, optimizer, my_inputs, my_targets)` on this
    rank's equal share of the rows. The reference, `make_model(0)` in this process, takes one optimizer step
    per whole batch on `loss_fn(outputs, targets)`. Every entry of `wrapped.state_dict()` must be close to
    the reference's (parameters, frozen ones and buffers alike), within `rtol`/`atol`."""
    rank, n = dist.get_rank(), dist.get_world_size()
    wrapped = wrap(make_model(0 if same_init else rank))
    optimizer = make_optimizer(wrapped.parameters())
    reference = make_model(0)
    reference_optimizer = make_optimizer(reference.parameters())
    for inputs, targets in batches:
        if len(inputs) % n:
            raise ValueError(f"a batch of {len(inputs)} rows does not split evenly over {n} ranks")
        mine = slice(rank * len(inputs) // n, (rank + 1) * len(inputs) // n)
        step(wrapped, optimizer, inputs[mine], targets[mine])
        reference_optimizer.zero_grad()
        loss_fn(reference(inputs), targets).backward()
        reference_optimizer.step()
    actual, expected = wrapped.state_dict(), reference.state_dict()
    if list(actual) != list(expected):
        raise AssertionError(f"{_where()}state_dict() has the keys {list(actual)}, expected the wrapped model's "
                             f"{list(expected)}")
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, name=f"{name} after {len(batches)} steps", rtol=rtol, atol=atol)
    return wrapped


def collective_counts(comm: CommCounter) -> dict[str, int]:
    """`comm.counts` with the forms of one collective merged (`all_gather_single` and `all_gather_coalesced`
    count as `all_gather`), so a test accepts whichever form a learner called."""
    merged: Counter = Counter()
    for op, n in comm.counts.items():
        merged[collective_name(op)] += n
    return dict(merged)


def assert_shards_close(parallel: torch.nn.Module, reference: torch.nn.Module, *, group=None,
                        sum_replicated_grads: bool = False, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Each parameter of `parallel` is this rank's shard of `reference`'s parameter of the same name: the
    whole of it where the shapes agree, else slice `rank` of `size` equal slices along the one dimension
    where they differ (rank and size in `group`). Values must be equal; gradients close (rtol, atol).

    With `sum_replicated_grads`, the gradients of whole (replicated) parameters are summed over `group`
    first: under sequence parallelism each rank's copy saw only its own part of the sequence."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine, theirs = dict(parallel.named_parameters()), dict(reference.named_parameters())
    if set(mine) != set(theirs):
        raise AssertionError(f"{_where()}parameter names differ from the reference's: missing "
                             f"{sorted(set(theirs) - set(mine))}, unexpected {sorted(set(mine) - set(theirs))}")
    for name, p in mine.items():
        ref = theirs[name]
        split = [d for d in range(ref.dim()) if p.dim() == ref.dim() and p.shape[d] != ref.shape[d]]
        if p.dim() != ref.dim() or len(split) > 1 or (split and ref.shape[split[0]] != size * p.shape[split[0]]):
            raise AssertionError(f"{_where()}{name} has shape {tuple(p.shape)}: not the whole of the reference's "
                                 f"{tuple(ref.shape)} nor 1/{size} of it along one dimension")
        expected, expected_grad, grad = ref.detach(), ref.grad, p.grad
        if split:
            expected, expected_grad = expected.chunk(size, split[0])[rank], ref.grad.chunk(size, split[0])[rank]
        elif sum_replicated_grads and grad is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        assert_equal(p.detach(), expected, name=name)
        if grad is None:
            raise AssertionError(f"{_where()}{name} has no gradient")
        assert_close(grad, expected_grad, name=f"{name}.grad", rtol=rtol, atol=atol)


def in_groups_of(size: int, check: Callable, *args, **kwargs):
    """Run `check(*args, group=g, **kwargs)` where g is this rank's group of `size` consecutive ranks: a test
    that a function honours its `group` argument instead of using the whole world."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if n % size:
        raise ValueError(f"{n} ranks do not split into groups of {size}")
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, n, size)]  # all ranks make all
    return check(*args, **kwargs, group=groups[rank // size])
