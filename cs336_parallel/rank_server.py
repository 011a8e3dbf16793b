"""The rank server: a forkserver that has imported torch, from which every rank is forked.

Importing torch takes about a second. The server pays it once per kernel, and `%load_ext cs336_parallel`
starts it in the background (while the kernel imports torch itself), so `%cluster start` only forks.
The course's own kernel (`kernel`) does better: it imports torch, then forks the server from itself
(`start_forked`), so torch is imported once, not twice. This module imports nothing heavy: warming up
must not wait for torch.

The server also cleans up after its kernel. It runs in a session of its own (`in_rank_server`), so it
outlives a kill of the kernel's process group by the moment it takes to notice: then it kills the
ranks' process groups and removes the folders the kernel left (`private_dir`), and multiprocessing's.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import importlib
import multiprocessing
import multiprocessing.context
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing import connection, forkserver, resource_tracker

from . import procfs

DIR_PREFIX = "cs336-cluster-"
OWNER = "owner.lock"  # a cluster folder is in use while a process holds the lock on this file
# What every rank needs, imported once by the server.
PRELOAD = ["torch", "torch.distributed", "cs336_parallel.worker", "cs336_parallel.in_rank_server"]
# An optimizer's first step imports torch._dynamo (1 CPU-s, on every rank), so the server imports it for them, unless
# told that its ranks step none (NO_OPTIMIZER=1: the grader says so of the notebooks whose ranks train nothing).
FOR_OPTIMIZERS = ["torch._dynamo"]
NO_OPTIMIZER = "CS336_RANKS_STEP_NO_OPTIMIZER"


def preload() -> list[str]:
    """What the server imports before it forks a rank."""
    return PRELOAD if os.environ.get(NO_OPTIMIZER) == "1" else PRELOAD[:2] + FOR_OPTIMIZERS + PRELOAD[2:]


def context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose server preloads the worker module (and so torch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload())
    return ctx


def warm_up() -> None:
    """Start the server now, without waiting for it; the first cluster then starts in a fraction of a second."""
    context()
    forkserver.ensure_running()


# The state of multiprocessing's forkserver that `start_forked` fills in as its `ensure_running` would, and the
# arguments of the server's main loop, as in Python 3.11 (3.14 adds an authentication key): where they differ,
# `start_forked` declines.
FORKSERVER_STATE = ["_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock",
                    "_preload_modules"]
FORKSERVER_MAIN = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def start_forked() -> bool:
    """Start the server as a fork of this process (the course's kernel, before ipykernel starts its threads),
    once this process has imported torch's modules of `preload()`: the kernel needs them too (an optimizer's
    step imports torch._dynamo), so they are imported once, not twice, and the server imports only the course's
    own. That is one to two CPU-seconds less than a server that starts Python anew, and the grader starts a
    kernel for each notebook it grades. The server is then multiprocessing's forkserver as `ensure_running`
    would have started it, and exits the same way (SystemExit, once no one holds its "alive" pipe). False, with
    nothing started, where multiprocessing is not the one this mirrors: `warm_up()` then starts it as usual."""
    server = forkserver._forkserver
    code = forkserver.main.__code__
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if sorted(vars(server)) != FORKSERVER_STATE or list(arguments) != FORKSERVER_MAIN:
        return False
    for module in preload():
        if module.split(".")[0] == "torch":
            importlib.import_module(module)
    context()  # the preload list, for a server multiprocessing starts again (if this one dies)
    with server._lock:
        resource_tracker.ensure_running()
        if server._forkserver_pid is not None:
            return True
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the server: it never returns to the code that forked it
                try:
                    os.close(alive_w)
                    forkserver.main(listener.fileno(), alive_r, preload())  # SystemExit once the kernel has gone
                finally:
                    sys.exit()
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _started() -> None:
    """Runs in a process the server forked: that it started shows the server has imported what it preloads."""


def await_ready() -> None:
    """Start the server if it is not running, and wait until its imports are done (one empty process forked)."""
    process = context().Process(target=_started, daemon=True)
    process.start()
    process.join()


def await_exit(timeout: float = 10.0) -> None:
    """Wait until the server this process started has exited (a zombie, not reaped: multiprocessing reaps it and
    starts a new one at the next fork)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    deadline = time.monotonic() + timeout
    while pid and procfs.state(pid) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.01)


def private_dir() -> tuple[str, int]:
    """A new folder only this user can open, and the descriptor of its owner lock, held while it is in use.

    The lock is taken before the lock file gets its name, so no one ever sees the folder unlocked."""
    path = tempfile.mkdtemp(prefix=DIR_PREFIX)
    fd = os.open(os.path.join(path, OWNER + ".new"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(os.path.join(path, OWNER + ".new"), os.path.join(path, OWNER))
    return path, fd


def remove_abandoned_dirs() -> None:
    """Remove the cluster folders whose owner is gone (killed before it could remove them)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), DIR_PREFIX + "*")):
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDWR)
        except OSError:  # not ours, or made by an older version: left alone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # locked: in use
            pass
        finally:
            os.close(fd)


def clean_up_after_kernel(kernel_pid: int) -> None:
    """Run by the server as it exits: kill its children's process groups (each rank and what it started),
    and once the kernel is gone, remove its cluster folders and multiprocessing's folder for this server."""
    for pid in procfs.children(os.getpid()):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while os.getppid() == kernel_pid and time.monotonic() < deadline:  # its descriptors close as it dies
        time.sleep(0.01)
    if os.getppid() == kernel_pid:  # the server stopped for another reason: the kernel still uses its folders
        return
    remove_abandoned_dirs()
    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    if isinstance(address, str) and os.path.basename(os.path.dirname(address)).startswith("pymp-"):
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)

