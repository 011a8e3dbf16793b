"""How fast ranks start and answer: the cluster against torch.multiprocessing.spawn, in one run.

Targets (2 CPU cores): cold start at most 0.25x spawn's; warm `run` under 5 ms; warm `%%ranks`
cell under 20 ms.
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
def rank_main(rank, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    x = torch.ones(1); dist.all_reduce(x); assert x.item() == n
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    t0 = time.perf_counter()
    mp.spawn(rank_main, args=({n}, port), nprocs={n})
    print(json.dumps(time.perf_counter() - t0))
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


def _kernel_cell_ms(code: str, repeats: int = 30) -> float:
    """Median time of a cell in a real Jupyter kernel: execute request to idle."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", stderr=subprocess.DEVNULL)
    try:
        kc.execute_interactive(f"%load_ext cs336_parallel\n%cluster start -n {WORLD_SIZE}", timeout=120,
                               output_hook=lambda msg: None)
        times = []
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            reply = kc.execute_interactive(code, timeout=30, output_hook=lambda msg: None)
            times.append(time.perf_counter() - t0)
            assert reply["content"]["status"] == "ok", reply["content"]
        return statistics.median(times[3:]) * 1e3
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main(args=None) -> None:
    from cs336_parallel import Cluster

    print(f"Starting {WORLD_SIZE} ranks on gloo, to the first all-reduce result "
          "(fresh interpreters, torch imported):")
    cold = statistics.median(_fresh_process_seconds(_COLD_CLUSTER.format(n=WORLD_SIZE)) for _ in range(3))
    spawn = statistics.median(_fresh_process_seconds(_COLD_SPAWN.format(n=WORLD_SIZE)) for _ in range(3))
    print(f"  Cluster (forkserver)            {cold:7.2f} s")
    print(f"  torch.multiprocessing.spawn     {spawn:7.2f} s")
    ratio = cold / spawn
    print(f"  ratio                           {ratio:7.2f}x   (target <= 0.25x: {_verdict(ratio <= 0.25)})")

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
    try:
        cell_ms = _kernel_cell_ms("%%ranks\npass")
        empty_ms = _kernel_cell_ms("pass")
    except ImportError:
        print("  %%ranks cell: jupyter_client is not installed (pip install -e '.[course]')")
        return
    print(f"  %%ranks cell in a Jupyter kernel {cell_ms:6.2f} ms  (target < 20 ms: {_verdict(cell_ms < 20)}); "
          f"an empty ordinary cell takes {empty_ms:.2f} ms")


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    main()
