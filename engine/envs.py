"""Every environment variable the engine reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights live: `AGENTRT_CACHE_DIR`, else `$XDG_CACHE_HOME/agentrt`,
    else `~/.cache/agentrt`. Read at call time so tests can redirect it."""
    explicit = os.environ.get("AGENTRT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentrt"


def num_threads() -> int | None:
    """`AGENTRT_NUM_THREADS`: torch intra-op threads for the CPU engine (default: torch's)."""
    value = os.environ.get("AGENTRT_NUM_THREADS")
    return int(value) if value else None
