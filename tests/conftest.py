"""Shared fixtures: processes checked for leftovers, scripts run in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cs336_parallel import procfs

ROOT = Path(__file__).resolve().parent.parent
# Grading isolates each submission where bubblewrap runs (`make sandbox` installs it); where it cannot, the
# suite grades without isolation rather than fail, and the isolation tests are skipped (tests/test_isolation.py).
os.environ.setdefault("CS336_GRADING_SANDBOX", "auto")


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    if os.path.isdir("/proc"):
        return procfs.state(pid) not in (None, "Z")
    try:  # no /proc (macOS)
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def _default_sigint() -> None:
    """Let Ctrl-C reach the script as in a terminal, even when pytest runs in the background of a shell
    (which ignores SIGINT there, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def python_script(tmp_path):
    """Start a Python script (dedented source) in a fresh interpreter; returns a Popen. A script still
    running when the test ends (it failed) is terminated; its ranks die with it."""
    started = []

    def start(source: str, **kwargs) -> subprocess.Popen:
        path = tmp_path / f"script_{len(list(tmp_path.iterdir()))}.py"
        path.write_text(textwrap.dedent(source))
        started.append(subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=_default_sigint,
                                        **kwargs))
        return started[-1]

    yield start
    for script in started:
        if script.poll() is None:
            script.terminate()
            script.wait(timeout=10)
