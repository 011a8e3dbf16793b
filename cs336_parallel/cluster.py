"""A persistent group of N ranks started from the kernel: functions defined in a notebook run on all of them.

Ranks are forked from a forkserver that has already imported torch (`rank_server`), so they start
in a tenth of a second once it runs, and inherit none of the kernel's state (no CUDA context, no ZMQ
threads). Every call collects one result per rank; a rank that raises, dies or hangs turns into a
`RankError` or `RankTimeout` in the kernel, and the group restarts itself before the error is raised.

The kernel and its ranks stay in step: each request has an id that its replies echo, a call that ends
with a request still outstanding (an interrupt, an exception anywhere) replaces the ranks before the
exception goes on, and calls from several threads take turns. Before each call the ranks' health is
checked, so a rank that died or stopped between calls is named, not met as a broken pipe.
"""

from __future__ import annotations

import atexit
import contextlib
import linecache
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import numbers
import os
import resource
import shutil
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import rank_server, worker
from .errors import (
    RankError,
    RankInterrupt,
    RankTimeout,
    collective_mismatch,
    format_failure,
    format_stacks,
    parse_stack_dump,
)
from .output import CallOutput
from .worker import Failure

GRACE_S = 1.0  # after one rank fails, how long the others get to finish before they are stopped
START_TIMEOUT_S = 120.0
WAKE_S = 0.1  # waits wake this often: a Ctrl-C the OS hands to another thread only runs when the main one does
PG_TIMEOUT_S = 1800.0  # gloo/NCCL's own limit; the cluster's timeout normally fires long before
BACKENDS = ("auto", "gloo", "nccl")
CLUSTER_TIMEOUT = object()  # "use the cluster's own timeout" (None means no limit)
RANK_MEMORY_BYTES = 100 * 2**20  # what a rank needs of its own, at least (torch's pages are shared with the server)
KERNEL_FDS_PER_RANK = 6  # its request pipe, two output pipes, its exit sentinel, and room
RANK_FDS = 32  # what a rank opens for itself (about 15), with room; plus two per peer
READ_BYTES = 1 << 16
DRAIN_BYTES = 1 << 22  # read at most this much of a stream after a call (a thread may still be printing)
RESTARTED = "The cluster restarts before the next call (per-rank variables are reset)."

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()
_swept = False  # this process has removed the folders that killed kernels left


def device() -> torch.device:
    """This rank's device: its own GPU under NCCL, the CPU under gloo (here or under torchrun)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_backend(backend: str, world_size: int) -> str:
    """`auto` means NCCL when every rank can have its own GPU, gloo otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count()  # counts through NVML: the kernel does not initialize CUDA
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, but this "
                         f"machine has {gpus} GPU(s). Use backend='gloo' (CPU) or 'auto'.")
    return backend


def check_world_size(world_size: int) -> None:
    """Refuse a world size that is not a positive integer, or that this machine cannot hold, saying why."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    too_many = f"world_size={world_size} is more than this machine can hold: {world_size} ranks need"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        free = soft - _open_fds()
        if world_size * KERNEL_FDS_PER_RANK > free:
            raise ValueError(f"{too_many} about {world_size * KERNEL_FDS_PER_RANK} file descriptors in this "
                             f"process, and {free} of its {soft} are free (`ulimit -n` raises the limit).")
        if RANK_FDS + 2 * world_size > soft:
            raise ValueError(f"{too_many} about {RANK_FDS + 2 * world_size} file descriptors each (two per peer), "
                             f"and a process may open {soft} (`ulimit -n` raises the limit).")
    memory = _available_memory()
    if memory is not None and world_size * RANK_MEMORY_BYTES > memory:
        raise ValueError(f"{too_many} about {_gib(world_size * RANK_MEMORY_BYTES)} of memory "
                         f"({RANK_MEMORY_BYTES // 2**20} MiB each), and {_gib(memory)} is available.")


def check_timeout(timeout: Any) -> float | None:
    """A timeout in seconds: a positive number, or None for no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


