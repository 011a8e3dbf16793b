"""cs336_parallel: the helper package of the course on training language models across many devices.

`Cluster` starts N ranks from a Jupyter kernel (or any Python process) and runs functions on them;
`%load_ext cs336_parallel` adds the `%cluster` and `%%ranks` magics.
"""

import importlib

# Names are imported on first use, so `%load_ext` can start the rank server before torch is imported.
_EXPORTS = {"Cluster": "cluster", "device": "devices", "session_cluster": "cluster",
            "RankError": "errors", "RankInterrupt": "errors", "RankTimeout": "errors"}

__all__ = [*_EXPORTS, "load_ipython_extension"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """`%load_ext cs336_parallel`: register `%cluster`, `%%ranks` and `%%test`, and name the exercise behind an
    unfilled `raise NotImplementedError()` (the first line of every notebook)."""
    from .rank_server import warm_up
    from .versions import check_torch

    check_torch()  # one clear line about versions now, rather than an AttributeError inside an exercise
    warm_up()  # the server imports torch on another core while this kernel does below
    from .magics import ClusterMagics, explain_unfilled_exercise

    ipython.register_magics(ClusterMagics)
    ipython.set_custom_exc((NotImplementedError,), explain_unfilled_exercise)
