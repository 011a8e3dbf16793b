"""FSDP from a notebook (default: the master solution of 03_zero_fsdp, with prefetching) against PyTorch's
FSDP2 `fully_shard`, on the same model and inputs, side by side on 2 CPU ranks (gloo).

Both shard every nn.Linear of an MLPStack (FSDP2: `fully_shard` on each Linear, then on the root) and
train it with AdamW. Printed per implementation: the median step time (forward, backward, optimizer
step; the two alternate step by step so both see the same machine load) and the peak tensor memory of a
step per rank (`cs336_parallel.memory`, above what the rank held before the model existed), then the
ratios. Targets: memory within 1.2x of FSDP2's, step time within 1.5x. FSDP2 runs on the CPU over a
device mesh of type "cpu" with gloo; the one difference from a GPU run is that it has no separate
stream on which to overlap its all-gathers with compute.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cs336_parallel import bench, models, session_cluster
from cs336_parallel.devices import device
from cs336_parallel.memory import track
from cs336_parallel.notebook import load_definitions

MASTER = Path(__file__).resolve().parents[2] / "grading/source/03_zero_fsdp/03_zero_fsdp.ipynb"
DIM, DEPTH, BATCH = 512, 8, 64  # 16.8M parameters: 67 MB of float32 weights, 8 x 2 units of 4 MB
ITERS, WARMUP = 10, 2
MEMORY_TARGET, TIME_TARGET = 1.2, 1.5


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _build(kind: str, fsdp_cls) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = models.MLPStack(DIM, DEPTH, seed=0).to(device())
    model = fsdp_cls(model, prefetch=True) if kind == "yours" else _fsdp2(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def compare(fsdp_cls) -> dict:
    """On this rank: peak step memory of each implementation (built one after the other), then median
    step times with the two alternating; and the largest difference between their parameters."""
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(dist.get_rank())).to(device())
    result = {}
    for kind in ("yours", "fsdp2"):
        gc.collect()
        with track() as mem:
            model, optimizer = _build(kind, fsdp_cls)
            _step(model, optimizer, x)  # creates the optimizer state
            mem.reset_peak()
            _step(model, optimizer, x)
        result[kind] = {"peak_bytes": mem.peak_bytes - mem.start_bytes}
        del model, optimizer
    built = {kind: _build(kind, fsdp_cls) for kind in ("yours", "fsdp2")}
    times: dict[str, list[float]] = {kind: [] for kind in built}
    for i in range(WARMUP + ITERS):
        for kind, (model, optimizer) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, optimizer, x)
            bench.synchronize(x.device)
            if i >= WARMUP:
                times[kind].append(time.perf_counter() - t0)
    for kind in built:
        result[kind]["step_s"] = statistics.median(times[kind])
    yours, theirs = built["yours"][0].gather_full_params(), built["fsdp2"][0].named_parameters()
    result["max_diff"] = max((yours[name] - p.full_tensor()).abs().max().item() for name, p in theirs)
    return result


def main(args=None) -> None:
    notebook = Path(getattr(args, "notebook", None) or MASTER)
    fsdp_cls = load_definitions(notebook, ["FSDP"])["FSDP"]
    params = sum(p.numel() for p in models.MLPStack(DIM, DEPTH).parameters())
    print(f"MLPStack({DIM}, {DEPTH}): {params / 1e6:.1f}M parameters, batch {BATCH}, AdamW, 2 CPU ranks (gloo); "
          f"every Linear is a unit")
    results = session_cluster(2, backend="gloo").run(compare, fsdp_cls)
    print(f"{'':40}{'step (ms)':>10}{'peak memory per rank (MB)':>28}")
    names = {"yours": f"FSDP(prefetch=True) from {notebook.stem}", "fsdp2": "FSDP2 fully_shard"}
    for kind, name in names.items():
        step_ms = max(r[kind]["step_s"] for r in results) * 1e3
        peak_mb = max(r[kind]["peak_bytes"] for r in results) / 1e6
        print(f"{name:<40}{step_ms:>10.1f}{peak_mb:>28.2f}")
    memory_ratio = max(r["yours"]["peak_bytes"] for r in results) / max(r["fsdp2"]["peak_bytes"] for r in results)
    time_ratio = max(r["yours"]["step_s"] for r in results) / max(r["fsdp2"]["step_s"] for r in results)
    print(f"\nyours / FSDP2: memory {memory_ratio:.2f}x (target <= {MEMORY_TARGET}x: "
          f"{'met' if memory_ratio <= MEMORY_TARGET else 'MISSED'}), step time {time_ratio:.2f}x "
          f"(target <= {TIME_TARGET}x: {'met' if time_ratio <= TIME_TARGET else 'MISSED'})")
    print(f"largest difference between the two models' parameters after {WARMUP + ITERS + 1} steps: "
          f"{max(r['max_diff'] for r in results):.1e}")
