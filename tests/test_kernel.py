"""The cluster from a real Jupyter kernel: magics, grouped output, errors, timeouts, interrupts, leftovers."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import time

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from common import PATIENCE_S, pid_alive, wait_gone, wait_until
from cs336_parallel import procfs, selfcheck

KERNEL = "python3"  # the kernel of this interpreter's environment


def run_notebook(cells: list[str]) -> list[dict]:
    """Execute cells in a fresh kernel as nbgrader would (errors allowed); return each cell's outputs."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name=KERNEL, allow_errors=True).execute()
    return [cell.outputs for cell in nb.cells]


def text(outputs: list[dict], stream: str = "stdout") -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == stream)


def error(outputs: list[dict]) -> dict:
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert errors, f"expected an error, got {outputs}"
    errors[0]["text"] = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"]))
    return errors[0]


@pytest.fixture(scope="module")
def notebook():
    return run_notebook([
        "%load_ext cs336_parallel",
        "%%ranks\nrank",  # 1: no cluster yet
        "%cluster start -n 4",
        "import math\ndef double(x):\n    return 2 * x",
        "%%ranks\nx = torch.ones(2) * double(rank)\ndist.all_reduce(x)\nprint('sum', x.tolist(), math.floor(2.5))\nx",
        "%%ranks\nx.sum()",  # 5: the namespace persists
        "%%ranks --ranks 0,2\nrank",
        "%%ranks\nimport sys, warnings\nwarnings.warn('careful')\nprint('to stderr', file=sys.stderr)",
        "%%ranks\nif rank == 1:\n    raise ValueError('bad shape on purpose')\ndist.barrier()",
        "%%ranks --timeout 2\nif rank == 0:\n    dist.barrier()",  # 9
        "%%ranks\nprint(world_size, device)",
        "%cluster status",
        "%cluster restart",
        "%%ranks\n'x' in dir()",  # 13: a restart resets the namespaces
        "%cluster shutdown",
        "def ring_all_reduce(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()",  # 15: a blank exercise
        "ring_all_reduce(1)",
        "import torch\ntorch.cuda.device_count = lambda: 1  # 17: as on a machine with one GPU",
        "%cluster start -n 4",
        "%cluster shutdown",
    ])


def test_ranks_needs_a_running_cluster(notebook):
    # IPython shows a UsageError on stderr, without failing the cell
    assert "No cluster is running: start one with `%cluster start -n 4`" in text(notebook[1], "stderr")


def test_cluster_start_reports_ranks_and_backend(notebook):
    assert re.match(r"Started 4 ranks \(gloo\) in \d+\.\d s\.", text(notebook[2]))


def test_ranks_cell_output_is_grouped_by_rank_with_the_last_value(notebook):
    lines = text(notebook[4]).splitlines()
    expected = []
    for r in range(4):
        expected += [f"[rank {r}] sum [12.0, 12.0] 2", f"[rank {r}] tensor([12., 12.])"]
    assert lines == expected  # the notebook's own function and module went to the ranks


def test_each_rank_keeps_its_namespace_between_cells(notebook):
    assert text(notebook[5]).splitlines() == [f"[rank {r}] tensor(24.)" for r in range(4)]


def test_a_cell_can_run_on_some_ranks(notebook):
    assert text(notebook[6]).splitlines() == ["[rank 0] 0", "[rank 2] 2"]


def test_worker_stderr_is_shown_as_rank_tagged_stdout(notebook):
    lines = text(notebook[7]).splitlines()
    assert "[rank 3 stderr] UserWarning: careful (Cell In[8]:3)" in lines
    assert "[rank 0 stderr] to stderr" in lines
    assert all(text(outputs, "stderr") == "" for outputs in notebook[2:])  # nbgrader zeroes a cell with stderr


def test_a_rank_error_shows_the_ranks_traceback_with_cell_lines(notebook):
    err = error(notebook[8])
    assert err["ename"] == "RankError"
    assert "rank 1 raised ValueError: bad shape on purpose" in err["text"]
    assert 'File "Cell In[9]", line 3, in <module>' in err["text"]
    assert "raise ValueError('bad shape on purpose')" in err["text"]
    assert "worker.py" not in err["text"] and "cluster.py" not in err["text"]


