"""The cluster never returns a stale result and recovers from every state: requests in step, health checked
before each call, arguments checked before anything is sent, clear errors, and a bounded soak test."""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common import pid_alive, wait_gone, wait_until
from cs336_parallel import Cluster, RankError, RankTimeout, procfs
from cs336_parallel.processes import RankProcess, RankProcesses


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, timeout=10) as c:
        yield c


def ranks_and_pids():
    return dist.get_rank(), os.getpid()


def wait_dead(pid: int) -> None:
    """Until `pid` is dead (a zombie counts: its parent may not have reaped it yet)."""
    wait_gone([pid])


class _FailsToLoad:
    """Pickles on the rank; rebuilding it in the kernel raises."""

    def __reduce__(self):
        return _refuse_to_load, ()


def _refuse_to_load():
    raise RuntimeError("this object cannot be rebuilt here")


# -- requests in step -----------------------------------------------------------------------------------------------
def test_a_result_that_fails_to_load_in_the_kernel_is_named_and_the_next_call_gets_its_own_results(cluster):
    def unloadable_on_rank_0():
        if dist.get_rank() == 0:
            return _FailsToLoad()
        time.sleep(0.3)  # the others reply after rank 0's reply failed to load
        return "late"

    with pytest.raises(RankError) as info:
        cluster.run(unloadable_on_rank_0)
    assert info.value.rank == 0 and "cannot be loaded in the kernel" in info.value.headline
    assert "this object cannot be rebuilt here" in str(info.value)
    for i in range(3):
        assert cluster.run(lambda i=i: (i, dist.get_rank())) == [(i, r) for r in range(4)]


