"""What the notebooks' tests ask of a learner's code: run it, compare what it returns with ground truth
computed independently, and look at how it communicated.

A test cell runs on one side of a trust boundary (`boundary`), the exercise on the other. The cell calls the
exercise, or runs a *driver* of a `%%test_helpers` cell on the ranks with it, and gets plain data back; it
computes the expected values itself and compares:

    def run_all_reduce(ring_all_reduce, numel):            # a driver: runs on every rank, returns data
        x = checks.random_tensor((numel,), seed=dist.get_rank())
        with checks.count_collectives() as comm:
            ring_all_reduce(x)
        return {"x": x, "comm": comm.record()}

    got = checks.run(4, run_all_reduce, ring_all_reduce, 1000)   # in the test cell: one result per rank
    expected = sum(checks.random_tensor((1000,), seed=r) for r in range(4))
    for rank, result in enumerate(got):
        checks.assert_close(result["x"], expected, name="x", rank=rank)
        checks.assert_point_to_point(result["comm"], "ring_all_reduce", rank=rank)

Drivers run in the student's processes, so what they observe there (which collectives a rank called, the memory
it held) is reported as data; the comparisons, and every expected value, stay on the test's side.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .boundary import Boundary, RemoteError, unpack
from .text import shorten
from .trace import C10D_OPS, FUNCTIONAL_OPS, collective_name, largest_tensor_bytes


def hang_timeout_s() -> float:
    """How long a test waits for its ranks: a deadlocked exercise fails its test after this long, not after the
    notebook's cell limit. 30 s, or CS336_TEST_TIMEOUT_S (read at each call: a grader sets it for the kernels)."""
    return float(os.environ.get("CS336_TEST_TIMEOUT_S", 30.0))