@dataclass
class _Rank:
    rank: int
    process: Any  # multiprocessing.Process
    conn: multiprocessing.connection.Connection  # requests and replies
    out: multiprocessing.connection.Connection  # the read ends of its stdout and stderr
    err: multiprocessing.connection.Connection
    stack: str  # the file its stack is dumped to
    info: dict = field(default_factory=dict)  # filled by the rank's "ready" message
    closed: set = field(default_factory=set)  # its output streams at end of file


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, Failure | str] = field(default_factory=dict)  # a str says how the rank died
    stuck: list[int] = field(default_factory=list)  # ranks still running when the wait ended
    interrupted: bool = False
    group_gone: list[int] = field(default_factory=list)  # ranks whose process group was destroyed


class Cluster:
    """`world_size` ranks that run functions shipped from this process (with cloudpickle).

    >>> with Cluster(4) as cluster:
    ...     cluster.run(lambda: dist.get_rank())
    [0, 1, 2, 3]
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float | None = 60.0, *,
                 check_integrity: bool = False):
        check_world_size(world_size)
        self.timeout = check_timeout(timeout)
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self.check_integrity = check_integrity  # ranks refuse to go on after code replaced what tests rely on
        self.used = False  # has run something since its ranks started
        self._ranks: list[_Rank] = []
        self._dir: str | None = None  # private: the store, the stack dumps
        self._dir_lock: int | None = None
        self._cell_count = 0
        self._request_id = 0
        self._in_step = True  # no request is outstanding on the ranks, which are all started or all gone
        self._lock = threading.RLock()  # one call at a time
        _live.add(self)

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start the ranks (if not running) and wait until every one has joined the group."""
        with self._lock:
            if not self._in_step:  # an earlier call or start was cut short
                self._kill()
            if not self._ranks:
                self._launch()
            try:
                self._await_ready()
            except BaseException:
                self._kill()
                raise
        return self

    def restart(self) -> Cluster:
        with self._lock:
            self._kill()
            return self.start()

    def restart_soon(self) -> None:
        """Replace the ranks now without waiting for them: they join the group while the caller goes on."""
        with self._lock:
            self._restart_in_background()

    def shutdown(self) -> None:
        """Stop every rank; nothing is left running."""
        with self._lock:
            for r in self._ranks:
                with contextlib.suppress(OSError):
                    worker.send(r.conn, 0, ("close",))
            deadline = time.monotonic() + 2.0
            for r in self._ranks:
                r.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def status(self) -> list[dict]:
        """pid, device and liveness of each rank."""
        return [{"rank": r.rank, "pid": r.process.pid, "device": r.info.get("device", "starting"),
                 "alive": r.process.is_alive()} for r in list(self._ranks)]

    @property
    def running(self) -> bool:
        return bool(self._ranks)

    # -- calls ------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, ranks: Sequence[int] | None = None, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank (or on `ranks`); one result per rank, in rank order."""
        return self.call(fn, args, kwargs, ranks=ranks)

    def call(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
             ranks: Sequence[int] | None = None, timeout: float | None | object = CLUSTER_TIMEOUT) -> list:
        """`run` with the arguments spelled out, and a timeout for this call only."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, (dict, type(None))):
            raise TypeError(f"args must be a tuple and kwargs a dict, got {type(args).__name__} and "
                            f"{type(kwargs).__name__}")
        results = self._request(("call", fn, tuple(args), kwargs or {}), ranks, self._timeout(timeout))
        return [results[r] for r in sorted(results)]

    def run_cell(self, source: str, *, filename: str | None = None, pushed: dict | None = None,
                 ranks: Sequence[int] | None = None, timeout: float | None | object = CLUSTER_TIMEOUT) -> None:
        """Execute `source` on each rank in the rank's persistent namespace (pre-seeded with torch,
        dist, rank, world_size, device), after adding `pushed` to it; a final expression is printed."""
        timeout = self._timeout(timeout)
        self._cell_count += 1
        filename = filename or f"<ranks cell {self._cell_count}>"
        # The kernel shows this cell's lines in tracebacks and stack dumps.
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        self._request(("cell", source, filename, pushed or {}), ranks, timeout)

    def _timeout(self, timeout: float | None | object) -> float | None:
        return self.timeout if timeout is CLUSTER_TIMEOUT else check_timeout(timeout)

    def _request(self, request: tuple, ranks: Sequence[int] | None, timeout: float | None) -> dict:
        """Send `request` to the selected ranks and collect their replies. Everything that can be refused
        is refused before anything is sent; once it is sent, the ranks are replaced unless every reply
        came back, whatever interrupts the wait."""
        selected = self._select(ranks)
        with self._lock:
            self._request_id += 1
            request_id = self._request_id
            payload = worker.dumps(request, worker.HEADER.pack(request_id))  # fails here if it cannot be shipped
            self.start()
            output = CallOutput(_print)
            self._check_health(output)
            targets = [self._ranks[r] for r in selected]
            self.used = True
            self._in_step = False
            try:
                for r in targets:
                    with contextlib.suppress(OSError):  # a rank that just died: the wait below says how
                        r.conn.send_bytes(payload)
                outcome = self._collect(targets, timeout, request_id, output)
                self._in_step = not outcome.stuck
                return self._conclude(outcome, timeout, output)
            except BaseException:
                if not self._in_step:
                    self._restart_in_background()
                raise

    def _select(self, ranks: Sequence[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        selected = sorted(set(ranks))
        if not selected or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.world_size
                                   for r in selected):
            raise ValueError(f"ranks must be a non-empty list of ranks in 0..{self.world_size - 1}, got {ranks!r}")
        return selected

    def _check_health(self, output: CallOutput) -> None:
        """Before a call: every rank alive, running, and with nothing to say. Otherwise the rank is named in a
        `RankError`, raised after the group restarts."""
        handles = [h for r in self._ranks for h in (r.conn, r.process.sentinel)]
        ready = multiprocessing.connection.wait(handles, 0)
        for r in self._ranks:
            problem = self._idle_problem(r, ready)
            if problem:
                self._drain(output)
                output.finish()
                details = output.recent_errors(r.rank)
                self._restart_in_background()
                raise RankError(r.rank, f"rank {r.rank} {problem}.", [*details, RESTARTED])

    def _idle_problem(self, r: _Rank, ready: list) -> str | None:
        state = _process_state(r.process.pid)
        if r.process.sentinel in ready or state in ("Z", "X"):
            return f"{self._how_it_ended(r)} while idle, between calls"
        if state in ("T", "t"):
            return "is stopped (paused by a signal such as SIGSTOP), so it cannot run anything"
        if r.conn in ready:
            try:
                while r.conn.poll():
                    r.conn.recv_bytes()  # a reply to no request of this call: dropped
            except (EOFError, OSError):
                return "closed its connection to the kernel"
        return None

    def _collect(self, targets: list[_Rank], timeout: float | None, request_id: int,
                 output: CallOutput) -> _Outcome:
        """Wait for one reply per rank, showing their output as it comes; stop waiting at the timeout, or
        GRACE_S after a first failure."""
        outcome = _Outcome()
        running = {r.rank: r for r in targets}
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None
        try:
            while running:
                ends = [t for t in (deadline, grace_end) if t is not None]
                left = min(ends) - time.monotonic() if ends else WAKE_S
                if left <= 0:
                    break
                handles = {h: r for r in running.values() for h in (r.conn, r.process.sentinel)}
                pipes = self._pipes()
                ready = multiprocessing.connection.wait([*handles, *pipes], min(WAKE_S, left))
                for handle in ready:
                    if handle in pipes:
                        self._read(*pipes[handle], output)
                for handle in ready:
                    r = handles.get(handle)
                    if r is None or r.rank not in running:
                        continue
                    reply = self._receive(r, request_id)
                    if reply is None:  # a message from an earlier request: never taken for this one's
                        continue
                    del running[r.rank]
                    kind, value, group_intact = reply
                    if not group_intact:
                        outcome.group_gone.append(r.rank)
                    if kind == "ok":
                        outcome.results[r.rank] = value
                    else:
                        outcome.failures[r.rank] = value
                        grace_end = grace_end or time.monotonic() + GRACE_S
                output.flush_if_due()
        except KeyboardInterrupt:
            outcome.interrupted = True
        outcome.stuck = sorted(running)
        return outcome

    def _receive(self, r: _Rank, request_id: int) -> tuple | None:
        """The rank's message for `request_id`: (kind, value, group intact); ("died", how, False) if its
        process is gone; None if the message belongs to another request."""
        try:
            if r.conn.poll():
                message = r.conn.recv_bytes()
                if worker.HEADER.unpack_from(message)[0] != request_id:
                    return None
                try:
                    return cloudpickle.loads(memoryview(message)[worker.HEADER.size:])
                except Exception as exc:  # noqa: BLE001 - the result exists but cannot be rebuilt here
                    return ("error", _unloadable(r.rank, exc), True)
        except (EOFError, OSError):
            pass
        return ("died", self._how_it_ended(r), False)

    def _how_it_ended(self, r: _Rank) -> str:
        r.process.join(timeout=2.0)
        code = r.process.exitcode
        if code is None:  # alive, but its end of the pipe is closed
            with contextlib.suppress(OSError):
                os.killpg(r.process.pid, signal.SIGKILL)
            return "closed its connection to the kernel"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"died (exit code {code})"

    def _conclude(self, outcome: _Outcome, timeout: float | None, output: CallOutput) -> dict:
        """The results, once the output is shown; or the error, once the ranks that need it are replaced."""
        self._drain(output)
        output.finish()
        if outcome.interrupted:
            stacks, stopped = self._dump_stacks(outcome.stuck)
            self._restart_in_background()
            raise RankInterrupt(f"stopped {_list(outcome.stuck)} and restarted the cluster "
                                "(per-rank variables are reset).",
                                ["Where each rank was (most recent call last):", *format_stacks(stacks, stopped)])
        if outcome.failures or outcome.stuck:
            self._raise(outcome, timeout, output)
        if outcome.group_gone:
            _print(f"[cluster] {_list(outcome.group_gone)} destroyed the process group: the cluster restarts "
                   "its ranks (per-rank variables are reset).")
            self._restart_in_background()
        return outcome.results

    def _raise(self, outcome: _Outcome, timeout: float | None, output: CallOutput) -> None:
        stacks, stopped = self._dump_stacks(outcome.stuck)
        died = {rank: how for rank, how in outcome.failures.items() if isinstance(how, str)}
        tails = {rank: output.recent_errors(rank) for rank in died}
        tampered = any(getattr(f, "type_name", "") == "TamperingError" for f in outcome.failures.values())
        keep_group = not outcome.stuck and not died and not tampered and not outcome.group_gone
        if not keep_group:
            self._restart_in_background()
        restart_note = RESTARTED if not keep_group else ""
        if not outcome.failures:
            ranks = outcome.stuck
            still = f" ({_list(stopped)} {'is' if len(stopped) == 1 else 'are'} stopped)" if stopped else ""
            details = ["Where each rank was waiting (most recent call last):", *format_stacks(stacks, stopped)]
            details += ["A collective that some ranks never call (or call in another order) waits forever; "
                        "so does a loop that never ends.", restart_note]
            raise RankTimeout(ranks, f"{_list(ranks)} did not finish within {timeout:g} s{still}.",
                              details, stacks)
        # The root cause first: a rank that died, else the first rank that raised.
        rank = next(iter(died), next(iter(outcome.failures)))
        failure = outcome.failures[rank]
        if isinstance(failure, str):
            mismatch = collective_mismatch(tails[rank])
            headline = f"rank {rank} {mismatch or failure}."
            details = ([f"It {failure}. The ranks called collectives that do not match: another operation, or "
                        "the same one with another size or dtype."] if mismatch else []) + tails[rank]
        else:
            headline = f"rank {rank} raised {failure.headline}"
            details = format_failure(failure, rank)
        for other, f in outcome.failures.items():
            if other != rank:
                summary = f if isinstance(f, str) else f"raised {f.headline}"
                details.append(_shorten(f"(rank {other} also {summary}", 150) + ")")
        if stacks or stopped:
            details += [f"Still running, now stopped: {_list(outcome.stuck)}. Where each was waiting:",
                        *format_stacks(stacks, stopped)]
        if restart_note:
            details.append(restart_note)
        raise RankError(rank, headline, details, None if isinstance(failure, str) else failure)

    # -- output -----------------------------------------------------------------------------
    def _pipes(self) -> dict[int, tuple[_Rank, str]]:
        """The output pipes still open, by file descriptor."""
        return {getattr(r, kind).fileno(): (r, kind) for r in self._ranks for kind in ("out", "err")
                if kind not in r.closed}

    def _read(self, r: _Rank, kind: str, output: CallOutput, limit: int = READ_BYTES) -> int:
        """Pass what the rank wrote on one stream to `output`; the number of bytes read."""
        try:
            data = os.read(getattr(r, kind).fileno(), limit)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            r.closed.add(kind)
        output.add(r.rank, kind, data)
        return len(data)

    def _drain(self, output: CallOutput) -> None:
        """Read what the ranks have written so far (a rank writes all its output before it replies)."""
        for r, kind in list(self._pipes().values()):
            total = 0
            while total < DRAIN_BYTES and kind not in r.closed and (n := self._read(r, kind, output)):
                total += n

    def _dump_stacks(self, ranks: list[int]) -> tuple[dict[int, list], list[int]]:
        """Where each of `ranks` is now (faulthandler dumps its Python stack on SIGUSR1), and which are stopped."""
        stopped = [rank for rank in ranks if _process_state(self._ranks[rank].process.pid) in ("T", "t")]
        sizes = {}
        for rank in ranks:
            r = self._ranks[rank]
            sizes[rank] = os.path.getsize(r.stack)
            if r.process.is_alive() and rank not in stopped:
                with contextlib.suppress(OSError):
                    os.kill(r.process.pid, signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 1.0
        for rank in ranks:
            path = self._ranks[rank].stack
            while rank not in stopped and os.path.getsize(path) == sizes[rank] and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.02)  # let the dump finish
            with open(path) as f:
                f.seek(sizes[rank])
                text = f.read()
            stacks[rank] = parse_stack_dump(text, self._ranks[rank].info.get("main_thread", -1), worker.__file__)
        return stacks, stopped

    # -- processes --------------------------------------------------------------------------
    def _launch(self) -> None:
        """Fork the ranks from the forkserver; they join the group while the kernel goes on. All start, or none."""
        global _swept
        self._in_step = False
        if not _swept:
            rank_server.remove_abandoned_dirs()
            _swept = True
        ctx = rank_server.context()  # torch is imported once, in the server
        try:
            self._dir, self._dir_lock = rank_server.private_dir()
            store = os.path.join(self._dir, "store")  # a file only this user can open: no port for strangers
            for rank in range(self.world_size):
                stack = os.path.join(self._dir, f"rank{rank}.stack")
                open(stack, "w").close()
                (conn, child_conn), (out, child_out), (err, child_err) = ctx.Pipe(), _pipe(ctx), _pipe(ctx)
                process = ctx.Process(target=worker.main, name=f"cs336-rank{rank}",
                                      args=(rank, self.world_size, self.backend, store, child_conn, child_out,
                                            child_err, stack, PG_TIMEOUT_S, self.check_integrity))
                try:
                    _start_without_main(process)
                except BaseException:
                    for end in (conn, out, err):
                        end.close()
                    raise
                finally:
                    for end in (child_conn, child_out, child_err):
                        end.close()
                self._ranks.append(_Rank(rank, process, conn, out, err, stack))
        except BaseException:
            self._kill()
            raise
        self._in_step = True

    def _await_ready(self) -> None:
        waiting = [r for r in self._ranks if not r.info]
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            handles = {h: r for r in waiting for h in (r.conn, r.process.sentinel)}
            ready = _wait(list(handles), deadline)
            if not ready:
                raise RankError(waiting[0].rank, f"{_list([r.rank for r in waiting])} did not start "
                                f"within {START_TIMEOUT_S:g} s.", [])
            for handle in ready:
                r = handles[handle]
                if r.info:
                    continue
                kind, value, *_ = self._receive(r, 0)
                if kind == "ready":
                    r.info = value
                    waiting.remove(r)
                elif kind == "failed":
                    if value.type_name == "ValueError":
                        raise ValueError(value.message.split(": ", 1)[-1])
                    raise RankError(r.rank, f"rank {r.rank} could not join the group: {value.headline}",
                                    format_failure(value, r.rank))
                else:
                    output = CallOutput(lambda text: None)
                    self._drain(output)
                    output.finish()
                    raise RankError(r.rank, f"rank {r.rank} {value} while starting.", output.recent_errors(r.rank))

    def _kill(self) -> None:
        """Kill every rank with everything it started (its process group), and remove the private folder."""
        self._in_step = False
        for r in self._ranks:
            if r.process.pid is not None:
                with contextlib.suppress(OSError):
                    os.killpg(r.process.pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    r.process.kill()  # one that had no time to lead its own group
        for r in self._ranks:
            if r.process.pid is not None:
                r.process.join(timeout=5.0)
                with contextlib.suppress(ValueError):
                    r.process.close()
            for end in (r.conn, r.out, r.err):
                end.close()
        self._ranks = []
        self.used = False
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._in_step = True

    def _restart_in_background(self) -> None:
        """Replace the ranks now; the next call waits for them to be ready."""
        self._kill()
        self._launch()


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


def _pipe(ctx) -> tuple:
    """A one-way pipe for a rank's output: the kernel's end (non-blocking) and the rank's."""
    reader, writer = ctx.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)
    return reader, writer


