"""A persistent group of N ranks started from the kernel: functions defined in a notebook run on all of them.

Ranks are forked from a forkserver that has already imported torch (`rank_server`), so they start
in a tenth of a second once it runs, and inherit none of the kernel's state (no CUDA context, no ZMQ
threads). Every call collects one result per rank; a rank that raises, dies or hangs turns into a
`RankError` or `RankTimeout` in the kernel, and the group restarts itself before the error is raised.

The kernel and its ranks stay in step: each request has an id that its replies echo, a call that ends
with a request still outstanding (an interrupt, an exception anywhere) replaces the ranks before the
exception goes on, and calls from several threads take turns. Before each call the ranks' health is
checked, so a rank that died or stopped between calls is named, not met as a broken pipe.

`Cluster` itself runs each request's exchange. `processes.RankProcesses` manages the processes,
`protocol` defines the messages, `output` shows what the ranks print, and `errors.call_error` builds
the error a call raises.
"""

from __future__ import annotations

import sys

if sys.platform == "win32":  # pragma: no cover - before the imports below, which need a POSIX system
    raise ImportError("cs336_parallel.cluster needs a POSIX system (Linux or macOS); on Windows use WSL2.")

import contextlib
import linecache
import math
import multiprocessing.connection
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from . import protocol
from .devices import resolve_backend
from .errors import RESTARTED, Outcome, RankError, call_error
from .output import CallOutput
from .processes import WAKE_S, RankProcess, RankProcesses, check_world_size
from .text import ranks_phrase

GRACE_S = 1.0  # after one rank fails, how long the others get to finish before they are stopped
Timeout = float | None | Literal["cluster"]  # seconds; None: no limit; "cluster": the cluster's own timeout


