"""The PyTorch the course needs, checked at `%load_ext cs336_parallel`, before anything imports torch.

An older torch lacks `dist.all_gather_single` and `dist.reduce_scatter_single` (2.13's names), and would
fail later, inside an exercise, with an AttributeError that says nothing about versions. The check reads
the installed version from the package metadata: it costs milliseconds, where importing torch costs a second.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

from .text import RedTraceback

TORCH_NEEDED = (2, 13)  # pyproject.toml asks for torch>=2.13 (a test checks they agree)


class SetupError(RedTraceback, RuntimeError):
    """The environment cannot run the course; the message says what to install. IPython shows it in one
    line, without a traceback: the learner's code is not at fault."""

    details: list[str] = []

    @property
    def headline(self) -> str:
        return str(self)


def torch_version() -> str | None:
    """The installed torch's version (e.g. '2.13.0+cpu'), or None when there is none."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a version such as '2.13.0', '2.13.0+cpu' or '2.14.0a0+git1234'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a version number: {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """Raise SetupError, naming the version needed and the command to install it, when torch is missing or
    older than TORCH_NEEDED; `version` defaults to the installed one."""
    version = torch_version() if version is None else version
    needed = ".".join(map(str, TORCH_NEEDED))
    install = f"%pip install torch=={needed}.0 in a cell (or pip install torch=={needed}.0 for {sys.executable})"
    if version is None:
        raise SetupError(f"cs336_parallel needs PyTorch {needed} or newer, and this kernel has none: {install}, "
                         "then restart the kernel.")
    if parse(version) < TORCH_NEEDED:
        raise SetupError(f"cs336_parallel needs PyTorch {needed} or newer (dist.all_gather_single, "
                         f"dist.reduce_scatter_single); this kernel has torch {version}: {install}, "
                         "then restart the kernel.")
