"""The processes behind a `Cluster`: one per rank, forked from the rank server, and what the kernel holds
of each (its request pipe, its output pipes, the file its stack is dumped to).

`RankProcesses` starts a group (all its ranks or none), waits until every rank has joined the process
group, checks their health between calls, dumps their stacks, and kills them with everything they
started. The exchange of requests and replies is the cluster's: a `RankProcess` only receives the
reply it is asked for. Nothing is left running when the kernel exits: every group is killed then.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import resource
import shutil
import signal
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from . import procfs, protocol, rank_server, worker
from .errors import RankError, format_failure, parse_stack_dump
from .output import CallOutput, OutputPipes, open_streams
from .protocol import Failure
from .text import ranks_phrase

START_TIMEOUT_S = 120.0
WAKE_S = 0.1  # waits wake this often: a Ctrl-C the OS hands to another thread only runs when the main one does
PG_TIMEOUT_S = 1800.0  # gloo/NCCL's own limit; the cluster's timeout normally fires long before
CLOSE_S = 2.0  # how long ranks asked to close get before they are killed
STACK_WAIT_S = 1.0  # how long a rank gets to dump its stack
RANK_MEMORY_BYTES = 100 * 2**20  # what a rank needs of its own, at least (torch's pages are shared with the server)
KERNEL_FDS_PER_RANK = 6  # its request pipe, two output pipes, its exit sentinel, and room
RANK_FDS = 32  # what a rank opens for itself (about 15), with room; plus two per peer
STOPPED = ("T", "t")  # process states of a stopped process (SIGSTOP, a debugger)

_live: weakref.WeakSet[RankProcesses] = weakref.WeakSet()
_swept = False  # this process has removed the folders that killed kernels left


def check_world_size(world_size: int) -> None:
    """Refuse a world size that is not a positive integer, or that this machine cannot hold, saying why."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    too_many = f"world_size={world_size} is more than this machine can hold: {world_size} ranks need"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        free = soft - procfs.open_fds()
        if world_size * KERNEL_FDS_PER_RANK > free:
            raise ValueError(f"{too_many} about {world_size * KERNEL_FDS_PER_RANK} file descriptors in this "
                             f"process, and {free} of its {soft} are free (`ulimit -n` raises the limit).")
        if RANK_FDS + 2 * world_size > soft:
            raise ValueError(f"{too_many} about {RANK_FDS + 2 * world_size} file descriptors each (two per peer), "
                             f"and a process may open {soft} (`ulimit -n` raises the limit).")
    memory = procfs.available_memory()
    if memory is not None and world_size * RANK_MEMORY_BYTES > memory:
        raise ValueError(f"{too_many} about {_gib(world_size * RANK_MEMORY_BYTES)} of memory "
                         f"({RANK_MEMORY_BYTES // 2**20} MiB each), and {_gib(memory)} is available.")


@dataclass
class RankProcess:
    """One rank's process, as the kernel holds it."""

    rank: int
    process: Any  # multiprocessing.Process
    conn: multiprocessing.connection.Connection  # requests and replies
    pipes: OutputPipes  # its stdout and stderr
    stack: str  # the file its stack is dumped to
    info: dict = field(default_factory=dict)  # filled by the rank's "ready" message

    def handles(self) -> tuple:
        """What becomes ready when the rank replies or ends: its pipe and its exit sentinel."""
        return self.conn, self.process.sentinel

    def receive(self, request_id: int) -> tuple | None:
        """The rank's message for `request_id`: (kind, value, group intact); ("died", how, False) if its
        process is gone; None if the message belongs to another request."""
        try:
            if self.conn.poll():
                data = self.conn.recv_bytes()
                if protocol.request_id(data) != request_id:
                    return None
                try:
                    return protocol.loads(data)
                except Exception as exc:  # noqa: BLE001 - the result exists but cannot be rebuilt here
                    return ("error", _unloadable(self.rank, exc), True)
        except (EOFError, OSError):
            pass
        return ("died", self.how_it_ended(), False)

    def how_it_ended(self) -> str:
        """How the rank's process ended (`was killed by signal SIGKILL`), once it has."""
        self.process.join(timeout=2.0)
        code = self.process.exitcode
        if code is None:  # alive, but its end of the pipe is closed
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return "closed its connection to the kernel"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"died (exit code {code})"

    def idle_problem(self, state: str | None, ready: list) -> str | None:
        """What is wrong with the rank between calls (`state`: its process's state letter, then `ready`: the handles
        with something to say), if anything. A reply to no request of the coming call is dropped."""
        if self.process.sentinel in ready or state in ("Z", "X"):
            return f"{self.how_it_ended()} while idle, between calls"
        if state in STOPPED:
            return "is stopped (paused by a signal such as SIGSTOP), so it cannot run anything"
        if self.conn in ready:
            try:
                while self.conn.poll():
                    self.conn.recv_bytes()
            except (EOFError, OSError):  # a killed process closes its pipes a moment before it is seen to end
                return f"{self.how_it_ended()} while idle, between calls"
        return None


