"""The cluster from plain Python: results, output, failures, hangs, interrupts, leftovers, arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from common import ROOT, Lines, pid_alive, wait_gone, wait_until
from cs336_parallel import Cluster, RankError, RankTimeout, procfs


@pytest.fixture(scope="module")
def cluster():
    with Cluster(4, timeout=10) as c:
        yield c


def pids(cluster: Cluster) -> list[int]:
    return [s["pid"] for s in cluster.status()]


def test_run_returns_one_result_per_rank_in_rank_order(cluster):
    offset = 10  # captured by the closure, shipped with cloudpickle

    def contribute(scale, *, shift):
        x = torch.tensor([float(dist.get_rank() + offset)])
        dist.all_reduce(x)
        return (dist.get_rank(), dist.get_world_size(), x.item() * scale + shift)

    expected_sum = sum(r + offset for r in range(4))
    assert cluster.run(contribute, 2.0, shift=1) == [(r, 4, expected_sum * 2 + 1) for r in range(4)]


def test_run_on_some_ranks(cluster):
    assert cluster.run(lambda: dist.get_rank(), ranks=[3, 1]) == [1, 3]


def test_output_grouped_by_rank_in_rank_order_and_nothing_on_stderr(cluster, capfd):
    def chatty():
        rank = dist.get_rank()
        time.sleep(0.05 * (3 - rank))  # rank 3 prints first
        print(f"hello from {rank}")
        print(f"second line {rank}")
        print(f"warning {rank}", file=sys.stderr)

    cluster.run(chatty)
    out, err = capfd.readouterr()
    expected = []
    for r in range(4):
        expected += [f"[rank {r}] hello from {r}", f"[rank {r}] second line {r}", f"[rank {r} stderr] warning {r}"]
    assert out.splitlines() == expected
    assert err == ""


def test_output_does_not_leak_into_the_next_call(cluster, capfd):
    cluster.run(print, "first call")
    capfd.readouterr()
    cluster.run(lambda: None)
    assert capfd.readouterr().out == ""


def test_results_come_back_as_detached_cpu_tensors(cluster):
    def make():
        w = torch.ones(3, requires_grad=True)
        return w * 2  # not a leaf: cannot be pickled as is

    results = cluster.run(make, ranks=[0])
    assert results[0].grad_fn is None and torch.equal(results[0], torch.full((3,), 2.0))


def test_a_rank_that_raises_is_reported_without_waiting_for_the_others_and_the_next_call_works(cluster):
    def fail_on_rank_1():
        if dist.get_rank() == 1:
            raise ValueError("bad shape on purpose")
        dist.barrier()  # the others wait for rank 1 forever

    with pytest.raises(RankError) as info:
        cluster.run(fail_on_rank_1)
    err = info.value
    assert not isinstance(err, RankTimeout)  # reported as it happened, not when the others' barrier timed out
    assert err.rank == 1
    text = str(err)
    assert "rank 1 raised ValueError: bad shape on purpose" in text
    assert 'raise ValueError("bad shape on purpose")' in text  # the rank's own source line
    assert "in fail_on_rank_1" in text and "barrier" in text  # where the others were waiting
    assert "worker.py" not in text  # no launcher internals
    assert cluster.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_when_every_rank_raises_the_group_is_kept(cluster):
    before = pids(cluster)
    with pytest.raises(RankError, match="NameError"):
        cluster.run(lambda: undefined_name)  # noqa: F821
    assert cluster.run(lambda: os.getpid()) == before


def test_a_rank_that_exits_is_named_with_its_exit_code(cluster):
    def exit_on_rank_2():
        if dist.get_rank() == 2:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankError, match=r"rank 2 died \(exit code 3\)") as info:
        cluster.run(exit_on_rank_2)
    assert info.value.rank == 2 and not isinstance(info.value, RankTimeout)
    assert cluster.run(lambda: dist.get_rank()) == [0, 1, 2, 3]


def test_a_killed_rank_is_named_with_its_signal(cluster):
    def kill_rank_0():
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    with pytest.raises(RankError, match="rank 0 was killed by signal SIGKILL"):
        cluster.run(kill_rank_0)
    assert cluster.run(lambda: 1) == [1, 1, 1, 1]


def test_a_hang_times_out_showing_where_each_rank_waits():
    def spin_forever():
        while True:
            pass

    def mismatched():
        if dist.get_rank() == 0:
            dist.barrier()
        else:
            spin_forever()

    with Cluster(2, timeout=2) as c:
        with pytest.raises(RankTimeout) as info:
            c.run(mismatched)
        err = info.value
        assert err.ranks == [0, 1]
        assert [f.name for f in err.stacks[0]][-1] == "barrier"
        assert [f.name for f in err.stacks[1]][-1] == "spin_forever"
        assert "did not finish within 2 s" in str(err) and "dist.barrier()" in str(err)
        assert c.run(lambda: dist.get_rank()) == [0, 1]


def test_status_reports_pid_device_and_liveness(cluster):
    status = cluster.status()
    assert [s["rank"] for s in status] == [0, 1, 2, 3]
    assert all(s["alive"] and s["device"] == "cpu" and pid_alive(s["pid"]) for s in status)
    assert cluster.run(lambda: os.getpid()) == [s["pid"] for s in status]


def test_restart_replaces_every_rank(cluster):
    before = pids(cluster)
    cluster.restart()
    assert not set(before) & set(pids(cluster))
    assert wait_gone(before) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"world_size": 2.5}, "world_size must be an integer >= 1"),
    ({"world_size": 2, "backend": "mpi"}, "backend must be one of"),
    ({"world_size": torch.cuda.device_count() + 1, "backend": "nccl"}, "needs one GPU per rank"),
    ({"world_size": 2, "timeout": 0}, "timeout must be a positive number"),
])
def test_bad_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Cluster(**kwargs)


def test_bad_ranks_raise_value_error(cluster):
    with pytest.raises(ValueError, match="ranks must be"):
        cluster.run(print, ranks=[4])


def test_a_result_that_cannot_be_pickled_is_a_clear_error(cluster):
    with pytest.raises(RankError, match="cannot be sent to the kernel"):
        cluster.run(threading.Lock, ranks=[0])


def test_an_unfilled_exercise_is_named():
    def ring_all_reduce(x):
        # YOUR CODE HERE
        raise NotImplementedError()

    with Cluster(2) as c, pytest.raises(RankError) as info:
        c.run(ring_all_reduce, torch.ones(1))
    assert "`ring_all_reduce` is an exercise still to be filled in" in str(info.value)


def test_shutdown_leaves_no_process():
    with Cluster(2) as c:
        started = pids(c)
    assert wait_gone(started) == []


def busy_markers(folder) -> str:
    """Source for a script: `busy(name)`, which a rank calls to say that it runs the call `name`: it creates the
    file `folder`/<name>-<rank>. Once every rank has, the script's `c.run` is waiting for their replies."""
    return f"""
        import os as _os
        def busy(name):
            import torch.distributed as dist
            open(_os.path.join({str(folder)!r}, f"{{name}}-{{dist.get_rank()}}"), "w").close()
    """


