"""The kernel's own clusters for tests: CPU ranks (gloo) apart from the notebook's, one per world size.

A test's `checks.run` arrives here as a request (cs336_parallel.boundary): the driver runs on these ranks, so a
grade depends neither on the machine's GPUs nor on what the notebook's cells did to its own ranks. Before each
test cell the ranks are replaced if they ran the tests of another exercise (or of another definition of this one):
no test sees what an earlier one left on a rank.
"""

from __future__ import annotations

from collections.abc import Callable

from .cluster import Cluster

_clusters: dict[int, Cluster] = {}  # by world size
_tested: object = None  # what the ranks last ran the tests of


def test_ranks(world_size: int) -> Cluster:
    """The test cluster of `world_size` ranks, started and joined."""
    if world_size not in _clusters:
        _clusters[world_size] = Cluster(world_size, backend="gloo")
    return _clusters[world_size].start()


def run_on_test_ranks(world_size: int, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
    """`fn(*args, **kwargs)` on every rank of the test cluster of that size; one result per rank."""
    return test_ranks(world_size).call(fn, args, kwargs, timeout=timeout)


def fresh_ranks(tested: object = None) -> None:
    """Replace the ranks of every test cluster that has run something, unless they ran the tests of `tested`
    (an exercise and its definition)."""
    global _tested
    if tested is None or tested != _tested:
        for cluster in _clusters.values():
            if cluster.has_run:
                cluster.replace_ranks()
    _tested = tested