def _process_state(pid: int | None) -> str | None:
    """The process's state letter in /proc (R running, S sleeping, T stopped, Z zombie...); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _unloadable(rank: int, exc: Exception) -> Failure:
    """The failure of a rank whose result cannot be rebuilt in the kernel (its pickle fails to load)."""
    failure = Failure.from_exception(exc)
    failure.frames = [f for f in failure.frames if f.filename != __file__]
    return Failure("TypeError", f"TypeError: the result of rank {rank} cannot be loaded in the kernel: "
                   f"{failure.headline}", [], failure, "The above exception was the direct cause of the following "
                   "exception:")


def _available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _open_fds() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _list(ranks: list[int]) -> str:
    """`rank 2` or `ranks 0, 1, 3`."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _wait(handles: list, deadline: float | None) -> list:
    """`multiprocessing.connection.wait` until `deadline` (monotonic time; None: forever), waking every
    WAKE_S so that a pending KeyboardInterrupt is raised however the OS delivered the signal."""
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait(handles, WAKE_S if left is None else min(WAKE_S, left))
        if ready or (left is not None and left <= WAKE_S):
            return ready


def _start_without_main(process) -> None:
    """Start `process` without making it re-import the parent's `__main__` script.

    multiprocessing re-runs the main script in the child (that is why spawn needs an
    `if __name__ == "__main__"` guard); ranks get their functions through cloudpickle instead.
    """
    original = multiprocessing.spawn.get_preparation_data

    def without_main(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = without_main
    try:
        process.start()
    finally:
        multiprocessing.spawn.get_preparation_data = original


@atexit.register
def _shutdown_all() -> None:
    for cluster in list(_live):
        cluster._kill()


if sys.platform == "win32":  # pragma: no cover
    raise ImportError("cs336_parallel.cluster needs a POSIX system (Linux or macOS); on Windows use WSL2.")
