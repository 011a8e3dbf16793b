"""Imported only inside the rank server (the last module on its preload list), never by the kernel.

The server leaves the kernel's process group for a session of its own: a kill of the kernel's group
(Jupyter's way to stop a kernel) then ends the kernel, and the server, left behind, cleans up after it
as it exits (`rank_server.clean_up_after_kernel`) before its ranks die with it.

It also freezes what the server has imported (`gc.freeze`, as Python's documentation advises before forking): a
rank's garbage collections and `gc.get_objects()` (the tests' searches for tensors and modules) then skip the
server's 280,000 objects, which stay shared, rather than walk them in every rank (0.14 CPU-s each time).
"""

import atexit
import contextlib
import gc
import os

from .rank_server import clean_up_after_kernel

with contextlib.suppress(OSError):
    os.setsid()
atexit.register(clean_up_after_kernel, os.getppid())
gc.freeze()
