"""cs336_parallel: the helper package of the course on training language models across many devices.

`Cluster` starts N ranks from a Jupyter kernel (or any Python process) and runs functions on them;
`%load_ext cs336_parallel` adds the `%cluster` and `%%ranks` magics.
"""

from .cluster import Cluster, device, session_cluster
from .errors import RankError, RankTimeout

__all__ = ["Cluster", "RankError", "RankTimeout", "device", "load_ipython_extension", "session_cluster"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext cs336_parallel`: register `%cluster` and `%%ranks`."""
    from .magics import ClusterMagics

    ipython.register_magics(ClusterMagics)