POINT_TO_POINT = frozenset({"send", "recv"})  # isend, irecv and batch_isend_irecv call these too


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
    """Records every torch.distributed call made under it (op, bytes, peer); the test decides what is allowed.

    Works at the dispatcher, so it sees `dist.all_reduce` however it was imported, the functional
    collectives, and the collectives that autograd hooks launch during backward. On leaving the block it
    compares its count with the process groups' own sequence numbers: `hidden` counts the operations that
    slipped past the dispatcher (a disabled dispatch mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.hidden = 0
        self._before: dict = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled; without this torch wraps the method in torch._disable_dynamo,
        # whose first call imports torch._dynamo: about 2 s on every rank.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = _op_name(func)
        if op is not None:
            peer = args[2] if op in POINT_TO_POINT and len(args) > 2 and isinstance(args[2], int) else None
            self.calls.append(Call(op, largest_tensor_bytes(args), peer))
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> CommCounter:
        self._before = _sequence_numbers()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        super().__exit__(exc_type, exc, tb)
        issued = sum(n - self._before.get(group, 0) for group, n in _sequence_numbers().items())
        self.hidden = max(0, issued - len(self.calls))

    @property
    def counts(self) -> Counter:
        """How many times each op was called, e.g. Counter({"all_reduce": 2})."""
        return Counter(c.op for c in self.calls)

    def bytes_sent(self) -> int:
        """Bytes this rank sent with send/isend (what a ring algorithm's cost model counts)."""
        return sum(c.nbytes for c in self.calls if c.op == "send")

    def record(self) -> dict:
        """What the test needs, as data: {"calls": [(op, bytes, peer), ...], "hidden": operations not seen}."""
        return {"calls": [(c.op, c.nbytes, c.peer) for c in self.calls], "hidden": self.hidden}


def count_collectives() -> CommCounter:
    """`with count_collectives() as comm: ...`, then `comm.record()`, `comm.counts`, `comm.bytes_sent()`."""
    return CommCounter()


# -- what a test cell calls: the exercise, across the boundary ----------------------------------------------------

_local = threading.local()


@contextmanager
def using(side: Boundary) -> Iterator[Boundary]:
    """Route this thread's `run`, `call_each` and `last_traffic` through `side` while a test cell runs."""
    before = getattr(_local, "boundary", None)
    _local.boundary = side
    try:
        yield side
    finally:
        _local.boundary = before


def _boundary() -> Boundary:
    side = getattr(_local, "boundary", None)
    if side is None:
        raise RuntimeError("checks.run and checks.call_each work inside a %%test cell (they reach the exercise "
                           "across the grader's boundary); to run a function on ranks yourself, use "
                           "cs336_parallel.session_cluster(n).run(fn, ...)")
    return side


def run(world_size: int, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
    """Run the driver `fn(*args, **kwargs)` on every rank of a fresh CPU cluster (gloo) of `world_size` ranks;
    one plain result per rank. The exercise goes in `args` (it travels by name); a failure raises `RemoteError`
    naming the case. `timeout`: seconds before a hang fails the test (default `hang_timeout_s()`)."""
    try:
        return _boundary().run(world_size, fn, args, kwargs, timeout or hang_timeout_s())
    except RemoteError as e:
        e.case = describe_case(world_size, fn, args, kwargs)
        raise


def call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` in the notebook's kernel (no ranks): a driver of a `%%test_helpers` cell, with the
    exercise among its arguments; its plain result. (A test calls a function exercise directly: `name(...)`.)"""
    try:
        return _boundary().call(fn, args, kwargs)
    except RemoteError as e:
        e.case = _call_text(fn, args, kwargs)
        raise


def call_each(fn: Callable, cases: Iterable[tuple]) -> list:
    """`fn(*case)` for every case, in one request; the plain values in order. The first case that fails raises
    its `RemoteError`, naming the call."""
    cases = [tuple(c) for c in cases]
    values = []
    for case, reply in zip(cases, _boundary().call_each(fn, cases), strict=True):
        try:
            values.append(unpack(reply))
        except RemoteError as e:
            e.case = _call_text(fn, case, {})
            raise
    return values


def last_traffic() -> int | None:
    """Bytes the ranks of the last `run` moved over their network, measured outside their processes (the grader
    reads the sandbox's loopback counters); None where that cannot be measured (no sandbox, or in the notebook)."""
    return _boundary().traffic


def describe_case(world_size: int, fn: Callable, args: tuple, kwargs: dict) -> str:
    """`world size 3, run_all_reduce(ring_all_reduce, (13,), torch.int64)`: which case of a test ran."""
    return f"world size {world_size}, {_call_text(fn, args, kwargs)}"


def _call_text(fn: Callable, args: tuple, kwargs: dict) -> str:
    def short(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        text = getattr(value, "__name__", None) if callable(value) else None
        return shorten(text or repr(value), 40)

    shown = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{getattr(fn, '__name__', 'check')}({', '.join(shown)})"


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *, seed: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic test data: normal floats, or integers in [-100, 100); different for each seed."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    return t.to(device)


def _where(rank: int | None = None) -> str:
    if rank is None and dist.is_initialized():
        rank = dist.get_rank()
    return f"rank {rank}: " if rank is not None else ""


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "result", rank: int | None = None,
                 rtol: float | None = None, atol: float | None = None) -> None:
    """`torch.testing.assert_close` (float32 default: rtol 1.3e-6, atol 1e-5; exact for integers), with a
    message that names the rank (`rank`), the tensor and the largest error."""
    where = _where(rank)
    if type(actual) is not torch.Tensor and type(actual) is not torch.nn.Parameter:
        raise AssertionError(f"{where}{name} should be a tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{where}{name} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{where}{name} has dtype {actual.dtype}, expected {expected.dtype}")
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol)
    except AssertionError:
        diff = (actual.detach().double().cpu() - expected.detach().double().cpu()).abs().nan_to_num(math.inf)
        index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else ()
        raise AssertionError(
            f"{where}{name} differs from the expected value: largest error {diff.max().item():.3g} at index "
            f"{list(index)} (got {actual[index].item()!r}, expected {expected[index].item()!r}); "
            f"{int((diff > 0).sum())} of {diff.numel()} elements differ") from None


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "result",
                 rank: int | None = None) -> None:
    """Bitwise equality (for gathers, broadcasts, copies), with the same message as `assert_close`."""
    assert_close(actual, expected, name=name, rank=rank, rtol=0.0, atol=0.0)


def assert_raises(exc_type: type[BaseException], fn: Callable, *args, **kwargs) -> None:
    """Check that `fn(*args, **kwargs)` raises `exc_type` (a bad argument must be refused, not ignored). The blank
    stub's NotImplementedError is raised as it is, so that the test says the exercise is not done yet."""
    call = _call_text(fn, args, kwargs)
    try:
        fn(*args, **kwargs)
    except RemoteError as e:
        if e.is_a(exc_type):
            return
        if e.unfilled:
            raise
        raise AssertionError(f"{call} should raise {exc_type.__name__}, it raised {e.headline}") from None
    except exc_type:
        return
    raise AssertionError(f"{_where(None)}{call} should raise {exc_type.__name__}")


def assert_each_raises(exc_type: type[BaseException], fn: Callable, cases: Iterable[tuple]) -> None:
    """`assert_raises` for every case, in one request."""
    cases = [tuple(c) for c in cases]
    for case, reply in zip(cases, _boundary().call_each(fn, cases), strict=True):
        call = _call_text(fn, case, {})
        if "ok" in reply:
            raise AssertionError(f"{call} should raise {exc_type.__name__}")
        error = RemoteError(reply["error"])
        if error.unfilled:
            error.case = call
            raise error
        if not error.is_a(exc_type):
            raise AssertionError(f"{call} should raise {exc_type.__name__}, it raised {error.headline}")


def outcome(fn: Callable, *args, **kwargs) -> dict:
    """For a driver: what `fn(*args, **kwargs)` did, as data: {"returned": value} or {"raised": [type names,
    most derived first], "message": text}. The test decides what it should have done (`assert_raised`)."""
    try:
        return {"returned": fn(*args, **kwargs)}
    except Exception as e:  # noqa: BLE001 - reported, not judged, here
        return {"raised": [c.__name__ for c in type(e).__mro__ if c not in (object, BaseException)],
                "message": str(e)[:500]}


def assert_raised(result: dict, exc_type: type[BaseException], what: str, *, rank: int | None = None) -> None:
    """`outcome`'s record says the call raised `exc_type`."""
    if "raised" not in result:
        raise AssertionError(f"{_where(rank)}{what} should raise {exc_type.__name__}")
    if exc_type.__name__ not in result["raised"]:
        raise AssertionError(f"{_where(rank)}{what} should raise {exc_type.__name__}, it raised "
                             f"{result['raised'][0]}: {result['message']}")


def assert_point_to_point(record: dict, exercise: str, *, rank: int | None = None) -> None:
    """A driver's `CommCounter.record()` shows only send/recv (isend, irecv and batch_isend_irecv call these), and
    no operation that bypassed the counter."""
    for op, _, _ in record["calls"]:
        if op not in POINT_TO_POINT:
            raise AssertionError(f"{_where(rank)}{exercise} called dist.{op}; it may use only send, recv, isend, "
                                 "irecv and batch_isend_irecv")
    assert_nothing_hidden(record, exercise, rank=rank)


def assert_nothing_hidden(record: dict, exercise: str, *, rank: int | None = None) -> None:
    """No communication slipped past the counter (a dispatch mode switched off around a collective)."""
    if record["hidden"]:
        raise AssertionError(f"{_where(rank)}{exercise} issued {record['hidden']} communication operation(s) that "
                             "bypassed torch's dispatcher (a disabled dispatch mode?): every call must be visible "
                             "to the test")


# Loopback traffic, measured outside the sandbox, against the bytes the drivers say were sent: each message costs
# bytes of its own (TCP/IP headers, gloo's framing, acknowledgements), measured on the masters of notebook 01.
WIRE_BYTES_PER_MESSAGE = 512
WIRE_BYTES_SLACK = 4096


def assert_wire_agrees(records: list[dict], what: str) -> None:
    """The bytes the ranks say they sent (their drivers' `CommCounter.record()`s) are the bytes that crossed their
    network, measured from outside (`last_traffic`): a call hidden from the counters, or one reported but never
    made, shows up as a difference. Nothing is checked where the traffic cannot be measured."""
    measured = last_traffic()
    if measured is None:
        return
    reported = sum(nbytes for r in records for op, nbytes, _ in r["calls"] if op == "send")
    messages = sum(1 for r in records for op, _, _ in r["calls"] if op == "send")
    if not reported <= measured <= reported + messages * WIRE_BYTES_PER_MESSAGE + WIRE_BYTES_SLACK:
        raise AssertionError(f"{what}: the ranks report sending {reported} bytes in {messages} messages, but "
                             f"{measured} bytes crossed their network: communication the counters did not see, "
                             "or that did not happen")


def train_my_share(wrap: Callable, step: Callable, make_model: Callable, make_optimizer: Callable,
                   batches: list[tuple[torch.Tensor, torch.Tensor]], *, same_init: bool = False) -> dict:
    """For a driver: train `wrap(make_model(seed))` on this rank's equal share of the rows of every batch, with
    `step(wrapped, optimizer, my_inputs, my_targets)`; seed = the rank (the ranks start different, and the wrapper
    must make them agree) or 0 with `same_init`. Returns the wrapped model's `state_dict()` (the test compares it
    with `train_one_process`'s)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    wrapped = wrap(make_model(0 if same_init else rank))
    optimizer = make_optimizer(wrapped.parameters())
    for inputs, targets in batches:
        if len(inputs) % n:
            raise ValueError(f"a batch of {len(inputs)} rows does not split evenly over {n} ranks")
        mine = slice(rank * len(inputs) // n, (rank + 1) * len(inputs) // n)
        step(wrapped, optimizer, inputs[mine], targets[mine])
    return dict(wrapped.state_dict())


def train_one_process(make_model: Callable, make_optimizer: Callable, loss_fn: Callable,
                      batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The ground truth of data parallelism, on the test's side: `make_model(0)` trained in this process, one
    optimizer step per whole batch on `loss_fn(outputs, targets)`; its `state_dict()`."""
    model = make_model(0)
    optimizer = make_optimizer(model.parameters())
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def assert_state_close(actual: dict, expected: dict, *, what: str, rank: int | None = None,
                       rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """A state dict (a driver's result) has the expected keys, in order, and every entry close to the expected."""
    if not isinstance(actual, dict) or list(actual) != list(expected):
        keys = list(actual) if isinstance(actual, dict) else type(actual).__name__
        raise AssertionError(f"{_where(rank)}state_dict() has the keys {keys}, expected the wrapped model's "
                             f"{list(expected)}")
    for name, tensor in expected.items():
        assert_close(actual[name], tensor, name=f"{name} {what}", rank=rank, rtol=rtol, atol=atol)


def collective_counts(comm: CommCounter) -> dict[str, int]:
    """`comm.counts` with the forms of one collective merged (`all_gather_single` and `all_gather_coalesced`
    count as `all_gather`), so a test accepts whichever form a learner called."""
    merged: Counter = Counter()
    for op, n in comm.counts.items():
        merged[collective_name(op)] += n
    return dict(merged)


def assert_shards_close(shards: list[dict], reference: torch.nn.Module, *, ranks: Iterable[int] | None = None,
                        sum_replicated_grads: bool = False, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """On the test's side: the ranks of one group hold their shards of `reference`, after the same backward.

    `shards[i]` is what the group's i-th rank reported of its module, each parameter by name:
    `{name: {"value": tensor, "grad": tensor or None}}`. Each must be that rank's shard of `reference`'s parameter
    of the same name: the whole of it where the shapes agree, else slice i of `len(shards)` equal slices along the
    one dimension where they differ. Values must be equal; gradients close (rtol, atol).

    With `sum_replicated_grads`, the gradients of whole (replicated) parameters are summed over the group first:
    under sequence parallelism each rank's copy saw only its own part of the sequence. `ranks` are the ranks'
    numbers for the messages (default 0, 1, ...)."""
    size, expected = len(shards), dict(reference.named_parameters())
    ranks = list(range(size)) if ranks is None else list(ranks)
    for rank, mine in zip(ranks, shards, strict=True):
        if not isinstance(mine, dict) or set(mine) != set(expected):
            names = sorted(mine) if isinstance(mine, dict) else type(mine).__name__
            raise AssertionError(f"{_where(rank)}the parameters are named {names}, the reference's "
                                 f"{sorted(expected)}")
    for name, ref in expected.items():
        replicated = []  # the gradients of a whole parameter, rank by rank
        for i, (rank, mine) in enumerate(zip(ranks, shards, strict=True)):
            value, grad = mine[name]["value"], mine[name]["grad"]
            dims = [d for d in range(ref.dim()) if value.dim() == ref.dim() and value.shape[d] != ref.shape[d]]
            sliced = len(dims) == 1 and ref.shape[dims[0]] == size * value.shape[dims[0]]
            if value.dim() != ref.dim() or (dims and not sliced):
                raise AssertionError(f"{_where(rank)}{name} has shape {tuple(value.shape)}: not the whole of the "
                                     f"reference's {tuple(ref.shape)} nor 1/{size} of it along one dimension")
            expected_value, expected_grad = ref.detach(), ref.grad
            if dims:  # this rank's slice
                expected_value, expected_grad = (t.chunk(size, dims[0])[i] for t in (expected_value, expected_grad))
            assert_equal(value, expected_value, name=name, rank=rank)
            if grad is None:
                raise AssertionError(f"{_where(rank)}{name} has no gradient")
            if dims or not sum_replicated_grads:
                assert_close(grad, expected_grad, name=f"{name}.grad", rank=rank, rtol=rtol, atol=atol)
            else:
                replicated.append(grad)
        if replicated:
            assert_close(sum(replicated), ref.grad, name=f"{name}.grad summed over ranks {ranks}", rtol=rtol,
                         atol=atol)