@pytest.mark.parametrize("timeout", ["3", math.nan, -1.0, 0, True])
def test_a_bad_timeout_is_refused_before_anything_is_sent(cluster, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        cluster.call(time.sleep, (0.5,), timeout=timeout)
    assert cluster.run(lambda: ("fresh", dist.get_rank())) == [("fresh", r) for r in range(4)]


@pytest.mark.parametrize("timeout", [math.nan, -5.0, "10"])
def test_a_cluster_with_a_bad_timeout_is_refused(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        Cluster(2, timeout=timeout)


def test_calls_from_several_threads_each_get_their_own_results(cluster):
    wrong = []

    def caller(t: int) -> None:
        for i in range(5):
            def tagged(t=t, i=i):
                time.sleep(0.01 * ((dist.get_rank() + t + i) % 3))
                return (t, i, dist.get_rank())
            results = cluster.run(tagged)
            if results != [(t, i, r) for r in range(4)]:
                wrong.append(results)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert wrong == [] and not any(thread.is_alive() for thread in threads)


def test_a_rank_that_forks_replies_once_and_its_child_is_gone(cluster):
    def fork_on_rank_1():
        if dist.get_rank() == 1 and os.fork() == 0:
            return ("child", os.getpid())  # the child comes back into the worker's loop too
        return ("rank", os.getpid())

    results = cluster.run(fork_on_rank_1)
    pids = cluster.run(os.getpid)
    assert results == [("rank", pid) for pid in pids]
    for i in range(3):
        assert cluster.run(lambda i=i: (i, dist.get_rank())) == [(i, r) for r in range(4)]


def test_a_second_interrupt_during_the_cleanup_leaves_the_cluster_in_step(python_script):
    """The first Ctrl-C comes from a rank while the call runs; the second arrives while the kernel is reading
    where the ranks were (sent from there, so that it lands in the cleanup every time)."""
    script = python_script("""
        import os, signal, time, torch.distributed as dist
        from cs336_parallel import Cluster
        c = Cluster(2, timeout=None)
        old = c.run(os.getpid)
        dump_stacks = c._processes.dump_stacks
        def interrupted_again(ranks):
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C, while the first one is being handled
            time.sleep(1)
            return dump_stacks(ranks)
        c._processes.dump_stacks = interrupted_again
        kernel = os.getpid()
        def interrupt_me():
            if dist.get_rank() == 0:
                os.kill(kernel, signal.SIGINT)
            time.sleep(60)
            return "stale"
        try:
            c.run(interrupt_me)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        c._processes.dump_stacks = dump_stacks
        print("old", *old, flush=True)
        for i in range(3):
            print("next", c.run(lambda i=i: (i, dist.get_rank())), flush=True)
    """)
    out, err = script.communicate(timeout=240)
    assert script.returncode == 0, err
    assert "interrupted" in out
    assert [line for line in out.splitlines() if line.startswith("next")] == [
        f"next [({i}, 0), ({i}, 1)]" for i in range(3)]
    old = [int(p) for p in next(line for line in out.splitlines() if line.startswith("old")).split()[1:]]
    assert wait_gone(old) == []


# -- health checked before every call -------------------------------------------------------------------------------
def say_later(text: str, go: str, said: str) -> None:
    """Print `text` on stderr once the file `go` exists (the test makes it once the call has returned), then make
    the file `said`."""
    def say():
        while not os.path.exists(go):
            time.sleep(0.01)
        print(text, file=sys.stderr, flush=True)
        open(said, "w").close()

    threading.Thread(target=say, daemon=True).start()


def test_a_rank_killed_while_idle_is_named_and_the_group_restarts(cluster, tmp_path):
    pid = cluster.status()[2]["pid"]
    go, said = tmp_path / "go", tmp_path / "said"
    cluster.run(say_later, "last words", str(go), str(said), ranks=[2])
    go.touch()
    wait_until(said.exists, "rank 2 to print its last words")
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    with pytest.raises(RankError) as info:
        cluster.run(lambda: "never runs")
    assert info.value.rank == 2
    assert info.value.headline == "rank 2 was killed by signal SIGKILL while idle, between calls."
    assert "[rank 2 stderr] last words" in str(info.value)  # what it said before it died
    assert cluster.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_a_rank_reaped_between_the_two_looks_is_still_seen_dead_while_idle(monkeypatch):
    """A killed rank is a zombie (its pipes may stay open while its threads end), then reaped (gone from /proc, its
    pipes closed and its end reported). If it passes from one to the other while the kernel checks it, whichever
    look comes first sees a zombie and the second a closed pipe: either way it is seen dead."""
    conn, rank_end = multiprocessing.Pipe()
    sentinel, reported = multiprocessing.Pipe(duplex=False)
    reaped = []

    def reap() -> None:  # after the first look
        if not reaped:
            reaped.append(True)
            rank_end.close()
            reported.send_bytes(b"-9")

    def state(pid: int) -> str | None:
        found = None if reaped else "Z"
        reap()
        return found

    def wait(handles: list, timeout: float | None = None) -> list:
        ready = real_wait(handles, timeout)
        reap()
        return ready

    real_wait = multiprocessing.connection.wait
    monkeypatch.setattr(procfs, "state", state)
    monkeypatch.setattr(multiprocessing.connection, "wait", wait)
    process = SimpleNamespace(pid=os.getpid(), sentinel=sentinel, exitcode=-signal.SIGKILL, join=lambda timeout: None)
    ranks = RankProcesses(1, "gloo")
    ranks._ranks = [RankProcess(0, process, conn, pipes=None, stack="")]
    try:
        assert ranks.find_unhealthy() == (0, "was killed by signal SIGKILL while idle, between calls")
    finally:
        ranks._ranks = []  # no fake for the exit's clean-up to kill


def test_a_rank_whose_process_group_is_gone_is_restarted(cluster):
    before = cluster.run(os.getpid)
    cluster.run(dist.destroy_process_group, ranks=[1])
    assert cluster.run(lambda: (dist.is_initialized(), dist.get_rank())) == [(True, r) for r in range(4)]
    assert not set(before) & set(cluster.run(os.getpid))


def test_a_stopped_rank_is_called_stopped():
    with Cluster(2, timeout=2) as c:
        def stop_rank_1():
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            return dist.get_rank()

        with pytest.raises(RankTimeout) as info:
            c.run(stop_rank_1)
        assert "rank 1 is stopped" in info.value.headline and "paused by a signal" in str(info.value)
        assert "no Python stack" not in str(info.value)
        assert c.run(lambda: dist.get_rank()) == [0, 1]

        pid = c.status()[0]["pid"]
        os.kill(pid, signal.SIGSTOP)  # stopped between calls
        wait_until(lambda: procfs.state(pid) == "T", "rank 0 to stop")
        with pytest.raises(RankError, match=r"rank 0 is stopped \(paused by a signal such as SIGSTOP\)"):
            c.run(lambda: dist.get_rank())
        assert wait_gone([pid]) == []
        assert c.run(lambda: dist.get_rank()) == [0, 1]


# -- arguments checked first ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, message", [
    (True, "world_size must be an integer >= 1"),
    (10_000, "world_size=10000 is more than this machine can hold: 10000 ranks need about"),
])
def test_a_world_size_beyond_the_machine_is_refused_with_the_reason(world_size, message):
    with pytest.raises(ValueError, match=message):
        Cluster(world_size)


