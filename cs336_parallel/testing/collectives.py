"""Notebook 01's tests: the ring reduce-scatter, all-gather and all-reduce, the tree broadcast.

Every check draws each rank's data from the test's own seed, sends each rank only its own tensor, and compares
with the collective computed here from the same tensors. What the ranks exchanged is checked twice: as each rank
reports it (which calls, how many bytes, to whom: `probes`), and as measured outside the ranks (`checks`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cs336_parallel import checks, probes


def _inputs(world_size: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    g = checks.generator()
    return [checks.random_tensor(shape, dtype, generator=g) for _ in range(world_size)]


# -- reduce-scatter ---------------------------------------------------------------------------------------------

def reduce_scatter_driver(ring_reduce_scatter, inp: torch.Tensor) -> dict:
    """On a rank: reduce-scatter its input; what came out, the input afterwards, and the messages it sent."""
    out = torch.empty(inp.numel() // dist.get_world_size(), dtype=inp.dtype)
    with probes.count_collectives() as comm:
        ring_reduce_scatter(out, inp)
    return {"output": out, "input": inp, "comm": comm.record()}


def check_reduce_scatter(ring_reduce_scatter, world_size: int, chunk_numel: int, dtype: torch.dtype) -> list:
    """Compare with the reduce-scatter of the same inputs, computed here; return each rank's messages."""
    inputs = _inputs(world_size, (world_size * chunk_numel,), dtype)
    got = checks.run(world_size, reduce_scatter_driver, ring_reduce_scatter, per_rank=[(x,) for x in inputs])
    chunks = torch.stack(inputs).sum(0).reshape(world_size, chunk_numel)  # ground truth: rank r keeps chunk r
    for rank, result in enumerate(got):
        checks.assert_point_to_point(result["comm"], "ring_reduce_scatter", rank=rank)
        # Float32 sums in another order: rtol 1e-5, atol 1e-6; integers exactly.
        checks.assert_close(result["output"], chunks[rank], name=f"output ({dtype}, {chunk_numel} per chunk)",
                            rank=rank, rtol=1e-5, atol=1e-6)
        checks.assert_equal(result["input"], inputs[rank], name="input (it must not change)", rank=rank)
    # Rank r's chunk sums the other ranks' chunk r: at least one chunk's bytes must reach it.
    checks.assert_received(chunks[0].nbytes, f"reduce-scatter of {chunk_numel} {dtype} per chunk on "
                                                f"{world_size} ranks")
    return [result["comm"] for result in got]


def refused(exercise, output_numel: int, input_numel: int) -> dict:
    """On a rank: what `exercise(output, input)` did with tensors of these sizes (the test wants ValueError)."""
    return probes.outcome(exercise, torch.empty(output_numel), torch.empty(input_numel))


# -- all-gather ---------------------------------------------------------------------------------------------------

def all_gather_driver(ring_all_gather, inp: torch.Tensor) -> dict:
    """On a rank: all-gather its input; what came out, and the messages it sent."""
    out = torch.zeros(dist.get_world_size() * inp.numel(), dtype=inp.dtype)
    with probes.count_collectives() as comm:
        ring_all_gather(out, inp)
    return {"output": out, "comm": comm.record()}


def check_all_gather(ring_all_gather, world_size: int, numel: int, dtype: torch.dtype) -> list:
    """Compare bitwise with every rank's input, concatenated here; return each rank's messages."""
    inputs = _inputs(world_size, (numel,), dtype)
    got = checks.run(world_size, all_gather_driver, ring_all_gather, per_rank=[(x,) for x in inputs])
    expected = torch.cat(inputs)
    for rank, result in enumerate(got):
        checks.assert_point_to_point(result["comm"], "ring_all_gather", rank=rank)
        checks.assert_equal(result["output"], expected, name=f"output ({dtype}, {numel} per rank)", rank=rank)
    # Every rank must receive every other rank's input.
    checks.assert_received((world_size - 1) * inputs[0].nbytes, f"all-gather of {numel} {dtype} per rank on "
                                                                   f"{world_size} ranks")
    return [result["comm"] for result in got]


# -- all-reduce ---------------------------------------------------------------------------------------------------

def all_reduce_driver(ring_all_reduce, transposed: bool, x: torch.Tensor) -> dict:
    """On a rank: all-reduce its tensor in place (with `transposed`, a view whose memory is not in row order); the
    tensor afterwards, and the messages it sent."""
    if transposed:
        x = x.t()
    with probes.count_collectives() as comm:
        ring_all_reduce(x)
    return {"x": x, "comm": comm.record()}


