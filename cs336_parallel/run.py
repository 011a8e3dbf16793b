"""Run a notebook's (or a script's) function on every rank under torchrun, PyTorch's real launcher.

    python -m cs336_parallel.run --nproc-per-node 4 train.py:main
    python -m cs336_parallel.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 notebooks/02_data_parallel.ipynb:train

Options before the target go to torchrun unchanged. Each rank joins the default process group
(NCCL with one GPU per local rank when there are enough GPUs, gloo otherwise), calls the function,
and prints its result tagged with the rank, as the notebook's cluster does.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from .notebook import load_definitions


def load_target(target: str) -> Callable:
    """`path.py:function` or `path.ipynb:function` -> the function."""
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"target must look like path.py:function or path.ipynb:function, got {target!r}")
    if not os.path.exists(path):
        raise ValueError(f"target file {path!r} does not exist")
    namespace = load_definitions(path, [name]) if path.endswith(".ipynb") else runpy.run_path(path)
    if name not in namespace:
        raise ValueError(f"{path} defines no {name!r}")
    return namespace[name]


def _worker(target: str) -> None:
    """One rank under torchrun: join the group, call the function, print its result."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_nccl:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_nccl else "gloo")
    try:
        result = load_target(target)()
        if result is not None:  # one write per line: ranks share the terminal
            sys.stdout.write(f"[rank {dist.get_rank()}] {result!r}\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    # The work is done and reported. Leave without the interpreter's shutdown, where gloo's threads can still
    # abort the process ("terminate called without an active exception", about one exit in ten on 2 cores),
    # which torchrun would report as a failed worker.
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1])
    if not argv or argv[-1].startswith("-"):
        sys.exit(__doc__)
    *torchrun_args, target = argv
    load_target(target)  # fail here, once, rather than on every rank
    if not any(a.startswith(("--rdzv", "--standalone", "--master")) for a in torchrun_args):
        torchrun_args.append("--standalone")  # one machine: torchrun picks a free port
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, set here so it needs no warning
    # Restarted workers (--max-restarts) must not join the process group through the rendezvous store,
    # which still holds the dead workers' addresses: they can hang in gloo's connectFullMesh.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.run import main as torchrun

    torchrun([*torchrun_args, "-m", "cs336_parallel.run", "--worker", target])


if __name__ == "__main__":
    main()