def test_a_hang_times_out_showing_where_each_rank_waits(notebook):
    err = error(notebook[9])
    assert err["ename"] == "RankTimeout"
    assert "rank 0 did not finish within 2 s" in err["text"] and "dist.barrier()" in err["text"]
    assert text(notebook[10]).splitlines() == [f"[rank {r}] 4 cpu" for r in range(4)]  # restarted, works


def test_status_restart_and_shutdown(notebook):
    assert len(re.findall(r"rank \d: pid \d+, cpu, alive", text(notebook[11]))) == 4
    assert re.match(r"Restarted 4 ranks in", text(notebook[12]))
    assert text(notebook[13]).splitlines() == [f"[rank {r}] False" for r in range(4)]
    assert text(notebook[14]) == "Stopped 4 ranks.\n"


def test_an_unfilled_exercise_called_in_the_kernel_is_named(notebook):
    err = error(notebook[16])
    assert err["ename"] == "NotImplementedError"  # still an error: nbgrader scores the cell 0
    assert "Hint: `ring_all_reduce` is an exercise still to be filled in" in err["text"]


def test_one_gpu_and_four_ranks_say_in_one_line_why_the_ranks_run_on_the_cpu(notebook):
    lines = text(notebook[18]).splitlines()
    assert lines[0] == "4 ranks on CPU (gloo): this machine has 1 GPU; NCCL needs one GPU per rank"
    assert re.match(r"Started 4 ranks \(gloo\) in", lines[1]) and len(lines) == 2


class Kernel:
    """A kernel driven message by message, for interrupts and process checks."""

    def __init__(self):
        self.km, self.kc = start_new_kernel(kernel_name=KERNEL, stderr=subprocess.DEVNULL)

    def execute(self, code: str, timeout: float = PATIENCE_S) -> tuple[str, dict]:
        out = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        return "".join(out), reply["content"]

    def wait_for_output(self, *lines: str, timeout: float = PATIENCE_S) -> str:
        """Read the output of the cell running now (started with `kc.execute`) until it has shown each of `lines`
        (in any order); return what was read. Fails if the cell ends first, or after `timeout` seconds."""
        seen = ""
        deadline = time.monotonic() + timeout
        while not all(line in seen.splitlines() for line in lines):
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout:g} s for the cell to show {lines}; it showed {seen!r}")
            with contextlib.suppress(queue.Empty):
                msg = self.kc.get_iopub_msg(timeout=0.5)
                if msg["msg_type"] == "stream":
                    seen += msg["content"]["text"]
                elif msg["msg_type"] == "error" or msg["content"].get("execution_state") == "idle":
                    raise AssertionError(f"the cell ended before it showed {lines}: {msg['content']}, after {seen!r}")
        return seen

    def start_cluster(self, n: int) -> list[int]:
        """Start `n` ranks; return their pids and the forkserver's."""
        out, _ = self.execute(f"%load_ext cs336_parallel\n%cluster start -n {n}\n")
        out, _ = self.execute("%%ranks\nimport os\nprint(os.getpid(), os.getppid())")
        pairs = [line.split("] ")[1].split() for line in out.splitlines()]
        return [int(p) for p, _ in pairs] + [int(pairs[0][1])]

    def close(self):
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.close()


def test_interrupt_stops_every_rank_and_the_kernel_stays_usable(kernel):
    pids = kernel.start_cluster(2)[:2]
    # stop_on_error=False: ipykernel aborts a request that reaches it before it has finished with an error
    # (ipython/ipykernel#609), and the next cell here is sent the moment the error's reply arrives.
    kernel.kc.execute("%%ranks --timeout 600\nprint('stuck', rank, flush=True)\nif rank == 0:\n    dist.barrier()\n"
                      "while True:\n    pass", stop_on_error=False)
    kernel.wait_for_output("[rank 0] stuck 0", "[rank 1] stuck 1")  # the cell runs on the ranks: they are stuck
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=PATIENCE_S)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "RankInterrupt"
    assert "stopped ranks 0, 1 and restarted the cluster" in "".join(reply["content"]["traceback"])
    assert wait_gone(pids) == []
    out, content = kernel.execute("%%ranks\nrank")
    assert content["status"] == "ok" and out.splitlines() == ["[rank 0] 0", "[rank 1] 1"]


