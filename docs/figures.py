"""Regenerate the pictures the README shows: `.venv/bin/python docs/figures.py`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from cs336_parallel import viz  # noqa: E402

HERE = Path(__file__).parent

if __name__ == "__main__":
    viz.collectives_gallery(world_size=4).savefig(HERE / "collectives.png", dpi=72)
    print(f"wrote {HERE / 'collectives.png'}")
