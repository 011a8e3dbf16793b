"""What a test's driver observes on a rank, reported as data: the communication calls it made, and what a call
did (returned or raised). This runs in the student's processes, so the test treats it as the rank's own word:
what can be measured from outside (bytes between ranks, `wire`) is checked against it (`checks`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .trace import C10D_OPS, FUNCTIONAL_OPS, largest_tensor_bytes

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


def outcome(fn: Callable, *args, **kwargs) -> dict:
    """What `fn(*args, **kwargs)` did, as data: {"returned": value} or {"raised": [type names, most derived first],
    "message": text}. The test decides what it should have done (`checks.assert_raised`)."""
    try:
        return {"returned": fn(*args, **kwargs)}
    except Exception as e:  # noqa: BLE001 - reported, not judged, here
        return {"raised": [c.__name__ for c in type(e).__mro__ if c not in (object, BaseException)],
                "message": str(e)[:500]}
