"""Pictures for the notebooks, one module per topic; every function returns a matplotlib Figure.

matplotlib is imported here only, never by the package's core.
"""

from .collectives import (  # noqa: F401
    COLLECTIVES,
    RANK_COLORS,
    bandwidth_plot,
    binomial_tree,
    collectives_gallery,
    hierarchy_chart,
    ring_reduce_scatter_steps,
)
