"""Timing done right: warm-up, synchronization, many iterations, the median; and collective bandwidth
in the nccl-tests conventions (algbw = S / t; busbw = algbw x a factor that makes it comparable with
the link's bandwidth, as nccl-tests' doc/PERFORMANCE.md defines it: `BUSBW_FACTOR`).

`python -m cs336_parallel.bench TOPIC` runs a topic's side-by-side benchmark (`--help` lists them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# busbw / algbw for each collective on n ranks (nccl-tests, doc/PERFORMANCE.md).
BUSBW_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work; a no-op on the CPU."""
    if torch.cuda.is_available() and torch.device(device or "cpu").type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], *, warmup: int = 2, iters: int = 10, device=None) -> list[float]:
    """Seconds per call of `fn`, `iters` times after `warmup` untimed calls, synchronized each time."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def median_s(fn: Callable[[], object], **kwargs) -> float:
    """The median of `time_it`: robust to the odd slow iteration on a shared machine."""
    return statistics.median(time_it(fn, **kwargs))


def progress(iterable, **kwargs):
    """A progress bar over `iterable`: tqdm's widget in Jupyter, its text bar in a terminal (or no bar
    where tqdm is not installed: the core needs only torch)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kwargs)


def algbw_gbps(size_bytes: int, time_s: float) -> float:
    return size_bytes / time_s / 1e9


def busbw_gbps(op: str, size_bytes: int, time_s: float, world_size: int) -> float:
    return algbw_gbps(size_bytes, time_s) * BUSBW_FACTOR[op](world_size)
