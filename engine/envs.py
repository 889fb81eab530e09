"""Every environment variable the engine reads, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """agentrt's cache: compiled CPU kernels (`kernels/`), a GGUF's config and tokenizer
    (`models/`, never its weights: those are read from the file in place) and the storage KV
    connector's default directory (`kv/`). `AGENTRT_CACHE_DIR`, else
    `$XDG_CACHE_HOME/agentrt`, else `~/.cache/agentrt`. Read at call time so tests can
    redirect it."""
    explicit = os.environ.get("AGENTRT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentrt"


def kv_secret() -> str | None:
    """`AGENTRT_KV_SECRET`: the secret shared by instances that exchange KV (the kv_secret
    option wins over it)."""
    return os.environ.get("AGENTRT_KV_SECRET") or None


def num_threads() -> int | None:
    """`AGENTRT_NUM_THREADS`: torch intra-op threads for the CPU engine (default: torch's)."""
    value = os.environ.get("AGENTRT_NUM_THREADS")
    return int(value) if value else None


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """torchrun-style rendezvous variables: this process is `rank` of `world_size`, rank 0
    listens at `master_addr:master_port`, and `local_rank` picks this machine's GPU."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int
    local_world_size: int  # ranks on this machine (LOCAL_WORLD_SIZE, else world_size)


def rendezvous() -> Rendezvous | None:
    """`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK`,
    `LOCAL_WORLD_SIZE`, which default to `RANK` and `WORLD_SIZE`) as torchrun sets them; None
    unless the first four are all set."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(os.environ.get(n) for n in names):
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return Rendezvous(
        rank=rank,
        world_size=world_size,
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        local_rank=int(os.environ.get("LOCAL_RANK") or rank),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE") or world_size),
    )


def tp_timeout_s() -> float:
    """`AGENTRT_TP_TIMEOUT_S`: how long a tensor-parallel rank waits for the others, to start
    (workers loading their weights) or within a step (a collective), before it raises
    (default 120). An idle engine's workers wait for the next step without limit."""
    value = os.environ.get("AGENTRT_TP_TIMEOUT_S")
    return float(value) if value else 120.0
