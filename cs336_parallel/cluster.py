"""A persistent group of N ranks started from the kernel: functions defined in a notebook run on all of them.

Ranks are forked from a forkserver that has already imported torch (`rank_server`), so they start
in a tenth of a second once it runs, and inherit none of the kernel's state (no CUDA context, no ZMQ
threads). Every call collects one result per rank; a rank that raises, dies or hangs turns into a
`RankError` or `RankTimeout` in the kernel, and the group restarts itself before the next call.
"""

from __future__ import annotations

import atexit
import linecache
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import rank_server, worker
from .errors import RankError, RankInterrupt, RankTimeout, format_failure, format_frames, parse_stack_dump
from .worker import Failure

GRACE_S = 1.0  # after one rank fails, how long the others get to finish before they are stopped
START_TIMEOUT_S = 120.0
WAKE_S = 0.1  # waits wake this often: a Ctrl-C the OS hands to another thread only runs when the main one does
PG_TIMEOUT_S = 1800.0  # gloo/NCCL's own limit; the cluster's timeout normally fires long before
BACKENDS = ("auto", "gloo", "nccl")
CLUSTER_TIMEOUT = object()  # "use the cluster's own timeout" (None means no limit)

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


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


@dataclass
class _Rank:
    rank: int
    process: Any  # multiprocessing.Process
    conn: multiprocessing.connection.Connection
    files: dict[str, str]
    info: dict = field(default_factory=dict)  # filled by the rank's "ready" message


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, Failure | str] = field(default_factory=dict)  # a str says how the rank died
    stuck: list[int] = field(default_factory=list)  # ranks still running when the wait ended
    interrupted: bool = False