def test_ranks_output_streams_into_the_cell_while_it_runs(kernel, tmp_path):
    """A learner watching a long cell sees its progress, not everything at the end."""
    flag = tmp_path / "go"
    kernel.start_cluster(2)
    kernel.kc.execute(f"%%ranks --timeout {2 * PATIENCE_S:g}\nimport os, time\nprint('waiting', rank, flush=True)\n"
                      f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\nprint('released', rank)")
    try:
        kernel.wait_for_output("[rank 0] waiting 0", "[rank 1] waiting 1")  # fails if they come only at the end
    finally:
        flag.touch()
    reply = kernel.kc.get_shell_msg(timeout=PATIENCE_S)
    assert reply["content"]["status"] == "ok"


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    found = {}
    for child in procfs.children(pid):
        with contextlib.suppress(OSError):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[child] = f.read().replace(b"\0", b" ").decode()
    return found


def test_loading_the_extension_starts_the_rank_server_that_later_forks_the_ranks(kernel):
    """The server imports torch while the kernel does, so `%cluster start` only forks."""
    kernel.execute("%load_ext cs336_parallel")
    servers = wait_until(lambda: [pid for pid, cmd in children(kernel.km.provisioner.process.pid).items()
                                  if "forkserver" in cmd], "the rank server to start")  # maybe in the background
    assert len(servers) == 1
    assert kernel.start_cluster(2)[-1] == servers[0]


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_no_process_outlives_the_kernel(kernel, how):
    pids = kernel.start_cluster(2)
    assert all(pid_alive(p) for p in pids)
    if how == "shutdown":
        kernel.km.shutdown_kernel()
    elif how == "restart":
        kernel.km.restart_kernel()
    else:
        os.kill(kernel.km.provisioner.process.pid, signal.SIGKILL)
    assert wait_gone(pids) == []


def test_a_test_cell_runs_its_checks_in_the_notebook_and_refuses_to_while_graded():
    """The learner's loop: `%%test` runs the visible checks here (the exercise across the same boundary as in
    grading), fails with one line, and refuses to run at all in a kernel that nbgrader's executor is grading."""
    outputs = run_notebook([
        "%load_ext cs336_parallel",
        "def double(x):\n    return 2 * x",
        "%%test double\nfrom cs336_parallel import probes\nassert double(3) == 6, 'double(3) should be 6'\n"
        "got = checks.run(2, probes.outcome, double, per_rank=[(1,), (2,)])  # each rank its own argument\n"
        "assert [r['returned'] for r in got] == [2, 4], 'on two ranks'\nprint('ok')",
        "def double(x):\n    return x + 2",
        "%%test double\nassert double(3) == 6, 'double(3) should be 6'",
        "import os\nos.environ['NBGRADER_EXECUTION'] = 'autograde'",
        "%%test double\nprint('never')",
    ])
    assert text(outputs[2]) == "ok\n", outputs[2]
    assert error(outputs[4])["text"].splitlines()[0] == "TestFailed: double(3) should be 6"
    assert "tests run in the grader's own process" in error(outputs[6])["text"] and not text(outputs[6])


def test_the_courses_kernel_answers_with_torch_imported_and_the_rank_server_ready(tmp_path):
    """What a learner's first cell would wait for is done before the kernel answers, and torch is imported once:
    the server is a fork of the kernel (its command line is the kernel's), not a new Python, forked once the kernel
    had what both need (torch._dynamo: an optimizer's step imports it). A file in the notebook's folder named like
    a module the kernel imports before its own start (ipykernel.py) shadows nothing."""
    (tmp_path / "ipykernel.py").write_text("raise SystemExit('the folder shadowed ipykernel')")
    out = []
    km, kc = start_new_kernel(kernel_name=selfcheck.KERNEL, cwd=str(tmp_path), stderr=subprocess.DEVNULL,
                              startup_timeout=selfcheck.KERNEL_START_TIMEOUT_S)
    try:
        reply = kc.execute_interactive(
            "import sys\nfrom multiprocessing import forkserver\nfrom cs336_parallel import procfs\n"
            "server = forkserver._forkserver._forkserver_pid\n"
            "print('torch' in sys.modules, sys.modules['torch'].__file__.endswith('torch/__init__.py'), "
            "procfs.state(server) not in (None, 'Z'), 'torch._dynamo' in sys.modules, "
            "open(f'/proc/{server}/cmdline').read() == open('/proc/self/cmdline').read())", timeout=PATIENCE_S,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "".join(out) == "True True True True True\n"
