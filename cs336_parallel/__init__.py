"""cs336_parallel: the helper package of the course on training language models across many devices.

`Cluster` starts N ranks from a Jupyter kernel (or any Python process) and runs functions on them;
`%load_ext cs336_parallel` adds the `%cluster` and `%%ranks` magics.
"""

from .cluster import Cluster, device, session_cluster
from .errors import RankError, RankInterrupt, RankTimeout

__all__ = ["Cluster", "RankError", "RankInterrupt", "RankTimeout", "device", "load_ipython_extension",
           "session_cluster"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext cs336_parallel`: register `%cluster` and `%%ranks`, and name the exercise behind an
    unfilled `raise NotImplementedError()`."""
    from .magics import ClusterMagics, explain_unfilled_exercise

    ipython.register_magics(ClusterMagics)
    ipython.set_custom_exc((NotImplementedError,), explain_unfilled_exercise)
