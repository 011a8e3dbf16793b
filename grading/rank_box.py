"""The grader's own test ranks for one notebook: `cs336_parallel.rank_host`, beside the kernel but out of its reach.

A test's driver runs on ranks that the grader starts and talks to, not on ranks of the kernel's: the kernel
never receives the data a test draws, and each rank receives only its own share (what it would hold in a real
job). The kernel contributes its exercises only, pickled (`KernelSide.export`); they are unpickled on the ranks.

Where bubblewrap runs, the rank host gets a sandbox of its own, like the kernel's (grading/sandbox.py) but with
its own network and writable folder (ranks/); otherwise it runs as the same unprivileged user as the kernel, or
as a plain process (`--no-sandbox`). Either way the grader measures the ranks' traffic from outside
(`cs336_parallel.wire`): who sent how many bytes to whom during each request.

A reply is read with a limit on its size (what is left of the notebook's output limit), outside any lock shared
with other notebooks, and decoded as plain data only.
"""

from __future__ import annotations

import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cs336_parallel import plain, wire
from grading import sandbox
from grading.cgroup import MemoryLimit

START_TIMEOUT_S = 120.0  # the rank host imports torch, in a sandbox, on a busy machine
_LENGTH = struct.Struct("<Q")


class BoxStopped(Exception):
    """The test ranks stopped answering, or sent what may not be read: the reason, in one line."""


class ReplyTooLarge(BoxStopped):
    """A reply longer than what is left of the notebook's output limit."""


