"""A submission's kernel in a sandbox of its own (bubblewrap), started by nbgrader's executor.

`bwrap` gives the kernel new mount, PID, network, IPC, UTS and user namespaces:
- it sees the system (/usr), the Python environment and the cs336_parallel package read-only, and one
  writable folder, its own copy of the submission; not grading/ (the sources, the gradebook, the config),
  not another submission, not the grader's home or environment variables;
- its network is a loopback device of its own: the ranks reach each other over TCP, nothing reaches out;
- it has no capabilities (bwrap keeps them for root unless told), may not make user namespaces, and runs
  in a new session (no access to the grader's terminal);
- every process in it ends with the kernel: the sandbox's PID 1 takes them all along when the kernel exits
  or is killed, and bwrap kills the sandbox if the grader dies (`--die-with-parent`).
The kernel talks to the grader through ZeroMQ's ipc transport, over sockets in a folder of the sandbox.
Where bwrap cannot run, `unavailable()` says why; grading then runs unsandboxed only if asked (cli.py).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import zmq
from jupyter_client.manager import AsyncKernelManager
from traitlets import Bool, Dict, Int, Unicode

import cs336_parallel

# What of /etc a Python process needs: the loader's cache, time zone and certificates, from the system; users,
# and names resolved from files only (no DNS: torch's store would wait for it), written by the grader.
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "ssl", "fonts", "mime.types")
ETC_WRITTEN = {"hosts": "127.0.0.1 localhost sandbox\n::1 localhost sandbox\n",
               "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
               "passwd": "root:x:0:0:root:/tmp:/bin/sh\n", "group": "root:x:0:\n"}
# Environment variables that reach the kernel (the grader's own stay outside: tokens, paths, credentials).
PASSED_ON = ("LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
PASSED_ON_PREFIXES = ("CS336_",)
TMP_BYTES = 1 << 30  # the sandbox's /tmp and /dev/shm (memory-backed, and counted by the memory limit)


def bwrap() -> str | None:
    return shutil.which("bwrap")


def readonly_paths() -> list[Path]:
    """The Python environment, its base installation, and the package (an editable install lives in the repo)."""
    paths = [Path(sys.prefix), Path(sys.base_prefix), Path(cs336_parallel.__file__).resolve().parent]
    paths += [Path(p).resolve() for p in paths[:2]]
    system = Path("/usr")
    unique = []
    for p in paths:
        if not p.is_relative_to(system) and p not in unique:
            unique.append(p)
    return unique


def make_box(box: Path) -> Path:
    """Lay out a submission's private folder: work/ (its files, the kernel's working folder), k/ (the kernel's
    connection file and sockets, its replies), ranks/ (the grader's test ranks' working folder), etc/ (the files
    above). Returns work/."""
    for sub in ("work", "k", "ranks", "etc"):
        (box / sub).mkdir(parents=True, exist_ok=True)
    for name, text in ETC_WRITTEN.items():
        (box / "etc" / name).write_text(text)
    return box / "work"


def bwrap_args(box: Path, env: dict[str, str], writable: tuple[str, ...] = ("work", "k")) -> list[str]:
    """bwrap's command line: only the folders `writable` of `box` are writable (the kernel's: work/, the submission's
    copy, and k/, its sockets; the test ranks': ranks/), and the first of them is the working folder."""
    args = [bwrap() or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for name in ETC_WRITTEN:
        args += ["--ro-bind", str(box / "etc" / name), f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
             "--size", str(TMP_BYTES), "--tmpfs", "/dev/shm"]
    for path in readonly_paths():
        args += ["--ro-bind", str(path), str(path)]
    for sub in writable:
        args += ["--bind", str(box / sub), str(box / sub)]
    args += ["--remount-ro", "/", "--chdir", str(box / writable[0]), "--clearenv"]  # the rest: read-only
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--"]


def kernel_env(workdir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kernel's whole environment: nothing of the grader's but locale, thread counts, CS336_ settings, where the
    package is, and `extra`."""
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
           "HOME": str(workdir), "TMPDIR": "/tmp", "NBGRADER_EXECUTION": "autograde", "PYTHONNOUSERSITE": "1",
           "MPLBACKEND": "module://matplotlib_inline.backend_inline",
           # the package the grader uses and binds into the sandbox, wherever the environment's own install points
           "PYTHONPATH": str(Path(cs336_parallel.__file__).resolve().parent.parent)}
    env.update({k: v for k, v in os.environ.items() if k in PASSED_ON or k.startswith(PASSED_ON_PREFIXES)})
    return {**env, **(extra or {})}


def as_user(user: str) -> list[str]:
    """The command prefix that runs a command as `user` (and that user's own group), with no other group, no
    capability and no way to gain one (util-linux's setpriv): where there is no sandbox, the grader (root) runs the
    notebook this way."""
    import pwd

    entry = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--"]


USER = "cs336-student"  # the account notebooks run as where there is no sandbox (Gradescope's setup.sh makes it)


def user_unavailable(user: str = USER) -> str | None:
    """Why notebooks cannot run as `user` here (None when they can): only root can switch, to a user that exists."""
    import pwd

    if os.geteuid() != 0:
        return "only root can run notebooks as another user"
    try:
        pwd.getpwnam(user)
    except KeyError:
        return f"there is no user {user} (as root: useradd --system --no-create-home {user})"
    return None if shutil.which("setpriv") else "setpriv (util-linux) is not installed"


def open_to_others(path: Path) -> Path | None:
    """`path` if a user other than its owner and group may reach it and enter or read it (every folder above it
    lets others pass through), else None."""
    path = path.resolve()
    if not path.exists() or not path.stat().st_mode & 0o005:
        return None
    return path if all(folder.stat().st_mode & 0o001 for folder in path.parents) else None


def give_to(box: Path, user: str) -> None:
    """Make the kernel's folders of `box` (work/, k/, ranks/) the user's, and nothing else: the grader keeps the
    rest."""
    import pwd

    entry = pwd.getpwnam(user)
    os.chown(box, 0, 0)
    os.chmod(box, 0o711)  # the user may pass through to its folders, not list the box
    for sub in ("work", "k", "ranks"):
        for root, dirs, files in os.walk(box / sub):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(name, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


@contextmanager
def only_grader_as(user: str, interrupt: threading.Event):
    """Hold the machine's lock on running notebooks as `user`: `end_processes_of(user)` after one notebook must
    not end another grader's (a second `python -m grading` on the machine waits here, until `interrupt`)."""
    folder = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    fd = os.open(os.path.join(folder, f"cs336-grading-as-{user}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if interrupt.wait(0.2):
                    raise RuntimeError(f"interrupted while another grader ran a notebook as {user}") from None
        yield
    finally:
        os.close(fd)  # and with it the lock


def end_processes_of(user: str, timeout: float = 10.0) -> None:
    """Kill every process of `user`, until none is left: after a notebook, nothing of its runs on."""
    import pwd
    import time

    uid = pwd.getpwnam(user).pw_uid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        found.append(int(entry))
                except OSError:
                    continue
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"processes of {user} are still running after {timeout:g} s")


@cache
def unavailable() -> str | None:
    """Why no sandbox can run here (None when bwrap works): checked by starting Python in one."""
    if bwrap() is None:
        return ("bubblewrap (bwrap) is not installed: `make sandbox` installs it (Debian/Ubuntu: apt-get install "
                "bubblewrap)")
    box = Path(private_folder())
    try:
        done = subprocess.run([*bwrap_args(box, kernel_env(make_box(box))), sys.executable, "-c", "import torch"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not start: {e}"
    finally:
        shutil.rmtree(box, ignore_errors=True)
    if done.returncode:
        return f"bwrap cannot make a sandbox here: {done.stderr.strip()[-300:]}"
    return None


def inside(pid: int) -> int | None:
    """A process of the sandbox that `pid` (bwrap) started: the first of its descendants in a network namespace
    other than this process's (None if there is none, or no /proc)."""
    try:
        ours = os.readlink("/proc/self/ns/net")
    except OSError:
        return None
    pending = [pid]
    while pending:
        current = pending.pop(0)
        try:
            if os.readlink(f"/proc/{current}/ns/net") != ours:
                return current
            for task in os.listdir(f"/proc/{current}/task"):
                pending += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return None


def loopback_bytes(pid: int) -> int | None:
    """Bytes sent on the loopback interface of `pid`'s network namespace (all its processes' local traffic), read
    from outside it in /proc/<pid>/net/dev; None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip().startswith("lo"):
                return int(counters.split()[8])  # receive: bytes, packets, errs, drop, fifo, frame, compressed,
                #                                   multicast; then transmit: bytes
    except (OSError, ValueError, IndexError):
        return None
    return None


def private_folder() -> str:
    """A private folder with a short path: ZeroMQ's ipc socket paths must stay under 108 bytes."""
    return tempfile.mkdtemp(prefix="cs336-", dir="/tmp" if os.path.isdir("/tmp") else None)


class SandboxedKernelManager(AsyncKernelManager):
    """nbgrader's kernel manager, starting the kernel in a sandbox (or, with `sandbox=False`, as a plain
    process) inside the folder `box`, under a memory cgroup when `cgroup_procs` names one."""

    box = Unicode(help="the submission's private folder: work/ is the kernel's, k/ holds its sockets")
    sandbox = Bool(True)
    user = Unicode("", help="without a sandbox: the unprivileged user the kernel runs as ('' for the grader's own)")
    cgroup_procs = Unicode("", help="cgroup.procs of the notebook's memory cgroup ('' for none)")
    settings = Dict(help="added to the kernel's environment (`kernel_env`)")
    max_message_bytes = Int(64 << 20, help="the largest message the grader takes from the kernel: ZeroMQ drops a "
                                           "connection that sends a larger one, rather than the grader holding it")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        make_box(Path(self.box))
        runtime = Path(self.box) / "k"
        self.connection_file = str(runtime / "kernel.json")
        if self.sandbox:  # across the sandbox's network namespace, only files connect
            self.transport = "ipc"
            self.ip = str(runtime / "kernel-ipc")

    def client(self, **kwargs):
        kc = super().client(**kwargs)
        kc.context.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # before any channel's socket exists
        return kc

    @property
    def workdir(self) -> Path:
        return Path(self.box) / "work"

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        if self.sandbox:
            cmd = bwrap_args(Path(self.box), kernel_env(self.workdir, self.settings)) + cmd
        elif self.user:
            cmd = as_user(self.user) + cmd
        if self.cgroup_procs:  # join the cgroup first: everything the kernel starts is counted with it
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.cgroup_procs, *cmd]
        return cmd

    async def _async_pre_start_kernel(self, **kw):
        if self.sandbox:  # a signal would reach bwrap, not the kernel: interrupts go as messages
            self.kernel_spec.interrupt_mode = "message"
        return await super()._async_pre_start_kernel(**kw)

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        log = open(Path(self.box) / "k" / "kernel.log", "wb")  # noqa: SIM115 - the kernel process owns it
        kw.update(stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=str(self.workdir))
        if self.sandbox:
            kw["env"] = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # bwrap's own; the kernel's is set inside
        else:  # without a sandbox, the kernel ends itself if the grader dies (ipykernel's parent poller)
            kw["env"] = {**kernel_env(self.workdir, self.settings), "JPY_PARENT_PID": str(os.getpid())}
        if self.user and not self.sandbox:
            give_to(Path(self.box), self.user)  # the connection file, the submission's copy, the ranks' folder
        try:
            await super()._async_launch_kernel(kernel_cmd, **kw)
        finally:
            log.close()
