"""Data-parallel training steps: naive, overlapped and bucketed DDP against torch's DistributedDataParallel.

The three implementations come from a notebook's answer cells (default: the master solution of
02_data_parallel); every variant trains its own copy of the same model on the same inputs, timed in one
loop so that all of them see the same machine load.
Targets (2 CPU ranks, a model of at least 10M parameters): bucketed DDP within 1.15x of torch's step
time; overlapped and bucketed faster than naive.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cs336_parallel import bench, session_cluster
from cs336_parallel.devices import device
from cs336_parallel.models import MLPStack
from cs336_parallel.notebook import load_definitions

MASTER = Path(__file__).resolve().parents[2] / "grading/source/02_data_parallel/02_data_parallel.ipynb"
WORLD_SIZE = 2
# Model sizes, and a bucket size of about a tenth of the gradients (torch's default, 25 MB, is that for
# a model of 60M parameters; with 2 buckets per step there is little to overlap).
CPU_SETUP = {"dim": 512, "depth": 5, "batch": 32, "bucket_mb": 4.0}  # 10.5M parameters, 40 MB of gradients
GPU_SETUP = {"dim": 2048, "depth": 8, "batch": 1024, "bucket_mb": 25.0}  # 268M parameters, 1 GB of gradients
SWEEP_MB = [1.0, 4.0, 16.0, 64.0]
ITERS = 30


def model_size(dim: int, depth: int) -> int:
    """Parameters of MLPStack(dim, depth): per layer fc1 (dim -> 4 dim) and fc2 (4 dim -> dim), with biases."""
    return depth * (8 * dim * dim + 5 * dim)


def step_times(makers: dict[str, Callable[[nn.Module], nn.Module]], *, dim: int, depth: int, batch: int,
               iters: int = ITERS, warmup: int = 3) -> dict[str, float]:
    """On every rank: the median seconds of a training step (zero_grad, forward, backward, gradient
    synchronization) for each wrapper, each around its own copy of `MLPStack(dim, depth)`; under
    "compute", the same step of the bare model (no communication). The variants take turns, one step
    each, after a barrier, so that every one sees the same machine load."""
    dev = device()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dist.get_rank())
        x = torch.randn(batch, dim, device=dev)  # each rank its own slice of the data
    models = {name: make(MLPStack(dim, depth, seed=0).to(dev)) for name, make in makers.items()}
    models["compute"] = MLPStack(dim, depth, seed=0).to(dev)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(warmup + iters):
        for name, model in models.items():
            dist.barrier()
            bench.synchronize(dev)
            t0 = time.perf_counter()
            model.zero_grad()
            model(x).square().mean().backward()
            finish = getattr(model, "finish_gradient_synchronization", None)
            if finish is not None:  # torch's DDP has finished when backward returns
                finish()
            bench.synchronize(dev)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def makers(ns: dict, bucket_mb: float) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """The four implementations, from a notebook's namespace `ns`, with the same bucket size."""
    return {"naive": ns["NaiveDDP"], "overlapped": ns["DDPOverlap"],
            "bucketed": lambda m: ns["DDPBucketed"](m, bucket_mb),
            "torch DDP": lambda m: DistributedDataParallel(m, bucket_cap_mb=bucket_mb)}


def sweep_makers(ns: dict, sizes_mb: list[float]) -> dict[str, Callable[[nn.Module], nn.Module]]:
    out: dict[str, Callable[[nn.Module], nn.Module]] = {}
    for mb in sizes_mb:
        out[f"bucketed {mb:g} MB"] = lambda m, mb=mb: ns["DDPBucketed"](m, mb)
        out[f"torch DDP {mb:g} MB"] = lambda m, mb=mb: DistributedDataParallel(m, bucket_cap_mb=mb)
    return out


def main(args=None) -> None:
    notebook = Path(getattr(args, "notebook", None) or MASTER)
    ns = load_definitions(notebook, ["NaiveDDP", "DDPOverlap", "DDPBucketed"])
    cluster = session_cluster(WORLD_SIZE)
    setup = dict(GPU_SETUP if cluster.backend == "nccl" else CPU_SETUP)
    bucket_mb = setup.pop("bucket_mb")
    params = model_size(setup["dim"], setup["depth"])
    print(f"{WORLD_SIZE} ranks ({cluster.backend}), MLPStack(dim={setup['dim']}, depth={setup['depth']}): "
          f"{params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MB of gradients; batch {setup['batch']} "
          f"per rank; buckets of {bucket_mb:g} MB; implementations from {notebook.name}; median of {ITERS} steps")
    times = cluster.run(step_times, makers(ns, bucket_mb), **setup)[0]
    compute = times.pop("compute")
    print(f"\n{'variant':<12}{'step (ms)':>11}{'comm share':>12}{'vs torch DDP':>14}{'vs naive':>10}")
    for name, t in times.items():
        print(f"{name:<12}{t * 1e3:>11.1f}{max(0.0, t - compute) / t:>12.0%}{t / times['torch DDP']:>13.2f}x"
              f"{t / times['naive']:>9.2f}x")
    print(f"{'compute':<12}{compute * 1e3:>11.1f}   (forward + backward of the bare model, no communication)")

    print(f"\nbucket-size sweep ({', '.join(f'{mb:g}' for mb in SWEEP_MB)} MB), step time in ms:")
    sweep = cluster.run(step_times, sweep_makers(ns, SWEEP_MB), **setup, iters=ITERS // 2)[0]
    print(f"{'bucket MB':>10}{'bucketed':>10}{'torch DDP':>11}{'ratio':>8}")
    for mb in SWEEP_MB:
        ours, theirs = sweep[f"bucketed {mb:g} MB"], sweep[f"torch DDP {mb:g} MB"]
        print(f"{mb:>10g}{ours * 1e3:>10.1f}{theirs * 1e3:>11.1f}{ours / theirs:>7.2f}x")

    ratio = times["bucketed"] / times["torch DDP"]
    faster = times["overlapped"] < times["naive"] and times["bucketed"] < times["naive"]
    print(f"\nbucketed ({bucket_mb:g} MB) / torch DDP = {ratio:.2f}x (target <= 1.15x: "
          f"{'met' if ratio <= 1.15 else 'MISSED'}); overlapped {times['overlapped'] / times['naive']:.2f}x and "
          f"bucketed {times['bucketed'] / times['naive']:.2f}x of naive (target < 1: {'met' if faster else 'MISSED'})")
