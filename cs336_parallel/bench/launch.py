"""How fast ranks start and answer: the cluster against torch.multiprocessing.spawn, in one run.

Cold start is timed to the first all-reduce result in the parent, for spawn as for the cluster.
Targets (2 CPU cores): a cluster started in a notebook, and a fresh kernel's first cell to the first per-rank
output, each at most 0.25x spawn's time; warm `run` under 5 ms; warm `%%ranks` cell under 20 ms. The kernel is
the course's (`cs336_parallel.kernel`), which imports torch and starts the rank server before it answers, while
the learner reads the notebook: its start is printed on its own line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLD_SIZE = 4

_COLD_CLUSTER = """
import json, time, torch, torch.distributed as dist
from cs336_parallel import Cluster
def first_all_reduce():
    x = torch.ones(1); dist.all_reduce(x); return x.item()
t0 = time.perf_counter()
c = Cluster({n})
assert c.run(first_all_reduce) == [{n}.0] * {n}
print(json.dumps(time.perf_counter() - t0))
c.shutdown()
"""

_COLD_SPAWN = """
import json, os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank_main(rank, n, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    x = torch.ones(1); dist.all_reduce(x)
    if rank == 0:
        results.put(x.item())
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    results = mp.get_context("spawn").SimpleQueue()
    t0 = time.perf_counter()
    context = mp.spawn(rank_main, args=({n}, port, results), nprocs={n}, join=False)
    assert results.get() == {n}.0
    print(json.dumps(time.perf_counter() - t0))  # the result is here; shutting down is not counted
    context.join()
"""


def _fresh_process_seconds(source: str) -> float:
    """Run `source` as a script in a new interpreter (no forkserver yet; torch imported before timing)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "bench_launch.py")  # spawn re-imports the script: it must be a file
        script.write_text(source)
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"benchmark script failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Kernel:
    """A fresh kernel of the course (`cs336_parallel.kernel`, as `make` registers it; else the environment's
    python3) that times its start (`ready_s`) and the cells it runs (execute request to idle)."""

    def __enter__(self) -> _Kernel:
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import start_new_kernel

        from cs336_parallel import selfcheck

        self.name = selfcheck.KERNEL if selfcheck.KERNEL in KernelSpecManager().find_kernel_specs() else "python3"
        t0 = time.perf_counter()
        self.manager, self.client = start_new_kernel(kernel_name=self.name, stderr=subprocess.DEVNULL,
                                                     startup_timeout=selfcheck.KERNEL_START_TIMEOUT_S)
        self.ready_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc_info) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def seconds(self, code: str) -> float:
        t0 = time.perf_counter()
        reply = self.client.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]
        return time.perf_counter() - t0

    def median_ms(self, code: str, repeats: int = 30) -> float:
        times = [self.seconds(code) for _ in range(repeats + 3)]
        return statistics.median(times[3:]) * 1e3


_FIRST_ALL_REDUCE = "%%ranks\nx = torch.ones(1)\ndist.all_reduce(x)\nx.item()"


def main(args=None) -> None:
    from cs336_parallel import Cluster

    print(f"Starting {WORLD_SIZE} ranks on gloo, to the first all-reduce result in the parent "
          "(medians of 3, fresh processes, torch imported):")
    spawn = statistics.median(_fresh_process_seconds(_COLD_SPAWN.format(n=WORLD_SIZE)) for _ in range(3))
    script = statistics.median(_fresh_process_seconds(_COLD_CLUSTER.format(n=WORLD_SIZE)) for _ in range(3))
    first_cells, starts, readies = [], [], []
    for _ in range(3):
        with _Kernel() as kernel:
            readies.append(kernel.ready_s)
            first_cells.append(kernel.seconds("%load_ext cs336_parallel\nimport torch"))  # how every notebook begins
            starts.append(kernel.seconds(f"%cluster start -n {WORLD_SIZE}") + kernel.seconds(_FIRST_ALL_REDUCE))
    first_cell, start = statistics.median(first_cells), statistics.median(starts)
    waited = statistics.median(a + b for a, b in zip(first_cells, starts, strict=True))
    print(f"  torch.multiprocessing.spawn                     {spawn:6.2f} s")
    print(f"  Cluster in a script (its server imports torch)  {script:6.2f} s  {script / spawn:5.2f}x")
    print(f"  {'the kernel ' + kernel.name + ', started to ready':47} {statistics.median(readies):6.2f} s  (while "
          "the learner reads; not counted below)")
    print(f"  a notebook's first cell (%load_ext, torch)      {first_cell:6.2f} s")
    print(f"  %cluster start in a notebook, after that cell   {start:6.2f} s  {start / spawn:5.2f}x"
          f"  (target <= 0.25x: {_verdict(start <= 0.25 * spawn)})")
    print(f"  both: a fresh kernel's first cell to the first per-rank output"
          f"  {waited:6.2f} s  {waited / spawn:5.2f}x  (target <= 0.25x: {_verdict(waited <= 0.25 * spawn)})")

    with Cluster(WORLD_SIZE) as cluster:
        cluster.run(lambda: None)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            cluster.run(lambda: None)
            times.append(time.perf_counter() - t0)
    run_ms = statistics.median(times) * 1e3
    print("Warm round trips (median):")
    print(f"  Cluster.run of a no-op          {run_ms:7.2f} ms  (target < 5 ms: {_verdict(run_ms < 5)})")
    with _Kernel() as kernel:
        kernel.seconds(f"%load_ext cs336_parallel\n%cluster start -n {WORLD_SIZE}")
        cell_ms = kernel.median_ms("%%ranks\npass")
        empty_ms = kernel.median_ms("pass")
    print(f"  %%ranks cell in a Jupyter kernel {cell_ms:6.2f} ms  (target < 20 ms: {_verdict(cell_ms < 20)}); "
          f"an empty ordinary cell takes {empty_ms:.2f} ms")


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
