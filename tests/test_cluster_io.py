"""The cluster's edges: no one else can reach it, its output is live and bounded, and it leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from common import PATIENCE_S, Lines, wait_gone, wait_until
from cs336_parallel import Cluster
from cs336_parallel.output import MAX_LINES, TAIL_LINES


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, timeout=20) as c:
        yield c


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def unread_bytes(port: int, client_port: int) -> int | None:
    """Bytes that came to local `port` from local `client_port` and that the process listening on `port` has not
    read yet (None: no such connection)."""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            ends = [int(address.rsplit(":", 1)[1], 16) for address in fields[1:3]]
            if ends == [port, client_port]:
                return int(fields[4].split(":")[1], 16)  # tx_queue:rx_queue
    return None


def cluster_processes(cluster: Cluster) -> list[int]:
    from multiprocessing import forkserver

    return [os.getpid(), forkserver._forkserver._forkserver_pid, *(s["pid"] for s in cluster.status())]


def other_addresses() -> list[str]:
    """This machine's addresses that are not loopback ones (how another machine reaches it)."""
    try:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        found = []
    return [a for a in found if not a.startswith("127.") and a != "::1" and not a.startswith("fe80")]


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads sockets from /proc (Linux)")


# -- no strangers ---------------------------------------------------------------------------------------------------
@needs_proc
def test_nothing_the_cluster_listens_on_accepts_a_connection_from_another_address(cluster):
    addresses = other_addresses()
    if not addresses:
        pytest.skip("this machine has no address other than loopback")
    ports = [port for pid in cluster_processes(cluster) for port in listening_ports(pid)]
    assert listening_ports(os.getpid()) == []  # the kernel itself listens on nothing
    assert ports  # the ranks' own connections (gloo's), at least
    for address in addresses:
        for port in ports:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((address, port), timeout=5).close()


