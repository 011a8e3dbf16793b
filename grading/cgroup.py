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


LEAVES = ("kernel", "ranks")


class MemoryLimit:
    """A fresh cgroup that holds at most `limit_bytes` of memory, with two leaves: the kernel's (`procs`) and the
    grader's test ranks' (`ranks_procs`), whose peak the grader reads around each request (`ranks_peak`)."""

    def __init__(self, path: Path, v2: bool, limit_bytes: int):
        self.path, self.v2, self.limit_bytes = path, v2, limit_bytes
        self._peak_fd: int | None = None

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
                    (path / "cgroup.subtree_control").write_text("+memory")
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                    _try_write(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
                for leaf in LEAVES:
                    (path / leaf).mkdir()
                return cls(path, v2, limit_bytes)
            except OSError:
                for leaf in LEAVES:
                    _try_rmdir(path / leaf)
                _try_rmdir(path)
        return None

    @property
    def procs(self) -> Path:
        """Write a pid here to put that process (and all it starts later) under the limit: the kernel's leaf."""
        return self.path / "kernel" / "cgroup.procs"

    @property
    def ranks_procs(self) -> Path:
        """The same for the grader's test ranks (their own leaf, so that their peak is theirs alone)."""
        return self.path / "ranks" / "cgroup.procs"

    def reset_ranks_peak(self) -> int | None:
        """Start measuring the test ranks' peak now; their memory in use now (bytes), None where it cannot be."""
        ranks = self.path / "ranks"
        try:
            if self.v2:  # Linux 6.12+: a write resets the peak seen through that open file
                if self._peak_fd is None:
                    self._peak_fd = os.open(ranks / "memory.peak", os.O_RDWR)
                os.write(self._peak_fd, b"reset\n")
                return int((ranks / "memory.current").read_text())
            (ranks / "memory.max_usage_in_bytes").write_text("0")
            return int((ranks / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            return None

    def ranks_peak(self) -> int | None:
        """The test ranks' peak memory (bytes) since `reset_ranks_peak`, all ranks together."""
        try:
            if self.v2:
                os.lseek(self._peak_fd, 0, os.SEEK_SET)
                return int(os.read(self._peak_fd, 64))
            return int((self.path / "ranks" / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError, TypeError):
            return None

    def hit(self) -> bool:
        """Whether the kernel's OOM killer stopped a process of this cgroup. A kill counts in the victim's leaf
        (cgroup v1 does not carry it up to the cgroup whose limit was passed), so every leaf is read."""
        counts = "memory.events" if self.v2 else "memory.oom_control"
        for folder in (self.path, *(self.path / leaf for leaf in LEAVES)):
            try:
                fields = dict(line.split() for line in (folder / counts).read_text().splitlines())
                if int(fields.get("oom_kill", 0)) > 0:
                    return True
            except (OSError, ValueError):
                pass
        return False

    def pids(self) -> list[int]:
        found = []
        for procs in (self.procs, self.ranks_procs):
            try:
                found += [int(p) for p in procs.read_text().split()]
            except OSError:
                pass
        return found

    def close(self) -> None:
        """Kill whatever is still in the cgroup, then remove it."""
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        deadline = time.monotonic() + 5.0
        while True:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            removed = all(_try_rmdir(self.path / leaf) for leaf in LEAVES) and _try_rmdir(self.path)
            if removed or time.monotonic() > deadline:
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
