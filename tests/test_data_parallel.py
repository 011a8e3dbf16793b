"""Data parallelism's helpers: the trace recorder with marked spans, the DDP benchmark's timing loop, its pictures, the
training helpers that train a rank's share and one process, notebook 02's test code, and the master notebook's DDPs."""

from __future__ import annotations

import contextlib
import math
import time

import matplotlib
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs336_parallel import Cluster, checks, models, probes, trace
from cs336_parallel.bench import ddp as ddp_bench
from cs336_parallel.notebook import load_definitions
from cs336_parallel.testing import data_parallel, training

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, backend="gloo", timeout=60) as c:
        yield c


def record_async_and_sync() -> tuple[list[dict], float]:
    """The spans of an asynchronous all-reduce that completes while the thread sleeps, and is waited for after
    that, then of a broadcast; and how long the recorded block took."""
    x = torch.ones(2**20)
    for _ in range(2):  # the first time under a dispatch mode imports more of torch: keep the second
        dist.barrier()
        began = time.perf_counter()
        with trace.record(auto_compute=False) as tr:
            with tr.compute("launch"):
                work = dist.all_reduce(x, async_op=True)  # 4 MB: still running when the launch returns
            with tr.compute("sleep"):
                while not work.is_completed():  # the future's callbacks have run by then
                    time.sleep(0.001)
                time.sleep(0.05)
            work.wait()
            dist.broadcast(torch.ones(3), src=0)
        took = time.perf_counter() - began
        dist.all_reduce(torch.ones(1))  # outside the block: not recorded
    return tr.as_dicts(), took


def test_timeline_records_compute_spans_and_each_collective_from_launch_to_completion(cluster):
    for spans, took in cluster.run(record_async_and_sync):
        assert [(s["lane"], s["name"]) for s in spans] == [
            ("compute", "launch"), ("comm", "all_reduce"), ("compute", "sleep"), ("comm", "broadcast")]
        launch, all_reduce, sleep, broadcast = spans
        assert all(0 <= s["start_s"] <= s["end_s"] <= took for s in spans)  # seconds since the block began
        assert all_reduce["nbytes"] == 4 * 2**20 and broadcast["nbytes"] == 12
        assert launch["start_s"] <= all_reduce["start_s"] <= launch["end_s"]  # launched inside "launch"
        assert all_reduce["end_s"] <= sleep["end_s"]  # completion time, not the time of wait()
        assert broadcast["start_s"] >= sleep["end_s"]


def tiny_step_times() -> dict:
    makers = {"identity": lambda m: m,
              "ddp": lambda m: torch.nn.parallel.DistributedDataParallel(m)}
    return ddp_bench.step_times(makers, dim=16, depth=2, batch=4, iters=3, warmup=1)


def test_model_size_counts_the_parameters_of_mlpstack():
    assert ddp_bench.model_size(24, 3) == sum(p.numel() for p in models.MLPStack(24, 3).parameters())


def test_step_times_times_every_variant_and_the_bare_model(cluster):
    for times in cluster.run(tiny_step_times):
        assert set(times) == {"identity", "ddp", "compute"}
        assert all(math.isfinite(t) and t > 0 for t in times.values())


def ddp_with_sync(DDP, **options):
    """One step on different data per rank, ranks starting from different weights."""
    rank = dist.get_rank()
    ddp = DDP(models.MLPStack(8, depth=2, hidden=16, seed=rank), **options)
    with probes.count_collectives() as comm:
        ddp(checks.random_tensor((4, 8), seed=rank)).square().mean().backward()
        in_backward = comm.counts["all_reduce"]
        ddp.finish_gradient_synchronization()
    grads = torch.cat([p.grad.flatten() for p in ddp.module.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grads)
    return in_backward, all(torch.equal(g, grads) for g in everyone)


def test_the_master_solutions_launch_in_backward_and_leave_equal_gradients(cluster):
    ns = load_definitions(ddp_bench.MASTER, ["NaiveDDP", "DDPOverlap", "DDPBucketed"])
    assert cluster.run(ddp_with_sync, ns["NaiveDDP"]) == [(0, True)] * 2
    assert cluster.run(ddp_with_sync, ns["DDPOverlap"]) == [(8, True)] * 2
    assert cluster.run(ddp_with_sync, ns["DDPBucketed"], bucket_size_mb=1e-3) == [(2, True)] * 2


def small_mlp(seed: int = 0) -> torch.nn.Module:
    return models.MLPStack(8, depth=2, hidden=16, seed=seed)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


BATCHES = [(checks.random_tensor((8, 8), seed=s), checks.random_tensor((8, 8), seed=9 + s)) for s in range(3)]


def train_ddp(DDP, accumulate: int, set_to_none: bool = True, **options) -> dict:
    """A rank's share of BATCHES, in `accumulate` micro-batches (all but the last in no_sync), from weights of its
    own (rank 0's are small_mlp()'s); the state dict."""
    def step(ddp, optimizer, inputs, targets):
        optimizer.zero_grad(set_to_none=set_to_none)  # False: gradients accumulate into the buckets' views
        for i, (x, y) in enumerate(zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True)):
            with ddp.no_sync() if i < accumulate - 1 else contextlib.nullcontext():
                (F.mse_loss(ddp(x), y) / accumulate).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()

    rank, world_size = dist.get_rank(), dist.get_world_size()
    return training.train_on_rank(lambda m: DDP(m, **options), step, small_mlp, adamw, small_mlp(rank).state_dict(),
                                  training.rows_per_rank(BATCHES, world_size)[rank])


