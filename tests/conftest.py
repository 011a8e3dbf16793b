"""Fixtures and hooks: scripts run in a fresh interpreter, sandbox tests skipped (and said so) where no sandbox runs.

What test modules import (ROOT, waiting for processes and output) is in tests/common.py: a plain module."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common import ROOT, xdist_unit

# Grading isolates each submission where bubblewrap runs (`make sandbox` installs it); where it cannot, the
# suite grades without isolation rather than fail, and the tests marked `sandbox` are skipped, saying why.
os.environ.setdefault("CS336_GRADING_SANDBOX", "auto")


@functools.cache
def _sandbox_missing() -> str | None:
    """Why no sandbox can run here (None when one can): checked once, by starting Python in one."""
    from grading import sandbox

    return sandbox.unavailable()


@pytest.hookimpl(tryfirst=True)  # before pytest's own, which then skips the test, at the test's own line
def pytest_runtest_setup(item):
    if item.get_closest_marker("sandbox") and (why := _sandbox_missing()):
        item.add_marker(pytest.mark.skip(reason=f"needs a sandbox: {why}"))


# pytest-xdist (`make test`) gives each worker whole modules, so that a module's fixtures are built once, but
# deals test_mutations.py out notebook by notebook (each notebook's run is a fixture of its own), so that both
# workers grade notebooks. The longest first; the rest fill in around them.
LONGEST_FIRST = ("test_trust.py", "test_mutations.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return ByUnit(config, log)


# A slow test grades whole notebooks: minutes on quiet cores, several times that beside other work. Its timeout
# only catches a hang (pyproject's 300 s is for the rest); a module may still set its own.
SLOW_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST or LONGEST_FIRST.index(item.path.name) - 2)
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter):
    if _sandbox_missing.cache_info().currsize and (why := _sandbox_missing()):
        terminalreporter.write_line(f"No sandbox here ({why}): the tests marked `sandbox` were skipped, and "
                                    "submissions are graded without isolation.", yellow=True)


def _default_sigint() -> None:
    """Let Ctrl-C reach the script as in a terminal, even when pytest runs in the background of a shell
    (which ignores SIGINT there, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def python_script(tmp_path):
    """Start a Python script (dedented source) in a fresh interpreter; returns a Popen. A script still
    running when the test ends (it failed) is terminated; its ranks die with it."""
    started = []
    scripts = tmp_path / "scripts"
    scripts.mkdir()

    def start(source: str, **kwargs) -> subprocess.Popen:
        path = scripts / f"script_{len(started)}.py"
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


@pytest.fixture(scope="session")
def unprivileged_user():
    """Gradescope's setup.sh makes the user notebooks run as where there is no sandbox; here the test makes it (as
    root). This machine's Python lives under /root, which others may not enter: for the duration, they may pass
    through (not list) the folders above it, as they may through Gradescope's /usr."""
    from grading import sandbox

    if os.geteuid() != 0:
        pytest.skip("grading without a sandbox switches user: only root can (Gradescope's autograder is root)")
    if sandbox.user_unavailable():
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", sandbox.USER],
                       check=True)
    with _passable_for_others():
        yield sandbox.USER


@contextlib.contextmanager
def _passable_for_others():
    """The folders above Python's, o+x for as long as a test session on this machine needs them (pytest-xdist
    runs several): the first to come opens them, the last to go closes them again."""
    folders = {f for top in {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()} for f in [top, *top.parents]}
    state = Path("/run/cs336-tests-passable.json")

    def update(coming: bool) -> None:
        with open("/run/cs336-tests-passable.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            users, closed = json.loads(state.read_text()) if state.exists() else ([], {})
            users = [pid for pid in users if pid != os.getpid() and Path(f"/proc/{pid}").exists()]  # the living
            if not users and coming:
                closed = {str(f): f.stat().st_mode for f in folders if not f.stat().st_mode & 0o001}
                for folder, mode in closed.items():
                    Path(folder).chmod(mode | 0o001)
            users += [os.getpid()] if coming else []
            if users:
                state.write_text(json.dumps([users, closed]))
            else:
                for folder, mode in closed.items():
                    Path(folder).chmod(mode)
                state.unlink(missing_ok=True)

    update(coming=True)
    try:
        yield
    finally:
        update(coming=False)
