"""Where Ember keeps what it builds from a checkpoint (quantized weights, compiled decode steps)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "EMBER_CACHE_DIR"


def cache_root() -> Path:
    """`$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`; each kind of entry has a subfolder."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    return Path(root).expanduser()