@pytest.mark.slow  # a stress test: `make test` runs it, `make test-fast` does not
@pytest.mark.parametrize("free", [8, 14], ids=["in the first rank's handshake", "part way through the ranks"])
def test_running_out_of_file_descriptors_leaves_nothing_behind(python_script, free):
    """With `free` descriptors left, the start fails while handing the rank server a rank, which makes the server
    exit; the ranks already forked are killed, and the next start, with descriptors again, gets a new server."""
    script = python_script(f"""
        import os, resource, time, torch.distributed as dist
        from multiprocessing import forkserver
        from cs336_parallel import Cluster, procfs, rank_server
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            Cluster(32)
        except ValueError as e:
            print("refused:", e, flush=True)
        c = Cluster(4, timeout=30)
        rank_server.warm_up()
        hogs = []
        try:
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in hogs[-{free}:]:
            os.close(fd)
        try:
            c.start()
        except OSError as e:
            print("failed:", type(e).__name__, flush=True)
        server = forkserver._forkserver._forkserver_pid
        deadline = time.monotonic() + 10
        while procfs.children(server) and time.monotonic() < deadline:  # an exiting server lists its killed
            time.sleep(0.01)                                                # ranks until they are handed to init
        print("left:", c.status(), procfs.children(server), flush=True)
        for fd in hogs[:-{free}]:
            os.close(fd)
        print("then:", c.run(lambda: dist.get_rank()), flush=True)
    """)
    out, err = script.communicate(timeout=90)
    assert script.returncode == 0, err
    assert "refused: world_size=32 is more than this machine can hold" in out and "file descriptors" in out
    assert "failed: OSError" in out
    assert "left: [] []" in out
    assert "then: [0, 1, 2, 3]" in out


# -- clearer errors -------------------------------------------------------------------------------------------------
def test_a_mismatched_collective_is_reported_as_one():
    with Cluster(2, timeout=10) as c:
        def mismatch():
            x = torch.ones(1000 if dist.get_rank() == 0 else 10)
            dist.all_reduce(x)

        with pytest.raises(RankError) as info:
            c.run(mismatch)
        assert "stopped at a mismatched collective: it received" in info.value.headline
        assert "The ranks called collectives that do not match" in str(info.value)
        assert c.run(lambda: dist.get_rank()) == [0, 1]


def test_repeated_frames_are_collapsed(cluster):
    def recurse(n):
        return recurse(n + 1)

    with pytest.raises(RankError, match="RecursionError") as info:
        cluster.run(recurse, 0, ranks=[0])
    text = str(info.value)
    assert text.count("in recurse") == 3 and "[Previous frame repeated" in text
    assert len(text.splitlines()) < 30


def test_a_dead_ranks_last_stderr_lines_are_in_its_error(cluster):
    def die_on_rank_3():
        if dist.get_rank() == 3:
            print("something went very wrong", file=sys.stderr, flush=True)
            os._exit(7)
        return dist.get_rank()

    with pytest.raises(RankError, match=r"rank 3 died \(exit code 7\)") as info:
        cluster.run(die_on_rank_3)
    assert "[rank 3 stderr] something went very wrong" in info.value.details