class Cluster:
    """`world_size` ranks that run functions shipped from this process (with cloudpickle).

    >>> with Cluster(4) as cluster:
    ...     cluster.run(lambda: dist.get_rank())
    [0, 1, 2, 3]
    """

    def __init__(self, world_size: int, backend: str = "auto", timeout: float | None = 60.0, *,
                 check_integrity: bool = False):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self.timeout = timeout
        self.check_integrity = check_integrity  # ranks refuse to go on after code replaced what tests rely on
        self.used = False  # has run something since its ranks started
        self._ranks: list[_Rank] = []
        self._store: dist.TCPStore | None = None
        self._dir: str | None = None
        self._cell_count = 0
        _live.add(self)

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start the ranks (if not running) and wait until every one has joined the group."""
        if not self._ranks:
            self._launch()
        try:
            self._await_ready()
        except BaseException:
            self._kill()
            raise
        return self

    def restart(self) -> Cluster:
        self._kill()
        return self.start()

    def restart_soon(self) -> None:
        """Replace the ranks now without waiting for them: they join the group while the caller goes on."""
        self._restart_in_background()

    def shutdown(self) -> None:
        """Stop every rank; nothing is left running."""
        for r in self._ranks:
            try:
                r.conn.send_bytes(cloudpickle.dumps(("close",)))
            except OSError:
                pass
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
                 "alive": r.process.is_alive()} for r in self._ranks]

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
        results = self._request(("call", fn, args, kwargs or {}), ranks, self._timeout(timeout))
        return [results[r] for r in sorted(results)]

    def run_cell(self, source: str, *, filename: str | None = None, pushed: dict | None = None,
                 ranks: Sequence[int] | None = None, timeout: float | None | object = CLUSTER_TIMEOUT) -> None:
        """Execute `source` on each rank in the rank's persistent namespace (pre-seeded with torch,
        dist, rank, world_size, device), after adding `pushed` to it; a final expression is printed."""
        self._cell_count += 1
        filename = filename or f"<ranks cell {self._cell_count}>"
        # The kernel shows this cell's lines in tracebacks and stack dumps.
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        self._request(("cell", source, filename, pushed or {}), ranks, self._timeout(timeout))

    def _timeout(self, timeout: float | None | object) -> float | None:
        return self.timeout if timeout is CLUSTER_TIMEOUT else timeout  # type: ignore[return-value]

    def _request(self, request: tuple, ranks: Sequence[int] | None, timeout: float | None) -> dict:
        selected = self._select(ranks)
        payload = worker.dumps(request)  # fails here, in the kernel, if something cannot be shipped
        self.start()
        self.used = True
        targets = [self._ranks[r] for r in selected]
        for r in targets:
            open(r.files["out"], "w").close()
            open(r.files["err"], "w").close()
        for r in targets:
            r.conn.send_bytes(payload)
        outcome = self._collect(targets, timeout)
        self._print_output(targets)
        if outcome.interrupted:
            stacks = self._dump_stacks(outcome.stuck)
            self._restart_in_background()
            raise RankInterrupt(f"stopped {_list(outcome.stuck)} and restarted the cluster "
                                "(per-rank variables are reset).",
                                ["Where each rank was (most recent call last):", *_format_stacks(stacks)])
        if outcome.failures or outcome.stuck:
            self._raise(outcome, timeout)
        return outcome.results

    def _select(self, ranks: Sequence[int] | None) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        selected = sorted(set(ranks))
        if not selected or not all(isinstance(r, int) and 0 <= r < self.world_size for r in selected):
            raise ValueError(f"ranks must be a non-empty list of ranks in 0..{self.world_size - 1}, got {ranks!r}")
        return selected

    def _collect(self, targets: list[_Rank], timeout: float | None) -> _Outcome:
        """Wait for one reply per rank; stop waiting at the timeout, or GRACE_S after a first failure."""
        outcome = _Outcome()
        running = {r.rank: r for r in targets}
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None
        try:
            while running:
                ends = [t for t in (deadline, grace_end) if t is not None]
                handles = {h: r for r in running.values() for h in (r.conn, r.process.sentinel)}
                ready = _wait(list(handles), min(ends) if ends else None)
                if not ready:
                    break
                for handle in ready:
                    r = handles[handle]
                    if r.rank not in running:
                        continue
                    del running[r.rank]
                    kind, value = self._receive(r)
                    if kind == "ok":
                        outcome.results[r.rank] = value
                    else:
                        outcome.failures[r.rank] = value
                        grace_end = grace_end or time.monotonic() + GRACE_S
        except KeyboardInterrupt:
            outcome.interrupted = True
        outcome.stuck = sorted(running)
        return outcome

    def _receive(self, r: _Rank) -> tuple:
        """The rank's reply, or ("died", how) if its process is gone."""
        try:
            if r.conn.poll():
                return cloudpickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            pass
        r.process.join(timeout=2.0)
        code = r.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"died (exit code {code})"
        return ("died", how)

    def _raise(self, outcome: _Outcome, timeout: float | None) -> None:
        stacks = self._dump_stacks(outcome.stuck)
        died = {rank: how for rank, how in outcome.failures.items() if isinstance(how, str)}
        tampered = any(getattr(f, "type_name", "") == "TamperingError" for f in outcome.failures.values())
        keep_group = not outcome.stuck and not died and not tampered  # every rank came back, unharmed
        if not keep_group:
            self._restart_in_background()
        restart_note = ("The cluster restarts before the next call (per-rank variables are reset)."
                        if not keep_group else "")
        if not outcome.failures:
            ranks = outcome.stuck
            details = ["Where each rank was waiting (most recent call last):", *_format_stacks(stacks)]
            details += ["A collective that some ranks never call (or call in another order) waits forever; "
                        "so does a loop that never ends.", restart_note]
            raise RankTimeout(ranks, f"{_list(ranks)} did not finish within {timeout:g} s.",
                              details, stacks)
        # The root cause first: a rank that died, else the first rank that raised.
        rank = next(iter(died), next(iter(outcome.failures)))
        failure = outcome.failures[rank]
        if isinstance(failure, str):
            headline = f"rank {rank} {failure}."
            details = self._tail(rank, "err")
        else:
            headline = f"rank {rank} raised {failure.headline}"
            details = format_failure(failure, rank)
        for other, f in outcome.failures.items():
            if other != rank:
                summary = f if isinstance(f, str) else f"raised {f.headline}"
                details.append(_shorten(f"(rank {other} also {summary}", 150) + ")")
        if stacks:
            details += [f"Still running, now stopped: {_list(outcome.stuck)}. Where each was waiting:",
                        *_format_stacks(stacks)]
        if restart_note:
            details.append(restart_note)
        raise RankError(rank, headline, details, None if isinstance(failure, str) else failure)

    # -- processes --------------------------------------------------------------------------
    def _launch(self) -> None:
        """Fork the ranks from the forkserver; they join the group while the kernel goes on."""
        ctx = rank_server.context()  # torch is imported once, in the server
        # The store lives in this process and binds port 0: no port is ever chosen twice.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._dir = tempfile.mkdtemp(prefix="cs336-cluster-")
        for rank in range(self.world_size):
            files = {kind: os.path.join(self._dir, f"rank{rank}.{kind}") for kind in ("out", "err", "stack")}
            for path in files.values():
                open(path, "w").close()
            parent_conn, child_conn = ctx.Pipe()
            process = ctx.Process(target=worker.main, name=f"cs336-rank{rank}",
                                  args=(rank, self.world_size, self.backend, self._store.port, child_conn,
                                        files, PG_TIMEOUT_S, self.check_integrity))
            _start_without_main(process)
            child_conn.close()
            self._ranks.append(_Rank(rank, process, parent_conn, files))

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
                kind, value = self._receive(r)
                if kind == "ready":
                    r.info = value
                    waiting.remove(r)
                elif kind == "failed":
                    if value.type_name == "ValueError":
                        raise ValueError(value.message.split(": ", 1)[-1])
                    raise RankError(r.rank, f"rank {r.rank} could not join the group: {value.headline}",
                                    format_failure(value, r.rank))
                else:
                    raise RankError(r.rank, f"rank {r.rank} {value} while starting.", self._tail(r.rank, "err"))

    def _kill(self) -> None:
        for r in self._ranks:
            if r.process.is_alive():
                r.process.kill()
        for r in self._ranks:
            r.process.join(timeout=5.0)
            r.conn.close()
        self._ranks = []
        self.used = False
        self._store = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _restart_in_background(self) -> None:
        """Replace the ranks now; the next call waits for them to be ready."""
        self._kill()
        self._launch()

    # -- output -----------------------------------------------------------------------------
    def _print_output(self, targets: list[_Rank]) -> None:
        """Each rank's stdout, then its stderr, tagged with the rank, in rank order."""
        lines = []
        for r in targets:
            for kind, tag in (("out", ""), ("err", " stderr")):
                lines += [f"[rank {r.rank}{tag}] {line}" for line in _read_lines(r.files[kind])]
        if lines:
            print("\n".join(lines), flush=True)

    def _tail(self, rank: int, kind: str, n: int = 20) -> list[str]:
        return [f"[rank {rank} stderr] {line}" for line in _read_lines(self._ranks[rank].files[kind])[-n:]]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, list]:
        """Where each of `ranks` is now: faulthandler dumps its Python stack on SIGUSR1."""
        sizes = {}
        for rank in ranks:
            r = self._ranks[rank]
            sizes[rank] = os.path.getsize(r.files["stack"])
            if r.process.is_alive():
                os.kill(r.process.pid, signal.SIGUSR1)
        stacks = {}
        deadline = time.monotonic() + 1.0
        for rank in ranks:
            path = self._ranks[rank].files["stack"]
            while os.path.getsize(path) == sizes[rank] and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.02)  # let the dump finish
            with open(path) as f:
                f.seek(sizes[rank])
                text = f.read()
            stacks[rank] = parse_stack_dump(text, self._ranks[rank].info.get("main_thread", -1), worker.__file__)
        return stacks


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


def _read_lines(path: str) -> list[str]:
    """A file's lines as a terminal would show them (a carriage return overwrites the line)."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [line.rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")] if text.strip() else []


def _format_stacks(stacks: dict[int, list]) -> list[str]:
    lines = []
    for rank, frames in stacks.items():
        lines.append(f"rank {rank}:")
        lines += format_frames(frames) or ["  (no Python stack: the rank was not running Python code)"]
    return lines


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
