"""What a rank's thread computes and when its collectives run: the spans the timeline pictures draw.

    with trace.record() as tr:                    # compute spans found automatically
        train_step()
    with trace.record(auto_compute=False) as tr:  # or marked by the caller
        with tr.compute("forward"): ...
        with tr.compute("wait"): ddp.finish_gradient_synchronization()
    tr.as_dicts()  # [{lane, name, start_s, end_s, nbytes}, ...], lane "compute" or "comm"

A TorchDispatchMode times every operation the calling thread runs. With `auto_compute`, operations merge
into compute spans named "forward" or "backward" (inside the autograd engine); a gap between them is time
the thread spent elsewhere, typically blocked on a collective. A collective's span runs from the moment it
is issued until its work completes, read from the work's future where the backend provides one (gloo
does for all-gather, all-reduce and broadcast); otherwise a synchronous call ends by the next operation
(an upper bound) and an asynchronous one when an operation or a span boundary finds it completed.

Times are seconds since `origin_s`, a `time.perf_counter()` reading taken on entering the block: start
the ranks' blocks after a barrier and their timelines line up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["C10D_OPS", "FUNCTIONAL_OPS", "Span", "Trace", "collective_name", "largest_tensor_bytes", "record"]

# c10d operator -> the torch.distributed function that issues it (checks.py counts and forbids by these).
C10D_OPS = {
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced",
    "broadcast_": "broadcast", "reduce_": "reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather_single",
    "allgather_coalesced_": "all_gather_coalesced", "allgather_into_tensor_coalesced_": "all_gather_coalesced",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_coalesced",
    "gather_": "gather", "scatter_": "scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all_single",
    "barrier": "barrier", "monitored_barrier_": "monitored_barrier",
}


# Functional collectives (torch.distributed._functional_collectives, which DTensor uses) -> the same names.
# Their wait_tensor and _wrap_tensor_autograd move no data and are not listed.
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced_": "all_reduce_coalesced",
    "all_gather_into_tensor": "all_gather_single", "all_gather_into_tensor_out": "all_gather_single",
    "all_gather_into_tensor_coalesced": "all_gather_coalesced",
    "reduce_scatter_tensor": "reduce_scatter_single", "reduce_scatter_tensor_out": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_coalesced",
    "all_to_all_single": "all_to_all_single", "broadcast": "broadcast", "broadcast_": "broadcast",
    "isend": "send", "irecv": "recv", "batch_p2p_ops": "batch_p2p_ops",
}


def collective_name(op: str) -> str:
    """The collective behind a function name: `all_gather_single` and `all_gather_coalesced` are `all_gather`."""
    return op.removesuffix("_single").removesuffix("_coalesced")


def largest_tensor_bytes(args) -> int:
    """A call's message size S in the nccl-tests convention: its largest tensor (the whole buffer, i.e. the
    gathered output or the scattered input)."""
    sizes = [0]
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            for x in t if isinstance(t, list) else [t]:
                if isinstance(x, torch.Tensor):
                    sizes.append(x.numel() * x.element_size())
    return max(sizes)


@dataclass
class Span:
    lane: str  # "compute" or "comm"
    name: str  # "forward", "backward", a caller's name, or the collective's name
    start_s: float
    end_s: float
    nbytes: int = 0  # a collective's message size S (its largest tensor)


def _is_async(func, args: tuple, kwargs: dict | None) -> bool:
    """The `async_op` argument of a c10d operator call (True if the schema has none)."""
    names = [a.name for a in func._schema.arguments]
    if "async_op" not in names:
        return True
    i = names.index("async_op")
    return bool(args[i]) if i < len(args) else bool((kwargs or {}).get("async_op", True))


class Trace(TorchDispatchMode):
    """Compute and communication spans of this rank's thread inside a `with` block (module docstring).

    `auto_compute`: record compute spans from the operations themselves (else only `compute(name)` spans).
    `merge_gap_s`: consecutive operations closer than this join one compute span."""

    def __init__(self, *, auto_compute: bool = True, merge_gap_s: float = 2e-4):
        super().__init__()
        self.auto_compute, self.merge_gap_s = auto_compute, merge_gap_s
        self.origin_s = 0.0
        self.spans: list[Span] = []
        self._pending: list[tuple[Span, object]] = []  # asynchronous collectives whose work has no future
        self._unfinished: list[Span] = []  # synchronous collectives without a future: done by the next op

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled; torch's wrapper would import torch._dynamo (seconds) on first use

    def _now(self) -> float:
        return time.perf_counter() - self.origin_s

    def _poll(self, now: float) -> None:
        for span in self._unfinished:
            span.end_s = now
        self._unfinished = []
        still = []
        for span, work in self._pending:
            if work.is_completed():
                span.end_s = now
            else:
                still.append((span, work))
        self._pending = still

    def _add_compute(self, name: str, start: float, end: float) -> None:
        last = next((s for s in reversed(self.spans) if s.lane == "compute"), None)
        if last is not None and last.name == name and start - last.end_s < self.merge_gap_s:
            last.end_s = end
        else:
            self.spans.append(Span("compute", name, start, end))

    @contextmanager
    def compute(self, name: str) -> Iterator[None]:
        """Mark the block as one compute span called `name`."""
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            self._poll(end)
            self.spans.append(Span("compute", name, start, end))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self._now()
        if self._pending or self._unfinished:
            self._poll(start)
        out = func(*args, **(kwargs or {}))
        end = self._now()
        op = func.__name__.split(".")[0]
        if func.namespace == "c10d" and op in C10D_OPS:
            span = Span("comm", collective_name(C10D_OPS[op]), start, end, largest_tensor_bytes(args))
            self.spans.append(span)
            self._watch(span, out[-1] if isinstance(out, (tuple, list)) else out, _is_async(func, args, kwargs))
        elif self.auto_compute:
            self._add_compute("backward" if torch._C._current_autograd_node() is not None else "forward",
                              start, end)
        return out

    def _watch(self, span: Span, work, is_async: bool) -> None:
        try:
            work = torch._C._distributed_c10d.Work.unbox(work)
        except (AttributeError, RuntimeError, TypeError):
            return  # not a work object: the span is the call itself
        try:
            future = work.get_future()
        except RuntimeError:  # this backend's work has no future
            if is_async:
                self._pending.append((span, work))
            else:
                self._unfinished.append(span)
            return

        def done(_fut, span=span):
            span.end_s = self._now()

        future.then(done)

    def __enter__(self) -> Trace:
        self.spans, self._pending, self._unfinished = [], [], []
        self.origin_s = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        super().__exit__(*exc_info)
        end = self._now()
        for span in self._unfinished + [span for span, _work in self._pending]:  # it ended no later than now
            span.end_s = end
        self._pending, self._unfinished = [], []
        self.spans.sort(key=lambda s: s.start_s)

    def as_dicts(self) -> list[dict]:
        """The spans as plain dicts (lane, name, start_s, end_s, nbytes), in start order: what viz draws."""
        return [asdict(s) for s in self.spans]


def record(*, auto_compute: bool = True, merge_gap_s: float = 2e-4) -> Trace:
    """`with trace.record() as tr: ...`, then `tr.spans` or `tr.as_dicts()` (see `Trace`)."""
    return Trace(auto_compute=auto_compute, merge_gap_s=merge_gap_s)