@needs_proc
def test_garbage_sent_to_every_port_the_cluster_listens_on_reaches_no_stderr(cluster, capfd):
    ports = [port for pid in cluster_processes(cluster) for port in listening_ports(pid)]
    # A TCPStore's greeting, then a key longer than it accepts: it used to print a C++ stack on the kernel's stderr.
    store_shaped = b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 10**6)
    for port in ports:
        for garbage in (store_shaped, os.urandom(4096), b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(garbage)
                mine = s.getsockname()[1]
                # what the listener does with garbage it does as it reads it: wait until it has read some
                wait_until(lambda: unread_bytes(port, mine) in (None, *range(len(garbage))),  # noqa: B023
                           f"the process listening on port {port} to read from a connection")
    assert cluster.run(lambda: dist.get_rank()) == [0, 1]
    out, err = capfd.readouterr()
    assert err == "" and "stderr]" not in out


# -- live, bounded output -------------------------------------------------------------------------------------------
def test_output_streams_while_the_call_runs(python_script, tmp_path):
    flag = tmp_path / "go"
    script = python_script(f"""
        import os, time
        from cs336_parallel import Cluster
        def wait_for_the_test():
            print("waiting", flush=True)
            deadline = time.monotonic() + {PATIENCE_S}
            while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
            return os.path.exists({str(flag)!r})
        c = Cluster(2, timeout=None)
        print("result", c.run(wait_for_the_test), flush=True)
    """)
    lines = Lines(script.stdout, script.stderr)
    try:
        lines.wait_for("[rank 0] waiting", "[rank 1] waiting")  # fails if they come only with the result
    finally:
        flag.touch()
    assert "result [True, True]" in lines.rest(), script.stderr.read()


def test_output_is_bounded_keeping_the_tail(cluster, capfd):
    def flood():
        if dist.get_rank() == 0:
            for i in range(100_000):
                print(i)
            print("x" * 10_000_000, end="")  # one endless line

    cluster.run(flood)
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert err == "" and len(lines) <= MAX_LINES + TAIL_LINES + 1
    assert lines[MAX_LINES - 1] == f"[rank 0] {MAX_LINES - 1}"
    assert lines[MAX_LINES].startswith(f"[rank 0] ... {100_000 - MAX_LINES - TAIL_LINES + 1:,} lines (")
    assert lines[MAX_LINES + 1:-1] == [f"[rank 0] {i}" for i in range(100_000 - TAIL_LINES + 1, 100_000)]
    assert lines[-1].endswith("x ... (9,998,000 more characters)")
    assert cluster.run(lambda: "next") == ["next", "next"] and capfd.readouterr().out == ""


def test_carriage_returns_show_only_the_last_state(cluster, capfd):
    def progress():
        if dist.get_rank() == 1:
            for percent in range(0, 101, 10):
                print(f"\r{percent}%", end="", flush=True)
                time.sleep(0.15)  # the bar outlives a flush of the cell's output
            print()
            print("10%\r20%\r30%")
            print("40%\r50%\r")
            print("60%\r70%\r", end="")

    cluster.run(progress)
    assert capfd.readouterr().out.splitlines() == ["[rank 1] 100%", "[rank 1] 30%", "[rank 1] 50%", "[rank 1] 70%"]


# -- clean exit -----------------------------------------------------------------------------------------------------
def start_descendants() -> list[int]:
    """A program and a forked copy of this rank, both asleep, started so they would outlive the rank."""
    program = subprocess.Popen(["sleep", "600"])
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    return [program.pid, child]


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_processes_a_rank_starts_end_with_it(how):
    c = Cluster(2).start()
    started = c.run(start_descendants, ranks=[1])[0]
    c.shutdown() if how == "shutdown" else c.restart()
    assert wait_gone(started) == []
    c.shutdown()


def _killed_kernel(python_script, how: str, tmpdir: str) -> tuple[list[int], subprocess.Popen]:
    """A script ("kernel") that starts a cluster whose rank 1 starts two processes, then is killed: alone, or
    with its process group (as Jupyter stops a kernel). Returns those processes' pids and the script."""
    script = python_script(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cluster_io import start_descendants
        from cs336_parallel import Cluster
        c = Cluster(2, timeout=None)
        print("started", *c.run(start_descendants, ranks=[1])[0], flush=True)
        time.sleep(600)
    """, start_new_session=True, env={**os.environ, "TMPDIR": tmpdir})
    started = [int(p) for p in Lines(script.stdout, script.stderr).wait_for("started").split()[1:]]
    assert len(started) == 2, started
    if how == "kernel killed":
        script.kill()
    else:
        os.killpg(script.pid, signal.SIGKILL)
    script.wait()
    return started, script


@pytest.mark.parametrize("how", ["kernel killed", "kernel's process group killed"])
def test_nothing_outlives_a_killed_kernel_and_its_folders_are_removed(python_script, how):
    tmpdir = tempfile.mkdtemp(prefix="t18-")  # short: a Unix socket's path must fit in 108 bytes
    try:
        started, _ = _killed_kernel(python_script, how, tmpdir)
        assert wait_gone(started) == []
        wait_until(lambda: not [name for name in os.listdir(tmpdir) if name.startswith(("cs336-cluster-", "pymp-"))],
                   f"the cluster's folders in {tmpdir} to be removed")
    finally:
        subprocess.run(["rm", "-rf", tmpdir])


def test_the_next_start_removes_the_folders_of_a_kernel_killed_with_its_rank_server(python_script):
    tmpdir = tempfile.mkdtemp(prefix="t18-")
    try:
        script = python_script("""
            import os, signal, time
            from multiprocessing import forkserver
            from cs336_parallel import Cluster
            c = Cluster(2).start()
            print(c._processes.dir, flush=True)
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)  # no one left to clean up
            os.kill(os.getpid(), signal.SIGKILL)
        """, env={**os.environ, "TMPDIR": tmpdir})
        left = script.stdout.readline().strip()
        script.wait(timeout=PATIENCE_S)
        assert os.path.isdir(left), script.stderr.read()
        done = subprocess.run([sys.executable, "-c", "from cs336_parallel import Cluster; Cluster(2).start()"],
                              capture_output=True, text=True, timeout=PATIENCE_S, env={**os.environ, "TMPDIR": tmpdir})
        assert done.returncode == 0, done.stderr
        assert not os.path.exists(left)
    finally:
        subprocess.run(["rm", "-rf", tmpdir])