def check_timeout(timeout: Any) -> float | None:
    """A timeout in seconds: a positive number, or None for no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def select_ranks(ranks: Sequence[int] | None, world_size: int) -> list[int]:
    """The ranks a call runs on, sorted: all of them if `ranks` is None."""
    if ranks is None:
        return list(range(world_size))
    selected = sorted(set(ranks))
    if not selected or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size
                               for r in selected):
        raise ValueError(f"ranks must be a non-empty list of ranks in 0..{world_size - 1}, got {ranks!r}")
    return selected


class Cluster:
    """`world_size` ranks that run functions shipped from this process (with cloudpickle).

    >>> with Cluster(4) as cluster:
    ...     cluster.run(lambda: dist.get_rank())
    [0, 1, 2, 3]
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float | None = 60.0):
        check_world_size(world_size)
        self.timeout = check_timeout(timeout)
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self._processes = RankProcesses(world_size, self.backend)
        self._cell_count = 0
        self._request_id = 0
        self._lock = threading.RLock()  # one call at a time

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start the ranks (if not running) and wait until every one has joined the group."""
        with self._lock:
            if self._processes.needs_replacing:  # an earlier call or start was cut short
                self._processes.kill()
            if not self._processes:
                self._processes.launch()
            try:
                self._processes.await_ready()
            except BaseException:
                self._processes.kill()
                raise
        return self

    def restart(self) -> Cluster:
        """Stop the ranks, start new ones and wait for them (per-rank variables are reset)."""
        with self._lock:
            self._processes.kill()
            return self.start()

    def replace_ranks(self) -> None:
        """Kill the ranks and fork new ones now, without waiting for them: they join the group while the
        caller goes on, and the next call waits for them (per-rank variables are reset)."""
        with self._lock:
            self._processes.replace()

    @property
    def has_run(self) -> bool:
        """Whether the ranks have been sent a call or a cell since they started."""
        return self._processes.has_run

    def shutdown(self) -> None:
        """Stop every rank; nothing is left running."""
        with self._lock:
            self._processes.close()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def status(self) -> list[dict]:
        """pid, device and liveness of each rank."""
        return self._processes.status()

    # -- calls ------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, ranks: Sequence[int] | None = None, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank (or on `ranks`); one result per rank, in rank order."""
        return self.call(fn, args, kwargs, ranks=ranks)

    def call(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
             ranks: Sequence[int] | None = None, timeout: Timeout = "cluster") -> list:
        """`run` with the arguments spelled out, and a timeout for this call only."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, (dict, type(None))):
            raise TypeError(f"args must be a tuple and kwargs a dict, got {type(args).__name__} and "
                            f"{type(kwargs).__name__}")
        results = self._request(("call", fn, tuple(args), kwargs or {}), ranks, self._timeout(timeout))
        return [results[r] for r in sorted(results)]

    def call_each_rank(self, fn: Callable, per_rank: Sequence[tuple], *, timeout: Timeout = "cluster") -> list:
        """`fn(*per_rank[r])` on each rank r: each rank is sent its own arguments only; one result per rank."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if len(per_rank) != self.world_size or not all(isinstance(a, tuple) for a in per_rank):
            raise TypeError(f"per_rank must hold one tuple of arguments for each of the {self.world_size} ranks")
        results = self._request([("call", fn, args, {}) for args in per_rank], None, self._timeout(timeout))
        return [results[r] for r in sorted(results)]

    def run_cell(self, source: str, *, filename: str | None = None, pushed: dict | None = None,
                 ranks: Sequence[int] | None = None, timeout: Timeout = "cluster") -> None:
        """Execute `source` on each rank in the rank's persistent namespace (pre-seeded with torch,
        dist, rank, world_size, device), after adding `pushed` to it; a final expression is printed."""
        timeout = self._timeout(timeout)
        self._cell_count += 1
        filename = filename or f"<ranks cell {self._cell_count}>"
        # The kernel shows this cell's lines in tracebacks and stack dumps.
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        self._request(("cell", source, filename, pushed or {}), ranks, timeout)

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if isinstance(timeout, str) and timeout == "cluster" else check_timeout(timeout)

    def _request(self, request: tuple | list[tuple], ranks: Sequence[int] | None, timeout: float | None) -> dict:
        """Send `request` (or a list of them: one per rank) to the selected ranks and collect their replies.
        Everything that can be refused is refused before anything is sent; once it is sent, the ranks are replaced
        unless every reply came back, whatever interrupts the wait."""
        selected = select_ranks(ranks, self.world_size)
        with self._lock:
            self._request_id += 1
            each = request if isinstance(request, list) else [request] * self.world_size
            shared = {id(r): protocol.encode(self._request_id, r) for r in each}  # fails here if it cannot be shipped
            payloads = [shared[id(r)] for r in each]
            self.start()
            output = CallOutput(_print)
            self._check_health(output)
            targets = [self._processes[r] for r in selected]
            self._processes.has_run = self._processes.needs_replacing = True
            try:
                for r in targets:
                    with contextlib.suppress(OSError):  # a rank that just died: the wait below says how
                        r.conn.send_bytes(payloads[r.rank])
                outcome = self._collect(targets, timeout, self._request_id, output)
                self._processes.needs_replacing = bool(outcome.stuck)
                return self._conclude(outcome, timeout, output)
            except BaseException:
                if self._processes.needs_replacing:
                    self._processes.replace()
                raise

    def _check_health(self, output: CallOutput) -> None:
        """Before a call: every rank alive, running, and with nothing to say. Otherwise the rank is named in a
        `RankError`, raised after the group restarts."""
        unhealthy = self._processes.find_unhealthy()
        if unhealthy:
            rank, problem = unhealthy
            self._processes.drain(output)
            output.finish()
            details = output.recent_errors(rank)
            self._processes.replace()
            raise RankError(rank, f"rank {rank} {problem}.", [*details, RESTARTED])

    def _collect(self, targets: list[RankProcess], timeout: float | None, request_id: int,
                 output: CallOutput) -> Outcome:
        """Wait for one reply per rank, showing their output as it comes; stop waiting at the timeout, or
        GRACE_S after a first failure."""
        outcome = Outcome()
        running = {r.rank: r for r in targets}
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None
        try:
            while running:
                ends = [t for t in (deadline, grace_end) if t is not None]
                left = min(ends) - time.monotonic() if ends else WAKE_S
                if left <= 0:
                    break
                handles = {h: r for r in running.values() for h in r.handles()}
                streams = self._processes.open_streams()
                ready = multiprocessing.connection.wait([*handles, *streams], min(WAKE_S, left))
                for handle in ready:
                    if handle in streams:
                        pipes, kind = streams[handle]
                        pipes.read(kind, output)
                for handle in ready:
                    r = handles.get(handle)
                    if r is None or r.rank not in running:
                        continue
                    reply = r.receive(request_id)
                    if reply is None:  # a message from an earlier request: never taken for this one's
                        continue
                    del running[r.rank]
                    outcome.add(r.rank, reply)
                    if reply[0] != "ok":
                        grace_end = grace_end or time.monotonic() + GRACE_S
                output.flush_if_due()
        except KeyboardInterrupt:
            outcome.interrupted = True
        outcome.stuck = sorted(running)
        return outcome

    def _conclude(self, outcome: Outcome, timeout: float | None, output: CallOutput) -> dict:
        """The results, once the output is shown; or the error, once the ranks that need it are replaced."""
        self._processes.drain(output)
        output.finish()
        stacks, stopped = self._processes.dump_stacks(outcome.stuck)
        error = call_error(outcome, timeout, stacks, stopped,
                           {rank: output.recent_errors(rank) for rank in outcome.died})
        if error is None and outcome.group_gone:
            _print(f"[cluster] {ranks_phrase(outcome.group_gone)} destroyed the process group: the cluster "
                   "restarts its ranks (per-rank variables are reset).")
        if outcome.needs_new_ranks():
            self._processes.replace()
        if error is not None:
            raise error
        return outcome.results


_session: dict[tuple[int, str], Cluster] = {}  # this process's shared clusters, by (world size, backend)


def session_cluster(world_size: int, backend: str = "auto", **options) -> Cluster:
    """This process's shared cluster of `world_size` ranks on `backend` (the one `%cluster start`
    made, if it matches), started on first use and kept for later calls."""
    key = (world_size, resolve_backend(backend, world_size))
    if key not in _session:
        _session[key] = Cluster(world_size, backend=key[1], **options)
    return _session[key]


def set_session_cluster(cluster: Cluster) -> None:
    """Make `cluster` the shared one of its size and backend, shutting down the one it replaces."""
    key = (cluster.world_size, cluster.backend)
    old = _session.get(key)
    if old is not None and old is not cluster:
        old.shutdown()
    _session[key] = cluster


def _print(text: str) -> None:
    print(text, flush=True)
