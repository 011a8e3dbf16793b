"""The rank server: a forkserver that has imported torch, from which every rank is forked.

Importing torch takes about a second. The server pays it once per kernel, and `%load_ext cs336_parallel`
starts it in the background (while the kernel imports torch itself), so `%cluster start` only forks.
This module imports nothing heavy: warming up must not wait for torch.

The server also cleans up after its kernel. It runs in a session of its own (`in_rank_server`), so it
outlives a kill of the kernel's process group by the moment it takes to notice: then it kills the
ranks' process groups and removes the folders the kernel left (`private_dir`), and multiprocessing's.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import multiprocessing
import multiprocessing.context
import os
import shutil
import signal
import tempfile
import time
from multiprocessing import forkserver

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