def wait_busy(folder, name: str, ranks: int, script) -> None:
    """Until every rank has said (busy_markers) that it runs the call named `name`, and the script's main thread
    is asleep in the wait for their replies."""
    wait_until(lambda: all((folder / f"{name}-{r}").exists() for r in range(ranks)) or script.poll() is not None,
               f"{ranks} ranks to run {name}")
    assert script.poll() is None, script.stderr.read()
    wait_until(lambda: procfs.state(script.pid) in ("S", None), "the script to wait for its ranks")


def test_interrupt_stops_every_rank_and_the_next_call_works(python_script, tmp_path):
    script = python_script(busy_markers(tmp_path) + """
        import os, time, torch.distributed as dist
        from cs336_parallel import Cluster
        def stuck():
            busy("stuck")
            if dist.get_rank() == 0:
                dist.barrier()
            while True:
                time.sleep(0.01)
        c = Cluster(2, timeout=None)
        print("pids", *c.run(os.getpid), flush=True)
        try:
            c.run(stuck)
        except KeyboardInterrupt as e:
            print("interrupted", e, flush=True)
        input()  # the test checks that the old ranks are gone, then lets the script go on
        print("next", c.run(lambda: dist.get_rank()), flush=True)
    """, stdin=subprocess.PIPE)
    lines = Lines(script.stdout, script.stderr)
    old = [int(p) for p in lines.wait_for("pids").split()[1:]]
    wait_busy(tmp_path, "stuck", 2, script)
    script.send_signal(signal.SIGINT)
    out = lines.wait_for("interrupted")
    assert wait_gone(old) == []
    script.stdin.write("\n")
    script.stdin.close()
    rest = lines.rest()
    assert script.wait(timeout=60) == 0 and "next [0, 1]" in rest, script.stderr.read()
    assert "stopped ranks 0, 1 and restarted the cluster" in out and "dist.barrier()" in rest


