"""The grader's own test ranks (grading/rank_box.py, cs336_parallel.rank_host): each rank gets its own share of a
test's data and nothing else; who sent how much to whom is measured outside them; a reply is read within bounds;
no rank reads another's memory; and the process that relays every rank's data runs none of the ranks' code.

The "exercises" here are this module's functions, pickled by value as a notebook's are; the driver is the
package's `probes.outcome`, which calls the exercise with the rank's own arguments."""

from __future__ import annotations

import os
import pickle
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from cs336_parallel import plain, probes, protocol, rank_server, selfcheck
from cs336_parallel.boundary import Exercise, rank_requests
from grading import gradebook, runner, sandbox
from grading.rank_box import BoxStopped, RankBox, ReplyTooLarge

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # travels as a notebook's functions do
SANDBOX = sandbox.unavailable() is None


def echo(mine):
    return {"rank": dist.get_rank(), "mine": mine, "double": 2 * mine}


def send_to_next(nbytes: int):
    """Rank r sends `nbytes` to rank r+1, around the ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out, into = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
    ops = [dist.P2POp(dist.isend, out, (rank + 1) % n), dist.P2POp(dist.irecv, into, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def reach_other_processes():
    """The command lines of the other processes whose memory this rank can open."""
    opened = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/mem", "rb"):
                    opened.append(open(f"/proc/{entry}/cmdline").read().replace("\0", " "))
            except OSError:
                pass
    return opened


def large(nbytes: int):
    return torch.zeros(nbytes // 4)


@pytest.fixture(scope="module", params=[pytest.param(True, marks=[pytest.mark.sandbox, pytest.mark.skipif(
    not SANDBOX, reason="needs bubblewrap (make sandbox)")]), False], ids=["sandboxed", "plain"])
def box(request, tmp_path_factory):
    """A box that serves the module's tests one after another, as a notebook's tests share one (a test that stops it
    leaves the next request a new one)."""
    rb = RankBox(tmp_path_factory.mktemp("box"), use_sandbox=request.param)
    yield rb
    rb.close()


def run(box: RankBox, exercise, per_rank: list[tuple], *, max_bytes: int = 10**7):
    """`exercise(*per_rank[r])` on each rank r of a group of len(per_rank); (what each returned, the traffic)."""
    requests = [plain.encode(r) for r in rank_requests(probes.outcome, (Exercise("f", None, "function"),), {},
                                                       per_rank)]
    reply, traffic, _ = box.run(len(per_rank), protocol.dumps({"f": exercise}), {}, requests, 30, max_bytes)
    assert "ok" in reply, reply
    return [plain.decode(r)["returned"] for r in reply["ok"]], traffic


def test_each_rank_receives_its_own_share_only(box):
    shares = [(torch.full((3,), float(r)),) for r in range(3)]
    got, _ = run(box, echo, shares)
    for rank, result in enumerate(got):
        assert result["rank"] == rank and torch.equal(result["mine"], shares[rank][0])
        assert torch.equal(result["double"], 2 * shares[rank][0])


def test_traffic_is_measured_outside_pair_by_pair(box):
    _, traffic = run(box, send_to_next, [(4000,)] * 4)
    assert traffic is not None
    for sender in range(4):
        receiver = (sender + 1) % 4
        assert 4000 <= traffic[sender][receiver] < 4400, traffic  # gloo adds a header to each message
        others = [traffic[sender][s] for s in range(4) if s not in (sender, receiver)]
        assert all(b < 200 for b in others), traffic  # acknowledgements only


@pytest.mark.sandbox
@pytest.mark.skipif(not SANDBOX, reason="needs bubblewrap (make sandbox)")
def test_no_rank_can_read_another_ranks_memory_or_the_relays(tmp_path):
    """Not the other ranks, nor the rank host (which holds every rank's data for a moment), nor the server the
    ranks are forked from; only the sandbox's init (bwrap) and multiprocessing's resource tracker are left, and they
    hold nothing."""
    box = RankBox(tmp_path, use_sandbox=True)
    try:
        got, _ = run(box, reach_other_processes, [()] * 2)
    finally:
        box.close()
    for readable in got:
        assert not [c for c in readable if not c.startswith(sandbox.bwrap()) and "resource_tracker" not in c], readable


def test_a_reply_larger_than_what_is_left_is_refused_before_it_is_read(box):
    with pytest.raises(ReplyTooLarge, match="passed what is left"):
        run(box, large, [(8 * 2**20,)] * 2, max_bytes=2**20)
    got, _ = run(box, echo, [(1,), (2,)])  # a new box serves the next request
    assert [r["double"] for r in got] == [2, 4]


def kill_the_relay():
    """On a rank: kill the rank host above it (its own only: not a box started after it, nor another test's)."""
    import signal

    from cs336_parallel import procfs

    pid = os.getppid()
    while pid > 1:
        if "cs336_parallel.rank_host" in open(f"/proc/{pid}/cmdline").read():
            os.kill(pid, signal.SIGKILL)
            return
        pid = int(procfs.stat_fields(pid)[1])


def test_a_box_that_dies_during_a_request_is_named_and_replaced(box):
    with pytest.raises(BoxStopped, match="stopped"):
        run(box, kill_the_relay, [()] * 2)
    got, _ = run(box, echo, [(1,), (2,)])
    assert [r["double"] for r in got] == [2, 4]
    box.process.kill()  # between requests: the next one starts a new box
    box.process.wait()
    got, _ = run(box, echo, [(1,), (2,)])
    assert [r["double"] for r in got] == [2, 4]


def pid_of_rank():
    return os.getpid()


def test_the_box_starts_on_the_first_run_not_when_asked_for_fresh_ranks(tmp_path):
    """A notebook whose tests never reach the ranks (a blank one: each test stops at the kernel) starts no box;
    once one runs, fresh ranks are new processes."""
    box = RankBox(tmp_path, use_sandbox=False)
    try:
        box.fresh(("f", 1), 30)
        box.restart(30)
        assert box.process is None
        first, _ = run(box, pid_of_rank, [()] * 2)
        box.fresh(("f", 2), 30)
        second, _ = run(box, pid_of_rank, [()] * 2)
        box.restart(30)
        third, _ = run(box, pid_of_rank, [()] * 2)
    finally:
        box.close()
    assert not set(first) & set(second) and not set(second) & set(third), (first, second, third)


def has_dynamo():
    return "torch._dynamo" in sys.modules


def step_an_optimizer():
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    torch.optim.SGD([weight], lr=0.5).step()
    return weight.detach()


def test_ranks_said_to_step_no_optimizer_start_without_what_one_needs_and_can_still_step_one(tmp_path):
    """The grader tells the rank servers of 00 and 01 that their ranks step no optimizer, so the servers leave out
    torch._dynamo (an optimizer's first step imports it: 1 CPU-s); a rank that steps one anyway imports it itself."""
    master = gradebook.COURSE / "source" / "{0}" / "{0}.ipynb"
    settings = runner.rank_settings(Path(str(master).format("01_collectives")))
    assert settings == {rank_server.NO_OPTIMIZER: "1"} and runner.rank_settings(
        Path(str(master).format("02_data_parallel"))) == {}
    boxes = {"light": RankBox(tmp_path / "light", use_sandbox=False, settings=settings),
             "full": RankBox(tmp_path / "full", use_sandbox=False)}
    try:
        assert run(boxes["light"], has_dynamo, [()] * 2)[0] == [False, False]
        assert run(boxes["full"], has_dynamo, [()] * 2)[0] == [True, True]
        stepped, _ = run(boxes["light"], step_an_optimizer, [()] * 2)
    finally:
        for box in boxes.values():
            box.close()
    assert all(torch.equal(w, torch.full((2,), 0.5)) for w in stepped), stepped
    kernel = sandbox.SandboxedKernelManager(box=str(tmp_path / "kernel"), kernel_name=selfcheck.KERNEL,
                                            settings=settings)
    assert rank_server.NO_OPTIMIZER in kernel.format_kernel_cmd()  # set in the kernel's sandbox too


def objects_tracked():
    import gc

    return len(gc.get_objects())


def test_a_rank_walks_only_its_own_objects_not_the_servers(box):
    """The server freezes what it imported (cs336_parallel.in_rank_server): a rank's garbage collections and the tests'
    searches through gc.get_objects() skip those 280,000 objects (0.14 CPU-s each time)."""
    counts, _ = run(box, objects_tracked, [()] * 2)
    assert all(n < 50_000 for n in counts), counts


def test_the_relay_never_loads_torch(tmp_path):
    """It relays bytes, so it starts without torch (about 2 CPU-seconds less per notebook graded), and tensors
    crossing through it leave it so."""
    box = RankBox(tmp_path, use_sandbox=False)
    try:
        got, _ = run(box, echo, [(torch.ones(2),), (torch.zeros(2),)])
        command = Path(f"/proc/{box.process.pid}/cmdline").read_text()
        maps = Path(f"/proc/{box.process.pid}/maps").read_text()
    finally:
        box.close()
    assert torch.equal(got[0]["double"], torch.full((2,), 2.0)) and "cs336_parallel.rank_host" in command
    assert "libtorch" not in maps


def test_the_relay_reads_what_ranks_send_without_running_it(monkeypatch):
    class Payload:
        def __reduce__(self):
            return (exec, ("import sys; sys.exit('ran')",))

    message = protocol.HEADER.pack(1) + pickle.dumps(("ok", Payload(), True))
    monkeypatch.setattr(protocol, "only_plain", True)
    with pytest.raises(pickle.UnpicklingError, match="does not read"):
        protocol.loads(message)
    failure = protocol.Failure("ValueError", "ValueError: no", [protocol.Frame("f.py", 1, "g")])
    assert protocol.loads(protocol.encode(1, ("error", failure, True)))[1] == failure


def test_two_notebooks_boxes_serve_at_once(tmp_path):
    """Each notebook has its own box; two answer at the same time (a --jobs 2 class)."""
    boxes = [RankBox(tmp_path / str(i), use_sandbox=False) for i in range(2)]
    results = {}

    def work(i):
        results[i] = run(boxes[i], echo, [(i,), (i + 1,)])[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        for b in boxes:
            b.close()
    assert [r["double"] for r in results[0]] == [0, 2] and [r["double"] for r in results[1]] == [2, 4]