class RankProcesses:
    """The processes of a group of `world_size` ranks: all started or none (see the module docstring)."""

    def __init__(self, world_size: int, backend: str):
        self.world_size, self.backend = world_size, backend
        self.dir: str | None = None  # private: the store, the stack dumps
        self.has_run = False  # has been sent a request since it was launched
        # The ranks' state is not known: a request is outstanding, or launching or killing them was cut short.
        self.needs_replacing = False
        self._ranks: list[RankProcess] = []
        self._dir_lock: int | None = None
        _live.add(self)

    def __getitem__(self, rank: int) -> RankProcess:
        return self._ranks[rank]

    def __len__(self) -> int:
        return len(self._ranks)

    def status(self) -> list[dict]:
        """pid, device and liveness of each rank."""
        return [{"rank": r.rank, "pid": r.process.pid, "device": r.info.get("device", "starting"),
                 "alive": r.process.is_alive()} for r in list(self._ranks)]

    def launch(self) -> None:
        """Fork the ranks from the rank server; they join the group while the kernel goes on. All start, or none."""
        global _swept
        self.needs_replacing = True
        if not _swept:
            rank_server.remove_abandoned_dirs()
            _swept = True
        ctx = rank_server.context()  # torch is imported once, in the server
        try:
            self._fork_all(ctx)
        except (ConnectionRefusedError, FileNotFoundError, EOFError):
            # The server is on its way out (an earlier start failed half way through handing it a rank), and refused
            # the connection or closed it unanswered: once it has exited, multiprocessing starts a new one.
            self.kill()
            rank_server.await_exit()
            self._fork_all(ctx)
        self.needs_replacing = False

    def _fork_all(self, ctx) -> None:
        """Fork every rank, or none: a failure kills those already forked."""
        try:
            self.dir, self._dir_lock = rank_server.private_dir()
            store = os.path.join(self.dir, "store")  # a file only this user can open: no port for strangers
            for rank in range(self.world_size):
                self._ranks.append(self._fork(ctx, rank, store))
        except BaseException:
            self.kill()
            raise

    def _fork(self, ctx, rank: int, store: str) -> RankProcess:
        stack = os.path.join(self.dir, f"rank{rank}.stack")
        open(stack, "w").close()
        (conn, child_conn), (out, child_out), (err, child_err) = ctx.Pipe(), _pipe(ctx), _pipe(ctx)
        process = ctx.Process(target=worker.main, name=f"cs336-rank{rank}",
                              args=(rank, self.world_size, self.backend, store, child_conn, child_out, child_err,
                                    stack, PG_TIMEOUT_S))
        try:
            _start_without_main(process)
        except BaseException:
            for end in (conn, out, err):
                end.close()
            raise
        finally:
            for end in (child_conn, child_out, child_err):
                end.close()
        return RankProcess(rank, process, conn, OutputPipes(rank, out, err), stack)

    def await_ready(self) -> None:
        """Wait until every rank has joined the process group; raise what kept one from it."""
        waiting = [r for r in self._ranks if not r.info]
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            handles = {h: r for r in waiting for h in r.handles()}
            ready = _wait(list(handles), deadline)
            if not ready:
                raise RankError(waiting[0].rank, f"{ranks_phrase([r.rank for r in waiting])} did not start "
                                f"within {START_TIMEOUT_S:g} s.", [])
            for handle in ready:
                r = handles[handle]
                if not r.info:
                    self._take_ready_message(r)
                    waiting.remove(r)

    def _take_ready_message(self, r: RankProcess) -> None:
        """The rank's first message: it has joined the group (`r.info` is filled), or what kept it from it is raised."""
        kind, value, *_ = r.receive(0)
        if kind == "ready":
            r.info = value
        elif kind == "failed":
            if value.type_name == "ValueError":
                raise ValueError(value.message.split(": ", 1)[-1])
            raise RankError(r.rank, f"rank {r.rank} could not join the group: {value.headline}",
                            format_failure(value, r.rank))
        else:
            output = CallOutput(lambda text: None)
            self.drain(output)
            output.finish()
            raise RankError(r.rank, f"rank {r.rank} {value} while starting.", output.recent_errors(r.rank))

    def find_unhealthy(self) -> tuple[int, str] | None:
        """Between calls: the first rank that is not alive, running and silent, and what is wrong with it. The states
        are read first: a killed rank is a zombie (Z) until it is reaped, and its pipes close before it is reaped,
        so one of the two looks sees it end (the other order can miss a rank reaped between them)."""
        states = [procfs.state(r.process.pid) for r in self._ranks]
        ready = multiprocessing.connection.wait([h for r in self._ranks for h in r.handles()], 0)
        for r, state in zip(self._ranks, states, strict=True):
            problem = r.idle_problem(state, ready)
            if problem:
                return r.rank, problem
        return None

    def open_streams(self) -> dict[int, tuple[OutputPipes, str]]:
        """The ranks' output streams still open, by file descriptor."""
        return open_streams(r.pipes for r in self._ranks)

    def drain(self, output: CallOutput) -> None:
        """Read what the ranks have written so far (a rank writes all its output before it replies)."""
        for r in self._ranks:
            r.pipes.drain(output)

    def dump_stacks(self, ranks: list[int]) -> tuple[dict[int, list], list[int]]:
        """Where each of `ranks` is now (faulthandler dumps its Python stack on SIGUSR1), and which are stopped."""
        stopped = [rank for rank in ranks if procfs.state(self._ranks[rank].process.pid) in STOPPED]
        sizes = {}
        for rank in ranks:
            r = self._ranks[rank]
            sizes[rank] = os.path.getsize(r.stack)
            if r.process.is_alive() and rank not in stopped:
                with contextlib.suppress(OSError):
                    os.kill(r.process.pid, signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + STACK_WAIT_S
        for rank in ranks:
            r = self._ranks[rank]
            while rank not in stopped and os.path.getsize(r.stack) == sizes[rank] and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.02)  # let the dump finish
            with open(r.stack) as f:
                f.seek(sizes[rank])
                text = f.read()
            stacks[rank] = parse_stack_dump(text, r.info.get("main_thread", -1), worker.__file__)
        return stacks, stopped

    def kill(self) -> None:
        """Kill every rank with everything it started (its process group), and remove the private folder."""
        self.needs_replacing = True
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
            r.conn.close()
            r.pipes.close()
        self._ranks = []
        self.has_run = False
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.needs_replacing = False

    def replace(self) -> None:
        """Kill the ranks and fork new ones, without waiting for them to join the group (`await_ready` does)."""
        self.kill()
        self.launch()

    def close(self) -> None:
        """Ask every rank to stop, give them CLOSE_S to do so, then kill what is left."""
        for r in self._ranks:
            with contextlib.suppress(OSError):
                protocol.send(r.conn, 0, ("close",))
        deadline = time.monotonic() + CLOSE_S
        for r in self._ranks:
            r.process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


def _pipe(ctx) -> tuple:
    """A one-way pipe for a rank's output: the kernel's end (non-blocking) and the rank's."""
    reader, writer = ctx.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)
    return reader, writer


def _unloadable(rank: int, exc: Exception) -> Failure:
    """The failure of a rank whose result cannot be rebuilt in the kernel (its pickle fails to load)."""
    failure = Failure.from_exception(exc, hide=(__file__,))
    return Failure("TypeError", f"TypeError: the result of rank {rank} cannot be loaded in the kernel: "
                   f"{failure.headline}", [], failure, "The above exception was the direct cause of the following "
                   "exception:")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


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
def _kill_all() -> None:
    for processes in list(_live):
        processes.kill()