def test_an_interrupt_the_os_hands_to_another_thread_still_stops_the_call(python_script, tmp_path):
    """Linux may deliver a process's Ctrl-C to any of its threads (the store's, ZMQ's in a kernel)."""
    script = python_script(busy_markers(tmp_path) + f"""
        import os, signal, threading, time
        from cs336_parallel import Cluster
        c = Cluster(2, timeout=None)
        c.run(int)
        def sleep_busy():
            busy("sleep")
            time.sleep(3600)
        def interrupt_from_here():  # once both ranks run the call: the main thread waits for them
            while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"sleep-{{r}}")) for r in range(2)):
                time.sleep(0.01)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        threading.Thread(target=interrupt_from_here, daemon=True).start()
        try:
            c.run(sleep_busy)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    out, err = script.communicate(timeout=120)
    assert script.returncode == 0 and "interrupted" in out, err


@pytest.mark.parametrize("ranks_are", ["idle", "busy"])
def test_no_rank_outlives_a_killed_parent(python_script, tmp_path, ranks_are):
    script = python_script(busy_markers(tmp_path) + f"""
        import os, time
        from cs336_parallel import Cluster
        c = Cluster(3, timeout=None)
        print("pids", *c.run(lambda: (os.getpid(), os.getppid()))[0], *c.run(os.getpid), flush=True)
        def sleep_busy():
            busy("sleep")
            time.sleep(600)
        c.run(sleep_busy) if "{ranks_are}" == "busy" else time.sleep(600)
    """)
    forkserver, *ranks = [int(p) for p in Lines(script.stdout, script.stderr).wait_for("pids").split()[2:]]
    assert len(ranks) == 3 and all(pid_alive(p) for p in ranks + [forkserver])
    if ranks_are == "busy":
        wait_busy(tmp_path, "sleep", 3, script)
    script.kill()  # SIGKILL: no atexit, no cleanup code runs
    script.wait()
    assert wait_gone(ranks + [forkserver]) == []


def test_a_script_is_not_rerun_in_the_ranks(python_script):
    script = python_script("""
        print("top level ran")
        from cs336_parallel import Cluster
        with Cluster(2) as c:
            c.run(lambda: None)
    """)
    out, err = script.communicate(timeout=60)
    assert out.count("top level ran") == 1, (out, err)


@pytest.mark.slow  # a stress test: `make test` runs it, `make test-fast` does not
def test_ten_clusters_started_at_once_all_come_up(python_script):
    source = """
        import torch, torch.distributed as dist
        from cs336_parallel import Cluster
        def total():
            x = torch.ones(1); dist.all_reduce(x); return x.item()
        with Cluster(2, timeout=120) as c:
            print("result", c.run(total))
    """
    scripts = [python_script(source) for _ in range(10)]
    for s in scripts:
        out, err = s.communicate(timeout=240)
        assert "result [2.0, 2.0]" in out, err


def test_run_launches_a_function_under_torchrun():
    done = subprocess.run([sys.executable, "-m", "cs336_parallel.run", "--nproc-per-node", "2",
                           "tests/fixtures/train.py:total"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] 3.0" in done.stdout and "[rank 1] 3.0" in done.stdout


def test_core_modules_import_with_torch_and_cloudpickle_alone():
    blocked = "import sys\nfor m in ('matplotlib', 'ipywidgets', 'IPython', 'tqdm'): sys.modules[m] = None\n"
    imports = "import cs336_parallel, cs336_parallel.cluster, cs336_parallel.checks, cs336_parallel.bench"
    done = subprocess.run([sys.executable, "-c", blocked + imports], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_session_clusters_are_shared_by_size_and_backend():
    from cs336_parallel import session_cluster
    from cs336_parallel.testranks import kernel_ranks

    cpu = session_cluster(2, backend="gloo")
    assert session_cluster(2, backend="gloo") is cpu
    if torch.cuda.device_count() < 2:  # "auto" means gloo here: the notebook's cluster serves the tests too
        assert session_cluster(2) is cpu
    assert kernel_ranks.ranks(2).run(dist.get_backend) == ["gloo", "gloo"]  # the tests' own ranks: always gloo
    cpu.shutdown()


def test_a_multi_line_message_keeps_its_first_line_in_the_headline(cluster):
    def explain():
        raise ValueError("shard_range(10, 0, 0) should raise ValueError\nbecause world_size must be >= 1")

    with pytest.raises(RankError) as info:
        cluster.run(explain, ranks=[0])
    assert info.value.headline == "rank 0 raised ValueError: shard_range(10, 0, 0) should raise ValueError"
    assert "because world_size must be >= 1" in str(info.value)