class RankBox:
    """`rank_host` in `box`/ranks, started on first use; `user`: the unprivileged account it runs as (None: the
    grader's own); `memory`: the notebook's memory cgroup, whose ranks' leaf it joins first; `settings`: added to
    its environment (`sandbox.kernel_env`)."""

    def __init__(self, box: Path, *, use_sandbox: bool, user: str | None = None, memory: MemoryLimit | None = None,
                 settings: Mapping[str, str] | None = None):
        self.box, self.use_sandbox, self.user, self.memory = box, use_sandbox, user, memory
        self.settings = dict(settings or {})
        self.process: subprocess.Popen | None = None
        self.pids: dict[int, list[int]] = {}  # world size -> the ranks' pids, as the grader sees them

    def command(self) -> list[str]:
        folder = self.box / "ranks"
        env = {**sandbox.kernel_env(folder, self.settings), "NBGRADER_EXECUTION": "autograde"}
        cmd = [sys.executable, "-m", "cs336_parallel.rank_host"]
        if self.use_sandbox:
            cmd = sandbox.bwrap_args(self.box, env, writable=("ranks",)) + cmd
        elif self.user:
            cmd = sandbox.as_user(self.user) + ["env", "-i", *(f"{k}={v}" for k, v in env.items())] + cmd
        if self.memory is not None:
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.memory.ranks_procs), *cmd]
        return cmd

    def start(self) -> None:
        sandbox.make_box(self.box)
        if self.user and not self.use_sandbox:
            sandbox.give_to(self.box, self.user)
        log = open(self.box / "k" / "ranks.log", "ab")  # noqa: SIM115 - the child owns it
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")} if self.use_sandbox or self.user else \
            sandbox.kernel_env(self.box / "ranks", self.settings)
        try:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, cwd=self.box / "ranks", env=env, start_new_session=True)
        finally:
            log.close()
        self.pids = {}

    def close(self) -> None:
        """Stop the rank host and everything it started."""
        process, self.process = self.process, None
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass
            process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                stream.close()

    @property
    def running(self) -> bool:
        """Whether the rank host is started and has not ended."""
        return self.process is not None and self.process.poll() is None

    # -- requests --------------------------------------------------------------------------------------------
    def request(self, message: dict, timeout: float, max_bytes: int) -> Any:
        """Send `message`, then wait at most `timeout` s for the reply, of at most `max_bytes`; its decoded value.
        Raises BoxStopped (and stops the box) when the box ends, hangs or replies what may not be read."""
        if not self.running:
            self.close()
            self.start()
        try:
            data = plain.encode(message, max_bytes=1 << 30)
            self.process.stdin.write(_LENGTH.pack(len(data)) + data)
            self.process.stdin.flush()
            reply = self._read(time.monotonic() + timeout, max_bytes)
            return plain.decode(reply, max_bytes=max_bytes)
        except (OSError, EOFError) as e:
            self.close()
            raise BoxStopped(f"the test ranks stopped ({self._ended() or type(e).__name__})") from None
        except plain.NotPlainError as e:
            self.close()
            raise BoxStopped(f"the test ranks sent what is not plain data: {e}") from None
        except BoxStopped:
            self.close()
            raise

    def _read(self, deadline: float, max_bytes: int) -> bytes:
        fd = self.process.stdout.fileno()
        head = self._read_exactly(fd, _LENGTH.size, deadline)
        (length,) = _LENGTH.unpack(head)
        if length > max_bytes:
            raise ReplyTooLarge(f"a reply of {length / 2**20:.1f} MB from the test ranks passed what is left of the "
                                f"notebook's output limit ({max_bytes / 2**20:.1f} MB)")
        return self._read_exactly(fd, length, deadline)

    def _read_exactly(self, fd: int, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise BoxStopped("the test ranks did not answer in time, and were stopped")
                chunk = os.read(fd, min(n - got, 1 << 20))
                if not chunk:
                    raise EOFError
                chunks.append(chunk)
                got += len(chunk)
        return b"".join(chunks)

    def _ended(self) -> str:
        if self.process is None or self.process.poll() is None:
            return ""
        code = self.process.returncode
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    # -- what a test asks ------------------------------------------------------------------------------------
    def fresh(self, tested: Any, timeout: float) -> None:
        """Replace the ranks that have run, unless they ran the tests of `tested`. Ranks not started yet are fresh:
        the box is not started for this (a notebook whose tests never reach the ranks never starts it)."""
        if self.running:
            self.request({"op": "fresh", "tested": tested}, timeout, 1 << 20)
        self.pids = {}

    def restart(self, timeout: float) -> None:
        """Replace the ranks that have run (none if the box is not running)."""
        if self.running:
            self.request({"op": "restart"}, timeout, 1 << 20)
        self.pids = {}

    def run(self, world_size: int, exercises: bytes, cells: dict, requests: list[bytes], timeout: float,
            max_bytes: int) -> tuple[dict, list[list[int]] | None, int | None]:
        """Each rank's reply to its request; the bytes each pair of ranks exchanged meanwhile; and the most memory
        the ranks held together meanwhile, above what they held before (None: not measured)."""
        pids = self._ranks(world_size, timeout)
        before = wire.snapshot(pids) if pids else None
        in_use = self.memory.reset_ranks_peak() if self.memory is not None else None
        reply = self.request({"op": "run", "world_size": world_size, "exercises": exercises, "cells": cells,
                              "requests": requests, "timeout": timeout}, timeout + 60.0, max_bytes)
        peak = self.memory.ranks_peak() if in_use is not None else None
        after = wire.snapshot(pids) if before is not None else None
        if not isinstance(reply, dict) or "ok" not in reply:
            self.pids.pop(world_size, None)  # after a failure the ranks may have been replaced
        traffic = wire.traffic(before, after) if after is not None else None
        return reply, traffic, (max(0, peak - in_use) if peak is not None else None)

    def _ranks(self, world_size: int, timeout: float) -> list[int] | None:
        """The ranks' pids as the grader sees them, once they have joined their group."""
        if world_size not in self.pids:
            reply = self.request({"op": "ready", "world_size": world_size}, max(timeout, START_TIMEOUT_S), 1 << 20)
            inner = reply.get("ok") if isinstance(reply, dict) else None
            if not (isinstance(inner, list) and len(inner) == world_size and all(type(p) is int for p in inner)):
                raise BoxStopped(f"the test ranks of world size {world_size} did not start: "
                                 f"{(reply or {}).get('error', reply)!s:.200}")
            self.pids[world_size] = wire.outer_pids(self.process.pid, inner)
        return self.pids[world_size]
