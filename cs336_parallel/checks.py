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

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .cluster import Cluster
from .errors import RankError
from .text import shorten
from .trace import C10D_OPS, FUNCTIONAL_OPS, collective_name, largest_tensor_bytes

# A deadlocked exercise fails its test after this long, not after the notebook's cell limit.
TEST_TIMEOUT_S = float(os.environ.get("CS336_TEST_TIMEOUT_S", 30.0))

POINT_TO_POINT = frozenset({"send", "recv"})  # isend, irecv and batch_isend_irecv call these too


class ForbiddenCallError(RuntimeError):
    """An exercise called a collective it was asked to implement without, or hid a call from the counter."""


@dataclass
class Call:
    op: str  # the torch.distributed name, e.g. "all_reduce", "send"
    nbytes: int  # message size S: the largest tensor the call touches
    peer: int | None = None  # for send and recv: the other rank (in the group)


def _op_name(func) -> str | None:
    """The torch.distributed name of a communication operator (c10d's or a functional collective), else None."""
    name = func.__name__.split(".")[0]
    if func.namespace == "c10d":
        return C10D_OPS.get(name)
    if func.namespace in ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional"):
        return FUNCTIONAL_OPS.get(name)
    return None


def _sequence_numbers() -> dict:
    """How many operations each process group of this rank has issued (counted by the group itself, in C++)."""
    if not dist.is_initialized():
        return {}
    from torch.distributed import distributed_c10d

    numbers = {}
    for group in list(distributed_c10d._world.pg_map):
        try:
            numbers[group] = group._get_sequence_number_for_group()
        except (RuntimeError, AttributeError):  # a backend that keeps no count
            pass
    return numbers


class CommCounter(TorchDispatchMode):
    """Records every torch.distributed call made under it (op, bytes, peer); may forbid some.

    Works at the dispatcher, so it sees `dist.all_reduce` however it was imported, the functional
    collectives, and the collectives that autograd hooks launch during backward. On leaving the block it
    compares its count with the process groups' own sequence numbers: an operation that slipped past the
    dispatcher (a disabled dispatch mode) is reported, not ignored."""

    def __init__(self, forbid: Iterable[str] = (), *, allow: Iterable[str] | None = None, exercise: str = ""):
        super().__init__()
        self.forbid, self.allow, self.exercise = set(forbid), None if allow is None else set(allow), exercise
        self.calls: list[Call] = []
        self._before: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled; without this torch wraps the method in torch._disable_dynamo,
        # whose first call imports torch._dynamo: about 2 s on every rank.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = _op_name(func)
        if op is not None:
            if op in self.forbid or (self.allow is not None and op not in self.allow):
                allowed = ("; it may use only send, recv, isend, irecv and batch_isend_irecv"
                           if self.allow == POINT_TO_POINT else f"; it may use only {', '.join(sorted(self.allow))}"
                           if self.allow is not None else "")
                raise ForbiddenCallError(f"{self.exercise or 'this code'} called dist.{op}{allowed}.")
            peer = args[2] if op in POINT_TO_POINT and len(args) > 2 and isinstance(args[2], int) else None
            self.calls.append(Call(op, largest_tensor_bytes(args), peer))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> CommCounter:
        self._before = _sequence_numbers()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            issued = sum(n - self._before.get(group, 0) for group, n in _sequence_numbers().items())
            if issued > len(self.calls):
                raise ForbiddenCallError(
                    f"{self.exercise or 'this code'} issued {issued - len(self.calls)} communication operation(s) "
                    "that bypassed torch's dispatcher (a disabled dispatch mode?): every call must be visible "
                    "to the test.")

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


_grading: dict[int, Cluster] = {}  # the test cells' own CPU clusters, by world size


def run(world_size: int, fn: Callable, *args, timeout: float = TEST_TIMEOUT_S, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on every rank of a CPU cluster (gloo) of `world_size` ranks; one result per
    rank, converted to plain values (`plain`).

    Tests use clusters of their own, apart from the notebook's: `%%test` restarts them before each test
    cell, so nothing an earlier cell ran on a rank is still there, and each rank checks after every call
    that the code it ran changed none of the functions tests rely on (`integrity`). Tests always run on
    CPU ranks, so a grade does not depend on the machine's GPUs."""
    if world_size not in _grading:
        _grading[world_size] = Cluster(world_size, backend="gloo", check_integrity=True)
    try:
        results = _grading[world_size].call(fn, args, kwargs, timeout=timeout)
    except RankError as e:
        e.case = describe_case(world_size, fn, args, kwargs)  # `%%test` puts it first in its one-line verdict
        raise
    return [plain(r, name=f"the result of rank {i}") for i, r in enumerate(results)]


def describe_case(world_size: int, fn: Callable, args: tuple, kwargs: dict) -> str:
    """`world size 3, check_all_reduce(ring_all_reduce, (13,), torch.int64)`: which case of a test ran."""
    def short(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        text = getattr(value, "__name__", None) if callable(value) else None
        return shorten(text or repr(value), 40)

    shown = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"world size {world_size}, {getattr(fn, '__name__', 'check')}({', '.join(shown)})"


_tested: object = None  # what the test clusters' ranks last ran tests of


def fresh_ranks(tested: object = None) -> None:
    """Replace the ranks of every test cluster that has run something, unless they ran the tests of `tested`
    (an exercise and its definition): `%%test` calls this before each test, so no test sees what a test of
    another exercise, or another definition of this one, left on a rank."""
    global _tested
    if tested is None or tested != _tested:
        for cluster in _grading.values():
            if cluster.has_run:
                cluster.replace_ranks()
    _tested = tested


class NotPlainError(TypeError):
    """A result that is not one of the plain types a test compares (it could compare equal to anything)."""


_SCALARS = (type(None), bool, int, float, complex, str, bytes, Fraction, torch.dtype, torch.device, torch.Size)


def plain(value, *, name: str = "the result"):
    """`value` rebuilt from plain types only: None, numbers, strings, tensors, and lists, tuples, dicts and
    the package's dataclasses of them. A test compares these, never an object an answer made: a result
    whose `__eq__` is always true, or a tensor subclass, is refused with `NotPlainError`."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, int):  # subclasses of the builtins: their base value, without their methods
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if kind is torch.Tensor:  # keeps its autograd graph: a test may backpropagate through an exercise's result
        return value
    if kind is torch.nn.Parameter:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.detach(value)
    if isinstance(value, list):
        return [plain(v, name=name) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return tuple(plain(v, name=name) for v in tuple.__iter__(value))
    if isinstance(value, dict):
        return {plain(k, name=name): plain(v, name=name) for k, v in dict.items(value)}
    if dataclasses.is_dataclass(value) and kind.__module__.startswith("cs336_parallel."):
        return kind(**{f.name: plain(object.__getattribute__(value, f.name), name=name)
                       for f in dataclasses.fields(kind) if f.init})
    raise NotPlainError(f"{name} is a {kind.__module__}.{kind.__qualname__}; a test compares only plain values "
                        "(numbers, strings, tensors, and lists, tuples and dicts of them)")


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
    if type(actual) is not torch.Tensor and type(actual) is not torch.nn.Parameter:
        raise AssertionError(f"{_where()}{name} should be a tensor, got {type(actual).__name__}")
    actual = plain(actual, name=name)
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
