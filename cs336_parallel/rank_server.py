"""The rank server: a forkserver that has imported torch, from which every rank is forked.

Importing torch takes about a second. The server pays it once per kernel, and `%load_ext cs336_parallel`
starts it in the background (while the kernel imports torch itself), so `%cluster start` only forks.
This module imports nothing heavy: warming up must not wait for torch.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from multiprocessing import forkserver


def context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context whose server preloads the worker module (and so torch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["cs336_parallel.worker"])
    return ctx


def warm_up() -> None:
    """Start the server now, without waiting for it; the first cluster then starts in a fraction of a second."""
    context()
    forkserver.ensure_running()
