"""Where the tutorials write their figures: one ignored folder, never the working directory.

``figure_path("01_x.png")`` is ``$MINIVLLM_FIGURES/01_x.png`` if that variable is set,
else ``tutorials/figures/01_x.png`` (git ignores both defaults' contents); the folder
is created on first use. The tutorials run from anywhere (``python tutorials/01_...py``
from the repo root, as the README says, or from ``tutorials/``) and put their PNGs here.
"""

from __future__ import annotations

import os
from pathlib import Path


def figure_path(name: str) -> str:
    """The path to save figure ``name`` at, with its folder created."""
    folder = Path(os.environ.get("MINIVLLM_FIGURES") or Path(__file__).parent / "figures")
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / name)
