"""Collective bandwidth in the nccl-tests conventions, and a ring all-reduce against the library's.

The ring comes from a notebook's answer cells (default: the master solution of 01_collectives).
Target (2 CPU ranks, 16 MB): the ring reaches at least 0.8x the library all-reduce's bandwidth.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_parallel import bench, session_cluster
from cs336_parallel.devices import device
from cs336_parallel.notebook import load_definitions

MASTER = Path(__file__).resolve().parents[2] / "grading/source/01_collectives/01_collectives.ipynb"
SIZES = [2**k for k in range(10, 25, 2)]  # 1 KB .. 16 MB
WORLD_SIZES = [2, 4]
RING_SIZE = 16 * 2**20


def collectives(whole: torch.Tensor, piece: torch.Tensor) -> dict:
    """The three collectives on a buffer `whole` of S bytes and this rank's `piece` of it."""
    return {"all_reduce": lambda: dist.all_reduce(whole),
            "reduce_scatter": lambda: dist.reduce_scatter_single(piece, whole),
            "all_gather": lambda: dist.all_gather_single(whole, piece)}


def time_collectives(sizes: list[int]) -> list[dict]:
    """Median time per call of all-reduce, reduce-scatter and all-gather (rank 0's clock)."""
    n, dev = dist.get_world_size(), device()
    rows = []
    for size in sizes:
        whole, piece = torch.ones(size // 4, device=dev), torch.empty(size // 4 // n, device=dev)
        for op, call in collectives(whole, piece).items():
            rows.append({"op": op, "world_size": n, "size_bytes": size,
                         "time_s": bench.median_s(call, warmup=3, iters=10, device=dev)})
    return rows


def ring_against_library(ring_all_reduce, size: int, iters: int = 30) -> dict:
    """Alternate the two calls so that both see the same machine load; medians in seconds."""
    x = torch.ones(size // 4, device=device())
    calls = {"ring": lambda: ring_all_reduce(x), "library": lambda: dist.all_reduce(x)}
    times = {name: [] for name in calls}
    for i in range(iters + 3):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            bench.synchronize(x.device)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(args=None) -> None:
    notebook = Path(getattr(args, "notebook", None) or MASTER)
    ring_all_reduce = load_definitions(notebook, ["ring_all_reduce"])["ring_all_reduce"]
    print(f"{'op':<15}{'n':>3}{'size':>11}{'time (ms)':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for n in WORLD_SIZES:
        for r in session_cluster(n).run(time_collectives, SIZES)[0]:
            algbw = bench.algbw_gbps(r["size_bytes"], r["time_s"])
            busbw = bench.busbw_gbps(r["op"], r["size_bytes"], r["time_s"], n)
            print(f"{r['op']:<15}{n:>3}{r['size_bytes']:>11}{r['time_s'] * 1e3:>11.3f}{algbw:>12.3f}{busbw:>12.3f}")
    times = session_cluster(2).run(ring_against_library, ring_all_reduce, RING_SIZE)[0]
    ratio = times["library"] / times["ring"]  # bandwidth ratio = inverse time ratio
    print(f"\nring_all_reduce from {notebook.name} vs dist.all_reduce, 2 ranks, {RING_SIZE >> 20} MB: "
          f"{times['ring'] * 1e3:.2f} ms vs {times['library'] * 1e3:.2f} ms; "
          f"ring bandwidth = {ratio:.2f}x the library's (target >= 0.8x: {'met' if ratio >= 0.8 else 'MISSED'})")