def check_all_reduce(ring_all_reduce, world_size: int, shape: tuple, dtype: torch.dtype,
                     transposed: bool = False) -> list:
    """Compare with the sum of every rank's tensor, computed here; return each rank's messages."""
    inputs = _inputs(world_size, shape, dtype)
    got = checks.run(world_size, all_reduce_driver, ring_all_reduce, transposed, per_rank=[(x,) for x in inputs])
    expected = torch.stack(inputs).sum(0)
    expected = expected.t() if transposed else expected
    what = f"ring_all_reduce of a {'transposed ' if transposed else ''}{tuple(expected.shape)} {dtype} tensor"
    for rank, result in enumerate(got):
        checks.assert_point_to_point(result["comm"], "ring_all_reduce", rank=rank)
        # Float32 sums in another order: rtol 1e-5, atol 1e-6; integers exactly.
        checks.assert_close(result["x"], expected, name=what, rank=rank, rtol=1e-5, atol=1e-6)
    # Each rank learns the sum of the others' tensors: at least the tensor's bytes must reach it.
    checks.assert_received(inputs[0].nbytes, f"{what} on {world_size} ranks")
    return [result["comm"] for result in got]


# -- the ring's messages ----------------------------------------------------------------------------------------

def assert_ring(sent: list, steps: int, nbytes: float, element_size: int, what: str) -> None:
    """Each rank sent `steps` messages, `nbytes` in all (give or take an element per step), every one to the
    same neighbour: the right one on every rank (or the left one on every rank, a ring the other way round).
    The same bytes, pair by pair, must have crossed between the ranks as measured outside them."""
    n = len(sent)
    directions = set()
    for rank, record in enumerate(sent):
        sends = [(peer, size) for op, size, peer in record["calls"] if op == "send"]
        total = sum(size for _, size in sends)
        assert len(sends) == steps and abs(total - nbytes) <= steps * element_size, (
            f"{what}, {n} ranks: rank {rank} should send {steps} chunks, {nbytes:.0f} bytes in all; it sent "
            f"{len(sends)} messages, {total} bytes")
        directions |= {(peer - rank) % n for peer, _ in sends}
    assert len(directions) == 1 and directions <= {1, n - 1}, (
        f"{what}, {n} ranks: in a ring every rank sends to the same neighbour (right, or left); the ranks sent "
        f"{sorted(directions)} positions ahead")
    step = directions.pop()
    pairs = {(rank, (rank + step) % n): sum(size for op, size, _ in sent[rank]["calls"] if op == "send")
             for rank in range(n)}
    checks.assert_pairs(pairs, {pair: steps for pair in pairs}, f"{what}, {n} ranks",
                        spread=steps * element_size)


# -- broadcast ------------------------------------------------------------------------------------------------------

def broadcast_driver(tree_broadcast, src: int, x: torch.Tensor) -> dict:
    """On a rank: broadcast from rank `src` (only `src` holds the data that counts); the tensor afterwards, and
    this rank's messages."""
    with probes.count_collectives() as comm:
        tree_broadcast(x, src)
    return {"x": x, "comm": comm.record()}


def check_broadcast(tree_broadcast, world_size: int, src: int, numel: int, dtype: torch.dtype) -> list:
    """Compare bitwise with rank src's tensor; return each rank's sends and receives, in order: (op, peer)."""
    inputs = _inputs(world_size, (numel,), dtype)
    got = checks.run(world_size, broadcast_driver, tree_broadcast, src, per_rank=[(x,) for x in inputs])
    for rank, result in enumerate(got):
        checks.assert_point_to_point(result["comm"], "tree_broadcast", rank=rank)
        checks.assert_equal(result["x"], inputs[src], name=f"tensor after a broadcast from rank {src} ({dtype})",
                            rank=rank)
    needed = [0 if rank == src else inputs[src].nbytes for rank in range(world_size)]
    checks.assert_received(needed, f"broadcast of {numel} {dtype} from rank {src} on {world_size} ranks")
    return [[(op, peer) for op, _, peer in result["comm"]["calls"]] for result in got]


def refused_src(tree_broadcast, src: int) -> dict:
    """On a rank: what tree_broadcast(tensor, src) did with this src (the test wants ValueError)."""
    return probes.outcome(tree_broadcast, torch.zeros(1), src)


def assert_binomial_tree(events: list, src: int) -> None:
    """Every rank but src receives once; the last one has the data after ceil(log2 n) rounds (a rank's
    k-th send arrives k rounds after its data did)."""
    n = len(events)
    case = f"{n} ranks, src={src}"
    for rank, evs in enumerate(events):
        receives = [e for e in evs if e[0] == "recv"]
        assert len(receives) == (rank != src), f"{case}: rank {rank} receives {len(receives)} times"
    arrival, pending = {src: 0}, [src]
    while pending:
        sender = pending.pop()
        for k, peer in enumerate([peer for op, peer in events[sender] if op == "send"], start=1):
            assert peer not in arrival, f"{case}: rank {peer} is sent the data twice"
            arrival[peer] = arrival[sender] + k
            pending.append(peer)
    missing = sorted(set(range(n)) - set(arrival))
    assert not missing, f"{case}: ranks {missing} never receive the data"
    rounds, needed = max(arrival.values()), math.ceil(math.log2(n))
    assert rounds == needed, (
        f"{case}: the data reaches the last rank after {rounds} rounds, a binomial tree needs {needed}")
    checks.count_comparison()
