"""How a test asks for a learner's work and judges it: the requests, the data it draws, the comparisons.

A test cell runs on one side of a trust boundary (`boundary`), the exercise on the other. It draws its data
itself, from seeds of its own that never cross (`generator`), sends each rank only that rank's share, and
compares what comes back with ground truth it computes from the same data:

    g = checks.generator()
    inputs = [checks.random_tensor((1000,), generator=g) for _ in range(4)]
    got = checks.run(4, collectives.all_reduce_driver, ring_all_reduce, per_rank=[(x,) for x in inputs])
    for rank, result in enumerate(got):                        # one result per rank, or the test fails
        checks.assert_close(result["x"], sum(inputs), name="x", rank=rank)
    checks.assert_received([3000] * 4, "all-reduce of 1000 floats")   # measured outside the ranks

The drivers (`cs336_parallel.testing`) run on the ranks and report what they saw as data (`probes`); the test
treats that as the rank's word, and checks it against what the grader measures from outside (`last_traffic`).
Every comparison is counted: a test that compared nothing fails (`testcell`).
"""

from __future__ import annotations

import math
import numbers
import os
import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .boundary import Boundary, RemoteError, unpack
from .probes import POINT_TO_POINT
from .text import shorten
from .trace import collective_name


def hang_timeout_s() -> float:
    """How long a test waits for its ranks: a deadlocked exercise fails its test after this long, not after the
    notebook's cell limit. 30 s, or CS336_TEST_TIMEOUT_S (read at each call: a grader sets it for the kernels)."""
    return float(os.environ.get("CS336_TEST_TIMEOUT_S", 30.0))


# -- the requests --------------------------------------------------------------------------------------------

_local = threading.local()


@contextmanager
def using(side: Boundary) -> Iterator[Boundary]:
    """Route this thread's requests through `side` while a test cell runs, and count its comparisons."""
    before = getattr(_local, "boundary", None), getattr(_local, "compared", 0)
    _local.boundary, _local.compared = side, 0
    try:
        yield side
    finally:
        _local.boundary, _local.compared = before


def compared() -> int:
    """How many comparisons the running test has made."""
    return getattr(_local, "compared", 0)


def count_comparison() -> None:
    _local.compared = compared() + 1


def _boundary() -> Boundary:
    side = getattr(_local, "boundary", None)
    if side is None:
        raise RuntimeError("checks.run and checks.call_each work inside a %%test cell (they reach the exercise "
                           "across the grader's boundary); to run a function on ranks yourself, use "
                           "cs336_parallel.session_cluster(n).run(fn, ...)")
    return side


def run(world_size: int, fn: Callable, *args, per_rank: Sequence[tuple] | None = None, timeout: float | None = None,
        fresh: bool = False, **kwargs) -> list:
    """Run the driver `fn(*args, *per_rank[r], **kwargs)` on each rank r of a fresh CPU cluster (gloo) of
    `world_size` ranks; exactly one plain result per rank, or AssertionError. Each rank receives its own
    `per_rank` entry only. The exercise goes in `args` (it travels by name); a failure raises `RemoteError` naming
    the case. `timeout`: seconds before a hang fails the test (default `hang_timeout_s()`). `fresh`: on ranks started
    anew, that hold nothing of an earlier run (before a run whose memory is measured)."""
    mine = [tuple(a) for a in per_rank] if per_rank is not None else [()] * world_size
    if len(mine) != world_size:
        raise ValueError(f"per_rank holds {len(mine)} entries for {world_size} ranks")
    try:
        results = _boundary().run(world_size, fn, args, kwargs, mine, timeout or hang_timeout_s(), fresh)
    except RemoteError as e:
        e.case = describe_case(world_size, fn, args, kwargs)
        raise
    if not isinstance(results, list) or len(results) != world_size:
        count = len(results) if isinstance(results, list) else type(results).__name__
        raise AssertionError(f"{describe_case(world_size, fn, args, kwargs)}: the notebook replied with {count} "
                             f"results for {world_size} ranks; a test needs one from each rank")
    return results


