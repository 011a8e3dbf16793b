"""A memory limit for everything one notebook starts (its kernel and ranks), with the kernel's cgroups.

A process limit (`ulimit -v`) would count each rank on its own, and torch reserves far more address space
than it uses; a memory cgroup counts the resident memory of the whole tree and, past the limit, the kernel's
OOM killer stops a process of that tree only. The grader makes a child of its own cgroup for each notebook:
cgroup v2 (`memory.max`) or v1 (`memory.limit_in_bytes`). That needs a cgroup the grader may write: root,
a delegated subtree (`systemd-run --user --scope -p Delegate=yes`), or Slurm, which limits each job itself.
Where there is none, `MemoryLimit.create` returns None and says why in `unavailable()`.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from functools import cache
from pathlib import Path


def _own_cgroups() -> list[Path]:
    """Where this process's memory cgroup is, v2 first: candidates in which to make a child."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2 (unified)
            for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                if (mount / "cgroup.controllers").exists():
                    found.insert(0, mount / path.lstrip("/"))
                    break
        elif "memory" in controllers.split(","):
            found.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/"))
    return found


class MemoryLimit:
    """A fresh cgroup that holds at most `limit_bytes` of memory; processes join it through `procs`."""

    def __init__(self, path: Path, v2: bool, limit_bytes: int):
        self.path, self.v2, self.limit_bytes = path, v2, limit_bytes

    @classmethod
    def create(cls, limit_bytes: int) -> MemoryLimit | None:
        """A new child of this process's cgroup with the limit set, or None where no cgroup can be written."""
        for parent in _own_cgroups():
            path = parent / f"cs336-grade-{uuid.uuid4().hex[:12]}"
            v2 = (parent / "cgroup.controllers").exists()
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                if v2:
                    (path / "memory.max").write_text(str(limit_bytes))
                    _try_write(path / "memory.swap.max", "0")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                    _try_write(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
                return cls(path, v2, limit_bytes)
            except OSError:
                _try_rmdir(path)
        return None

    @property
    def procs(self) -> Path:
        """Write a pid here to put that process (and all it starts later) under the limit."""
        return self.path / "cgroup.procs"

    def hit(self) -> bool:
        """Whether the kernel's OOM killer stopped a process of this cgroup."""
        try:
            if self.v2:
                events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
                return int(events.get("oom_kill", 0)) > 0
            control = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return int(control.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Kill whatever is still in the cgroup, then remove it."""
        deadline = time.monotonic() + 5.0
        while True:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if _try_rmdir(self.path) or time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _try_write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _try_rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


@cache
def unavailable() -> str | None:
    """Why no notebook can get a memory limit here (None when one can)."""
    probe = MemoryLimit.create(1 << 30)
    if probe is not None:
        probe.close()
        return None
    return ("no writable memory cgroup here (the grader is not root and has no delegated cgroup): notebooks run "
            "without a memory limit. Under Slurm, --mem limits each shard instead.")