def test_train_on_rank_trains_like_one_process_with_a_right_ddp_and_a_wrong_one_differs(cluster):
    ns = load_definitions(ddp_bench.MASTER, ["NaiveDDP", "DDPOverlap", "DDPBucketed"])
    expected = checks.train_one_process(small_mlp, adamw, F.mse_loss, BATCHES)
    for set_to_none in (True, False):
        for rank, state in enumerate(cluster.run(train_ddp, ns["DDPBucketed"], 2, set_to_none, bucket_size_mb=1e-3)):
            checks.assert_state_close(state, expected, what="after 3 steps", rank=rank)
        for rank, state in enumerate(cluster.run(train_ddp, ns["DDPOverlap"], 4, set_to_none)):
            checks.assert_state_close(state, expected, what="after 3 steps", rank=rank)
    naive = cluster.run(train_ddp, ns["NaiveDDP"], 1)[1]  # no broadcast: rank 1 starts from its own weights
    with pytest.raises(AssertionError, match=r"rank 1: layers.0.fc1.weight after 3 steps differs"):
        checks.assert_state_close(naive, expected, what="after 3 steps", rank=1)


def test_pictures_have_labelled_axes():
    from cs336_parallel import viz

    span = {"lane": "compute", "name": "forward", "start_s": 0.0, "end_s": 0.01, "nbytes": 0}
    comm = {"lane": "comm", "name": "all_reduce", "start_s": 0.005, "end_s": 0.02, "nbytes": 64}
    late = {**comm, "start_s": 0.006, "end_s": 0.015}  # completes before the previous one: hidden under it
    fig = viz.ddp_timeline({"naive": [[span, comm, late]] * 2, "bucketed": [[span]] * 2}, title="t")
    assert fig.axes[-1].get_xlabel() == "time since the step began (ms)"
    assert "2 all-reduces" in fig.axes[0].get_title(loc="left")
    fig = viz.ddp_step_times([{"name": "naive", "step_s": 0.02, "compute_s": 0.01}])
    assert fig.axes[0].get_xlabel().startswith("time per step (ms")
    fig = viz.bucket_sweep([{"name": "bucketed", "bucket_mb": mb, "step_s": 0.01 * mb} for mb in (1, 4)],
                           compute_s=0.005)
    assert fig.axes[0].get_xlabel().startswith("bucket size (MB") and fig.axes[0].get_ylabel()
    assert math.isclose(fig.axes[0].get_lines()[0].get_ydata()[1], 40.0)
    fig = viz.bucket_sweep([{"name": "bucketed", "bucket_mb": 1.0, "step_s": 0.01}],
                           published={"ResNet-50": {1: -0.3, 16: -3.8}, "ResNet-101": {1: -1.2, 16: -4.0}})
    published = fig.axes[1]
    assert published.get_xlabel() == "GPUs" and published.get_ylabel() == "throughput change (%)"
    assert sorted(round(p.get_height(), 1) for p in published.patches) == [-4.0, -3.8, -1.2, -0.3]


def _buckets(sizes: list, cap: float, closes) -> list:
    buckets = []
    for nbytes in reversed(sizes):
        if not buckets or closes(buckets[-1], cap):
            buckets.append(0)
        buckets[-1] += nbytes
    return buckets


def test_02s_bucket_sizes_tell_each_misreading_of_the_rule_from_the_rule():
    """Notebook 02's buckets test: the bucket sizes its comments state, and for each misreading of "once a bucket
    holds at least bucket_size_mb megabytes (2^20 bytes)" a size where it makes other buckets."""
    sizes = data_parallel.parameter_bytes(data_parallel.funnel)
    assert sizes == [1024, 128, 1024, 32, 256]
    assert data_parallel.bucket_bytes(data_parallel.funnel, data_parallel.IN_BETWEEN) == [256, 1056, 1152]
    assert data_parallel.bucket_bytes(data_parallel.funnel, data_parallel.EXACTLY_FULL) == [1312, 1152]
    assert data_parallel.bucket_bytes(data_parallel.funnel, data_parallel.DECIMAL_MB) == [1440, 1024]
    at_least, above = (lambda size, cap: size >= cap), (lambda size, cap: size > cap)
    assert _buckets(sizes, data_parallel.EXACTLY_FULL * 2**20, above) != [1312, 1152]
    assert _buckets(sizes, data_parallel.DECIMAL_MB * 1e6, at_least) != [1440, 1024]
    in_order = list(reversed(_buckets(sizes[::-1], data_parallel.IN_BETWEEN * 2**20, at_least)))
    assert sorted(in_order) != sorted(data_parallel.bucket_bytes(data_parallel.funnel, data_parallel.IN_BETWEEN))


def recorded_step(accumulate: int) -> tuple:
    """One step of `accumulate` micro-batches through 02's RecordingDDP: its log, the gradient before and after
    finish_gradient_synchronization()."""
    ddp = data_parallel.RecordingDDP(torch.nn.Linear(4, 2))
    rows = torch.full((accumulate, 4), float(dist.get_rank() + 1))
    for i, row in enumerate(rows.split(1)):
        with ddp.no_sync() if i < accumulate - 1 else contextlib.nullcontext():
            ddp(row).sum().backward()
    before = ddp.module.weight.grad.clone()
    ddp.finish_gradient_synchronization()
    return ddp.log, before, ddp.module.weight.grad


def test_02s_recording_ddp_averages_once_per_step_and_only_in_finish(cluster):
    for rank, (log, before, after) in enumerate(cluster.run(recorded_step, 3)):
        assert log == ["backward in no_sync", "backward in no_sync", "backward", "finish"]
        assert torch.equal(before, torch.full((2, 4), 3.0 * (rank + 1)))  # this rank's own, until finish
        assert torch.equal(after, torch.full((2, 4), 3.0 * 1.5))  # the average of ranks 1 and 2's