def call(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` in the notebook's kernel (no ranks): a driver of the package, with the exercise among
    its arguments; its plain result. (A test calls a function exercise directly: `name(...)`.)"""
    try:
        return _boundary().call(fn, args, kwargs)
    except RemoteError as e:
        e.case = _call_text(fn, args, kwargs)
        raise


def call_each(fn: Callable, cases: Iterable[tuple]) -> list:
    """`fn(*case)` for every case, in one request; the plain values in order. The first case that fails raises
    its `RemoteError`, naming the call."""
    cases = [tuple(c) for c in cases]
    replies = _boundary().call_each(fn, cases)
    if not isinstance(replies, list) or len(replies) != len(cases):
        raise AssertionError(f"{_call_text(fn, cases[0] if cases else (), {})}: the notebook replied to "
                             f"{len(replies) if isinstance(replies, list) else 'none'} of {len(cases)} calls")
    values = []
    for case, reply in zip(cases, replies, strict=True):
        try:
            values.append(unpack(reply))
        except RemoteError as e:
            e.case = _call_text(fn, case, {})
            raise
    return values


def last_traffic() -> list[list[int]] | None:
    """After `run`: `m[r][s]`, the bytes rank s received from rank r, measured outside the ranks' processes
    (`wire`); None where it cannot be measured (the notebook's own ranks on macOS, say)."""
    return _boundary().traffic


def last_memory() -> int | None:
    """After `run`: the most memory the ranks held together during it, above what they held before (bytes),
    measured outside their processes by the grader's memory cgroup; None where it cannot be measured (in the
    notebook, or where the grader has no cgroup)."""
    return _boundary().memory


def assert_memory_at_most(limit: float, what: str) -> None:
    """During the last `run`, the ranks together held at most `limit` bytes more than before it, measured outside
    their processes. Nothing is checked where memory cannot be measured."""
    used = last_memory()
    if used is None:
        return
    count_comparison()
    if used > limit:
        raise AssertionError(f"{what}: the ranks held {used / 2**20:.1f} MiB more during the call (measured outside "
                             f"them), more than the {limit / 2**20:.1f} MiB the spec allows")


def describe_case(world_size: int, fn: Callable, args: tuple, kwargs: dict) -> str:
    """`world size 3, all_reduce_driver(ring_all_reduce, ...)`: which case of a test ran."""
    return f"world size {world_size}, {_call_text(fn, args, kwargs)}"


def _call_text(fn: Callable, args: tuple, kwargs: dict) -> str:
    def short(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"tensor{tuple(value.shape)}"
        text = getattr(value, "__name__", None) if callable(value) else None
        return shorten(text or repr(value), 40)

    shown = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kwargs.items()]
    return f"{getattr(fn, '__name__', 'check')}({', '.join(shown)})"


# -- data ---------------------------------------------------------------------------------------------------------

def generator() -> torch.Generator:
    """A generator seeded from the system's randomness: the data a test draws from it cannot be predicted by the
    code it tests (the seed never crosses the boundary)."""
    return torch.Generator().manual_seed(secrets.randbits(62))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *,
                  generator: torch.Generator | None = None, seed: int | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Test data: normal floats, or integers in [-100, 100); drawn from `generator` (or a fixed `seed`, for data
    that may be known: a demonstration's)."""
    if (generator is None) == (seed is None):
        raise TypeError("random_tensor takes a generator or a seed")
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    return t.to(device)


# -- comparisons ----------------------------------------------------------------------------------------------

def _where(rank: int | None = None) -> str:
    return f"rank {rank}: " if rank is not None else ""


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "result", rank: int | None = None,
                 rtol: float | None = None, atol: float | None = None) -> None:
    """`torch.testing.assert_close` (float32 default: rtol 1.3e-6, atol 1e-5; exact for integers), with a
    message that names the rank (`rank`), the tensor and the largest error."""
    count_comparison()
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


def is_number(value) -> bool:
    """A number the specs allow: int, float, Fraction (and numpy scalars and Decimals, which arrive as these)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def assert_number(actual, expected, *, name: str, rel: float = 0.0, abs_: float = 0.0) -> None:
    """`actual` is a number (any kind the spec allows) equal to `expected`, exactly by default, else within `rel`
    (relative) or `abs_`; the message names it."""
    count_comparison()
    if not is_number(actual):
        raise AssertionError(f"{name} should be a number, got {type(actual).__name__} {shorten(repr(actual), 60)}")
    if not (actual == expected or math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_)):
        raise AssertionError(f"{name} is {shorten(str(actual), 40)}, expected {shorten(str(expected), 40)}")


def assert_raises(exc_type: type[BaseException], fn: Callable, *args, **kwargs) -> None:
    """Check that `fn(*args, **kwargs)` raises `exc_type` (a bad argument must be refused, not ignored). The blank
    stub's NotImplementedError is raised as it is, so that the test says the exercise is not done yet."""
    count_comparison()
    call_text = _call_text(fn, args, kwargs)
    try:
        fn(*args, **kwargs)
    except RemoteError as e:
        if e.is_a(exc_type):
            return
        if e.unfilled:
            raise
        raise AssertionError(f"{call_text} should raise {exc_type.__name__}, it raised {e.headline}") from None
    except exc_type:
        return
    raise AssertionError(f"{call_text} should raise {exc_type.__name__}")


def assert_each_raises(exc_type: type[BaseException], fn: Callable, cases: Iterable[tuple]) -> None:
    """`assert_raises` for every case, in one request."""
    cases = [tuple(c) for c in cases]
    replies = _boundary().call_each(fn, cases)
    if not isinstance(replies, list) or len(replies) != len(cases):
        raise AssertionError(f"{_call_text(fn, cases[0] if cases else (), {})}: the notebook did not reply to "
                             f"each of {len(cases)} calls")
    for case, reply in zip(cases, replies, strict=True):
        count_comparison()
        call_text = _call_text(fn, case, {})
        if not isinstance(reply, dict) or "error" not in reply:
            raise AssertionError(f"{call_text} should raise {exc_type.__name__}")
        error = RemoteError(reply["error"])
        if error.unfilled:
            error.case = call_text
            raise error
        if not error.is_a(exc_type):
            raise AssertionError(f"{call_text} should raise {exc_type.__name__}, it raised {error.headline}")


def assert_raised(result: dict, exc_type: type[BaseException], what: str, *, rank: int | None = None) -> None:
    """`probes.outcome`'s record says the call raised `exc_type`."""
    count_comparison()
    if not isinstance(result, dict) or "raised" not in result:
        raise AssertionError(f"{_where(rank)}{what} should raise {exc_type.__name__}")
    raised = result["raised"] if isinstance(result["raised"], list) else []
    if exc_type.__name__ not in raised:
        raise AssertionError(f"{_where(rank)}{what} should raise {exc_type.__name__}, it raised "
                             f"{(raised or ['something else'])[0]}: {result.get('message', '')}")


def assert_point_to_point(record: dict, exercise: str, *, rank: int | None = None) -> None:
    """A driver's `CommCounter.record()` shows only send/recv (isend, irecv and batch_isend_irecv call these), and
    no operation that bypassed the counter. (The rank's own word: see `assert_pairs` for what is measured.)"""
    count_comparison()
    for op, _, _ in record["calls"]:
        if op not in POINT_TO_POINT:
            raise AssertionError(f"{_where(rank)}{exercise} called dist.{op}; it may use only send, recv, isend, "
                                 "irecv and batch_isend_irecv")
    assert_nothing_hidden(record, exercise, rank=rank)


def assert_nothing_hidden(record: dict, exercise: str, *, rank: int | None = None) -> None:
    """No communication slipped past the counter (a dispatch mode switched off around a collective)."""
    count_comparison()
    if record["hidden"]:
        raise AssertionError(f"{_where(rank)}{exercise} issued {record['hidden']} communication operation(s) that "
                             "bypassed torch's dispatcher (a disabled dispatch mode?): every call must be visible "
                             "to the test")


def collective_counts(record: dict) -> dict[str, int]:
    """How many times a rank called each collective (a driver's `CommCounter.record()`), with the forms of one
    collective merged (`all_gather_single` and `all_gather_coalesced` count as `all_gather`)."""
    merged: Counter = Counter()
    for op, _, _ in record["calls"]:
        merged[collective_name(op)] += 1
    return dict(merged)


# -- traffic, measured outside the ranks ------------------------------------------------------------------------

# What gloo adds to each message on the wire (its header, the receiver's notice), measured on the masters of 01.
WIRE_BYTES_PER_MESSAGE = 256
WIRE_BYTES_SLACK = 2048


def assert_received(needed: Sequence[float] | float, what: str) -> None:
    """During the last `run`, each rank r received at least `needed[r]` bytes from the other ranks, measured
    outside their processes: a result that needs the others' data cannot come from less. Nothing is checked
    where the traffic cannot be measured."""
    traffic = last_traffic()
    if traffic is None:
        return
    count_comparison()
    n = len(traffic)
    needed = [needed] * n if isinstance(needed, numbers.Real) else list(needed)
    for rank in range(n):
        received = sum(traffic[r][rank] for r in range(n) if r != rank)
        if received < needed[rank]:
            raise AssertionError(f"{what}: rank {rank} received {received} bytes from the other ranks, fewer than the "
                                 f"{needed[rank]:.0f} its result needs: the ranks did not exchange the data")


def assert_received_together(needed: float, what: str) -> None:
    """During the last `run`, the ranks together received at least `needed` bytes from each other, measured outside
    them. Nothing is checked where the traffic cannot be measured."""
    traffic = last_traffic()
    if traffic is None:
        return
    count_comparison()
    received = sum(traffic[r][s] for r in range(len(traffic)) for s in range(len(traffic)) if r != s)
    if received < needed:
        raise AssertionError(f"{what}: the ranks received {received} bytes from each other (measured outside them), "
                             f"fewer than the {needed:.0f} the results need: the ranks did not exchange the data")


def assert_received_at_most(most: Sequence[float], what: str) -> None:
    """During the last `run`, each rank r received at most `most[r]` bytes from the other ranks, measured outside
    them (a rule that limits traffic: a reduce-scatter is not an all-reduce). Nothing is checked where the traffic
    cannot be measured."""
    traffic = last_traffic()
    if traffic is None:
        return
    count_comparison()
    n = len(traffic)
    for rank in range(n):
        received = sum(traffic[r][rank] for r in range(n) if r != rank)
        if received > most[rank]:
            raise AssertionError(f"{what}: rank {rank} received {received} bytes from the other ranks (measured "
                                 f"outside them), more than the {most[rank]:.0f} that rule allows")


def assert_pairs(expected: dict[tuple[int, int], float], messages: dict[tuple[int, int], int], what: str, *,
                 spread: float = 0) -> None:
    """During the last `run`, rank r sent rank s `expected[r, s]` bytes (give or take `spread`) in `messages[r, s]`
    messages (plus gloo's framing), and nothing to any other rank, measured outside their processes. Nothing is
    checked where the traffic cannot be measured."""
    traffic = last_traffic()
    if traffic is None:
        return
    count_comparison()
    n = len(traffic)
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            want, count = expected.get((src, dst), 0), messages.get((src, dst), 0)
            got = traffic[src][dst]
            low, high = want - spread, want + spread + count * WIRE_BYTES_PER_MESSAGE + WIRE_BYTES_SLACK
            if not low <= got <= high:
                raise AssertionError(f"{what}: rank {dst} received {got} bytes from rank {src} (measured outside the "
                                     f"ranks), expected {want:.0f}" + (f" in {count} messages" if count else ""))


# -- training and shards ----------------------------------------------------------------------------------------

def train_one_process(make_model: Callable, make_optimizer: Callable, loss_fn: Callable,
                      batches: list[tuple[torch.Tensor, torch.Tensor]], state: dict | None = None) -> dict:
    """The ground truth of data parallelism, on the test's side: `make_model()` (with `state` loaded, if given)
    trained in this process, one optimizer step per whole batch on `loss_fn(outputs, targets)`; its `state_dict()`."""
    model = make_model()
    if state is not None:
        model.load_state_dict(state)
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


def assert_shards_close(shards: list[dict], reference: torch.nn.Module, split: dict[str, int | None], *,
                        ranks: Iterable[int] | None = None, sum_replicated_grads: bool = False, rtol: float = 1e-5,
                        atol: float = 1e-5) -> None:
    """On the test's side: the ranks of one group hold their shards of `reference`, after the same backward.

    `shards[i]` is what the group's i-th rank reported of its module, each parameter by name:
    `{name: {"value": tensor, "grad": tensor or None}}`. `split[name]` says how the spec shards that parameter:
    along dimension d (rank i holds slice i of `len(shards)` equal slices), or None (every rank holds all of it).
    Values must be equal; gradients close (rtol, atol).

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
        dim = split[name]
        replicated = []  # the gradients of a whole parameter, rank by rank
        for i, (rank, mine) in enumerate(zip(ranks, shards, strict=True)):
            value, grad = mine[name]["value"], mine[name]["grad"]
            expected_value, expected_grad = ref.detach(), ref.grad
            if dim is not None:
                expected_value = expected_value.chunk(size, dim)[i]
                expected_grad = None if expected_grad is None else expected_grad.chunk(size, dim)[i]
            if not isinstance(value, torch.Tensor) or value.shape != expected_value.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                kind = f"slice {i} of {size} along dimension {dim}" if dim is not None else "the whole parameter"
                raise AssertionError(f"{_where(rank)}{name} has shape {shape}: it should be {kind}, "
                                     f"{tuple(expected_value.shape)}")
            assert_equal(value, expected_value, name=name, rank=rank)
            if grad is None:
                raise AssertionError(f"{_where(rank)}{name} has no gradient")
            if dim is not None or not sum_replicated_grads:
                assert_close(grad, expected_grad, name=f"{name}.grad", rank=rank, rtol=rtol, atol=atol)
            else:
                replicated.append(grad)
        if replicated:
            assert_close(sum(replicated), ref.grad, name=f"{name}.grad summed over ranks {ranks}", rtol=rtol,
                         atol=atol)
