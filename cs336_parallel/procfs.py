"""What the system says about processes and memory: Linux's /proc, with what can be known elsewhere.

Every function answers "unknown" (None, nothing) rather than fail where there is no /proc (macOS).
"""

from __future__ import annotations

import contextlib
import os


def stat_fields(pid: int | None) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (state, parent pid, ...); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int | None) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped, Z zombie...); None if unknown."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux; elsewhere none are found)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields and len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def available_memory() -> int | None:
    """Bytes of memory available to new processes (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_fds() -> int:
    """How many file descriptors this process has open (0 if unknown)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(folder))
    return 0


PRIVATE = "CS336_PRIVATE_RANKS"  # set by the grader's rank host: each rank keeps its memory to itself


def keep_private() -> None:
    """No other process of this user may read this one's memory or take its files (Linux: not "dumpable"); only
    a process allowed to trace any process here (root, or the owner of this sandbox's user namespace) still may."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
