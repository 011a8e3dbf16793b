"""Imported only inside the rank server (it is on the server's preload list), never by the kernel.

The server leaves the kernel's process group for a session of its own: a kill of the kernel's group
(Jupyter's way to stop a kernel) then ends the kernel, and the server, left behind, cleans up after it
as it exits (`rank_server.clean_up_after_kernel`) before its ranks die with it.
"""

import atexit
import contextlib
import os

from .rank_server import clean_up_after_kernel

with contextlib.suppress(OSError):
    os.setsid()
atexit.register(clean_up_after_kernel, os.getppid())
