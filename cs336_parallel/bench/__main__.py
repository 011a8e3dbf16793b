"""python -m cs336_parallel.bench TOPIC [--notebook PATH]: a side-by-side benchmark, ratios printed."""

from __future__ import annotations

import argparse
import importlib

TOPICS = {
    "launch": "starting ranks: cold start vs torch.multiprocessing.spawn, warm round trips",
    "collectives": "algbw/busbw of the collectives; a ring all-reduce against the library's",
    "fsdp": "FSDP with prefetching against FSDP2 fully_shard on 2 CPU ranks: step time and peak memory per rank",
    "pipeline": "1F1B on 4 CPU ranks: measured bubble fraction against the simulator's",
    "ddp": "step time of naive, overlapped and bucketed DDP against torch's DistributedDataParallel; bucket sweep",
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m cs336_parallel.bench", description=__doc__)
    parser.add_argument("topic", choices=sorted(TOPICS), help="; ".join(f"{k}: {v}" for k, v in TOPICS.items()))
    parser.add_argument("--notebook", default=None,
                        help="load the exercise implementations from this notebook (default: the master solution)")
    args = parser.parse_args()
    importlib.import_module(f"cs336_parallel.bench.{args.topic}").main(args)


if __name__ == "__main__":
    main()
