"""The course's Jupyter kernel: ipykernel, with torch imported and the rank server started before the first cell.

A learner opens a notebook and reads before running its first cell. This kernel spends that time on what the
first cell and `%cluster start` would wait for: importing torch (seconds on 2 cores), and starting the server
the ranks are forked from (`rank_server`), a fork of this process once it has torch, so torch is imported once.
`make` registers it as the kernel "cs336-parallel" (`python -m cs336_parallel.kernel --install NAME
DISPLAY_NAME`); hosted notebooks (Colab, Kaggle) keep their own kernel, where `%load_ext cs336_parallel`
starts the server instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    """Import torch and fork the rank server, then run ipykernel as `python -m ipykernel_launcher` does."""
    if sys.path[0] in ("", str(Path.cwd())):  # as ipykernel_launcher: the notebook's folder shadows no import
        del sys.path[0]
    from . import rank_server

    try:
        import torch  # noqa: F401 - the first cell's import, done while the learner reads

        if not rank_server.start_forked():  # torch._dynamo too, for both; before ipykernel starts its threads
            rank_server.warm_up()  # a Python whose forkserver this does not know: a server of its own
        rank_server.await_ready()
    except Exception:  # noqa: BLE001, S110 - a broken install is the first cell's to explain (versions.check_torch)
        pass
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


def install(name: str, display_name: str) -> Path:
    """Register this kernel in the environment (ipykernel's kernelspec, started by this module): its folder."""
    from ipykernel.kernelspec import install as install_ipykernel

    folder = Path(install_ipykernel(kernel_name=name, display_name=display_name, prefix=sys.prefix))
    spec = json.loads((folder / "kernel.json").read_text())
    spec["argv"] = ["cs336_parallel.kernel" if arg == "ipykernel_launcher" else arg for arg in spec["argv"]]
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1))
    return folder


if __name__ == "__main__":
    if sys.argv[1:2] == ["--install"]:
        install(*sys.argv[2:4])
    else:
        main()