# -- soak -----------------------------------------------------------------------------------------------------------
SOAK = """
import json, os, random, signal, sys, time
import torch, torch.distributed as dist
from multiprocessing import forkserver
from cs336_parallel import Cluster, RankError, RankTimeout, procfs

KERNEL, N = os.getpid(), 1000

def succeed(i):
    x = torch.tensor([float(i + dist.get_rank())])
    dist.all_reduce(x)
    return (i, dist.get_rank(), x.item(), os.getpid())

def fail(i):
    if dist.get_rank() == i % 4:
        raise ValueError(f"call {i} fails")
    return i

def kill(i):
    if dist.get_rank() == i % 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return i

def hang(i):
    while dist.get_rank() == i % 4:
        time.sleep(0.01)
    return i

def interrupt(i):
    if dist.get_rank() == 0:
        os.kill(KERNEL, signal.SIGINT)  # Ctrl-C, while the call runs
    time.sleep(60)

def dead(pid):
    return procfs.state(pid) in (None, "Z", "X")  # a zombie: its parent has yet to reap it

def usage():
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss

random.seed(0)
plan = ["succeed"] * N
for kind, n in (("fail", 100), ("kill", 20), ("hang", 15), ("interrupt", 15), ("idle_kill", 15)):
    for i in random.sample([i for i in range(50, N) if plan[i] == "succeed"], n):
        plan[i] = kind
expected = {"succeed": "ok", "fail": "error", "kill": "error", "hang": "timeout", "interrupt": "interrupt",
            "idle_kill": "error"}
functions = {"succeed": succeed, "fail": fail, "kill": kill, "hang": hang, "interrupt": interrupt, "idle_kill": succeed}
c = Cluster(4, timeout=30)
pids, wrong, usages = set(), [], {}
for i, kind in enumerate(plan):
    if i in (N // 10, N // 2, N - 1):
        usages[i] = usage()
    if kind == "idle_kill":  # a rank killed between calls (the OOM killer does this)
        victim = c.start().status()[i % 4]["pid"]
        os.kill(victim, signal.SIGKILL)
        while not dead(victim):
            time.sleep(0.001)
    try:
        result, outcome = c.call(functions[kind], (i,), timeout=0.5 if kind == "hang" else None), "ok"
    except RankTimeout as e:
        outcome, message = "timeout", e.headline
    except RankError as e:
        outcome, message = "error", e.headline
    except KeyboardInterrupt:
        outcome = "interrupt"
    if outcome != expected[kind]:
        wrong.append((i, kind, outcome))
    elif kind == "succeed":
        pids.update(r[3] for r in result)
        if [r[:3] for r in result] != [(i, rank, float(4 * i + 6)) for rank in range(4)]:
            wrong.append((i, kind, repr(result)))
    elif kind in ("fail", "kill", "idle_kill"):
        says = {"fail": f"rank {i % 4} raised ValueError: call {i} fails",
                "kill": f"rank {i % 4} was killed by signal SIGKILL",
                "idle_kill": f"rank {i % 4} was killed by signal SIGKILL while idle"}[kind]
        if not message.startswith(says):
            wrong.append((i, kind, message))
server = forkserver._forkserver._forkserver_pid
c.shutdown()
print(json.dumps({"wrong": wrong, "usages": usages, "pids": sorted(pids), "left": procfs.children(server)}))
"""


@pytest.mark.slow  # a stress test: `make test` runs it, `make test-fast` does not
def test_soak_a_thousand_calls_that_succeed_raise_die_hang_and_are_interrupted(python_script):
    script = python_script(SOAK)
    out, err = script.communicate(timeout=240)
    assert script.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["wrong"] == []
    (fds, threads, rss), *_, (fds_end, threads_end, rss_end) = [report["usages"][k] for k in sorted(
        report["usages"], key=int)]
    assert (fds_end, threads_end) == (fds, threads)
    assert rss_end - rss < 32 * 2**20
    assert report["left"] == [] and len(report["pids"]) > 4 * 50  # every restart made new ranks
    assert not [pid for pid in report["pids"] if pid_alive(pid)]
