"""The rank side of a `Cluster`: one process per rank, started by the kernel through a forkserver.

A worker joins the process group, then serves requests from the kernel over a pipe until told to
stop: run a shipped function, or execute a `%%ranks` cell in its persistent namespace (the messages
are `protocol`'s). Every request carries an id that its reply echoes, so the kernel never takes one
call's reply for another's. Its
stdout and stderr are pipes the kernel reads while the call runs; SIGUSR1 dumps its Python stack for
the kernel's timeout report. It leads a process group of its own, so what it starts dies with it; it
dies with its parent (parent-death signal) and when the kernel's end of the pipe closes.

The group meets through a file store in the cluster's private folder: nothing listens on the network
but gloo's own connections between ranks, on the loopback interface.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import io
import linecache
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
import warnings
from datetime import timedelta

from . import procfs, protocol
from .protocol import Failure

if os.environ.get(procfs.PRIVATE):  # imported by the server the grader's ranks are forked from: keep it private too
    procfs.keep_private()

# Warnings that say nothing to a learner about their own code.
_HARMLESS_WARNINGS = [
    r".*Unable to resolve hostname.*",
    r".*No device id is provided via `init_process_group` or `barrier`.*",
]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the forkserver) exits.

    The forkserver exits when every holder of its "alive" pipe has closed it; multiprocessing gives
    each child a copy, so a rank busy in user code would keep the server, and so itself, alive after
    the kernel died. Closing the copy here ties the server's life, and the ranks', to the kernel's.
    """
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _capture_output(out, err) -> None:
    """Send fds 1 and 2 (Python and C++ alike) to the pipes the kernel reads."""
    for fd, pipe in ((1, out), (2, err)):
        os.dup2(pipe.fileno(), fd)
        pipe.close()
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True, write_through=True)
    warnings.showwarning = _show_warning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings in one line each: `UserWarning: text (file.py:12)`."""
    print(f"{category.__name__}: {message} ({os.path.basename(filename)}:{lineno})", file=sys.stderr)


def loopback_interface() -> str:
    """The name of the loopback network interface (`lo` on Linux, `lo0` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0] if names else "lo")


def _failure(exc: BaseException) -> Failure:
    """`exc` as data for the kernel, without this module's frames (the launcher says nothing to the learner)."""
    return Failure.from_exception(exc, hide=(__file__,))


def run_cell(namespace: dict, source: str, filename: str) -> None:
    """Execute `source` like an IPython cell: a final expression's value is printed (if not None)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None:
            print(repr(value))


def main(rank: int, world_size: int, backend: str, store_path: str, conn, out, err, stack_path: str,
         pg_timeout_s: float) -> None:
    """Entry point of a rank (the target of the kernel's `multiprocessing.Process`)."""
    # Imported here: the server the ranks fork from has imported them (`rank_server.preload`), and the processes
    # that start ranks import this module for this function only (the grader's rank host runs without torch).
    import torch
    import torch.distributed as dist

    os.setsid()  # a process group of its own: the kernel kills it and everything it started at once
    _die_with_parent()
    if os.environ.get(procfs.PRIVATE):
        procfs.keep_private()  # before any code of the learner's runs here
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel decides what an interrupt stops
    _capture_output(out, err)
    stack_file = open(stack_path, "a")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    for pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel, which raises it
        protocol.send(conn, 0, ("failed", _failure(exc)))
        return
    world = dist.group.WORLD
    pid = os.getpid()
    protocol.send(conn, 0, ("ready", {"pid": pid, "backend": backend, "device": str(device),
                             "main_thread": threading.get_ident()}))

    namespace = {"torch": torch, "dist": dist, "rank": rank, "world_size": world_size,
                 "device": device, "__name__": "__main__"}
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the kernel went away
            break
        request_id = protocol.request_id(message)
        try:
            request, message = protocol.loads(message), None
            if request[0] == "close":
                break
            if request[0] == "call":
                _, fn, args, kwargs = request
                reply = ("ok", fn(*args, **kwargs))
            else:  # ("cell", source, filename, names pushed from the kernel)
                _, source, filename, pushed = request
                namespace.update(pushed)
                reply = ("ok", run_cell(namespace, source, filename))
        except BaseException as exc:  # noqa: BLE001
            reply = ("error", _failure(exc))
        if os.getpid() != pid:  # a process the code forked came back here: only the rank itself replies
            os._exit(0)
        group_intact = dist.is_initialized() and dist.group.WORLD is world
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            payload = protocol.encode(request_id, (*reply, group_intact))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
            payload = protocol.encode(request_id, ("error", _failure(
                TypeError(f"the result of rank {rank} cannot be sent to the kernel: {exc}")), group_intact))
        request = reply = None  # free what the call used before waiting for the next
        conn.send_bytes(payload)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it can hang on gloo threads
