"""Tensor-parallel workers: ranks 1..N-1, which hold their shard of the model and run each
step's forward with rank 0 (which schedules, samples and talks to the caller).

A worker is always this module's entry point,

    python -m agentrt.engine.worker.worker      (or `run_from_env()` from a script)

reading the torchrun-style rendezvous variables `RANK`, `WORLD_SIZE` (= N), `MASTER_ADDR`,
`MASTER_PORT` (and `LOCAL_RANK`, which picks the GPU). It is started one of two ways:

- by the engine: `LLM(tensor_parallel_size=N)` alone starts N - 1 of them on this machine
  (fresh interpreters, as multiprocessing's spawn would, on a free local port);
- by the user, for several machines: with those variables set in every process, rank 0
  creates the engine (`LLM(..., tensor_parallel_size=N)`, which then starts nothing) and
  every other rank, on any machine that reaches MASTER_ADDR, runs the command above. Rank 0 hosts the
  rendezvous store at MASTER_ADDR:MASTER_PORT and sends the workers its engine options;
  each worker loads the model itself (the same local checkpoint path, or the embedded one).

Protocol, all through the store and then the groups of distributed.py: a worker connects,
says `hello/<rank>`, reads rank 0's `WorkerConfig`, joins the groups, loads its shard, says
`ready/<rank>` ("ok" or the error that stopped it), then runs forwards until rank 0 shuts
the group down. A worker exits when rank 0 does: its next wait fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import torch

from agentrt.engine import envs
from agentrt.engine.config import DTYPES
from agentrt.engine.errors import EngineDeadError
from agentrt.engine.loader.load import get_loader
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.checkpoint import load_hf_config, resolve_model
from agentrt.engine.worker.distributed import TensorParallelGroup, connect_store
from agentrt.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What every rank needs to build its shard of the model, as rank 0 resolved it. Sent
    to the workers as JSON through the rendezvous store."""

    model: str | None  # as the user gave it (None: the embedded model); each rank resolves it
    dtype: str  # a key of config.DTYPES
    device_type: str  # "cpu" or "cuda" (rank r runs on cuda:LOCAL_RANK)
    block_size: int
    num_blocks: int  # the KV pool, the same on every rank (rank 0 sized it)
    max_model_len: int
    attention_backend: str
    quantization: str

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes | str) -> WorkerConfig:
        return cls(**json.loads(data))

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu" if self.device_type == "cpu" else f"cuda:{local_rank}")


def threads_per_rank(local_world_size: int) -> int:
    """Torch threads of one rank: `AGENTRT_NUM_THREADS`, else this machine's cores shared
    evenly by its ranks (at least one)."""
    return envs.num_threads() or max(1, (os.cpu_count() or 1) // local_world_size)


def build_runner(
    config: WorkerConfig, device: torch.device, tp: TensorParallelGroup | None
) -> ModelRunner:
    """This rank's model runner: the checkpoint resolved here, its loader reading only this
    rank's slices (`tp`)."""
    path = resolve_model(config.model)
    return ModelRunner(
        ModelArchConfig.from_hf_dict(load_hf_config(path)),
        get_loader(path),
        dtype=DTYPES[config.dtype],
        device=device,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        max_model_len=config.max_model_len,
        attention_backend=config.attention_backend,
        quantization=config.quantization,
        tp=tp,
    )


def run_worker(
    rank: int, world_size: int, host: str, port: int, local_rank: int, local_world_size: int
) -> None:
    """Join rank 0's group as `rank` and run forwards until it shuts the group down."""
    timeout_s = envs.tp_timeout_s()
    store = connect_store(rank, world_size, host, port, timeout_s)
    store.set(f"hello/{rank}", "")
    config = WorkerConfig.decode(store.get("config"))
    torch.set_num_threads(threads_per_rank(local_world_size))
    device = config.device(local_rank)
    tp = TensorParallelGroup(store, rank, world_size, device, timeout_s)
    try:
        runner = build_runner(config, device, tp)
    except Exception as exc:
        store.set(f"ready/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "ok")
    with torch.inference_mode():
        while (inp := tp.receive_step()) is not None:
            runner.forward(inp)


def run_from_env() -> None:
    """The worker of a torchrun-style launch: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    (and LOCAL_RANK, LOCAL_WORLD_SIZE) from the environment. Returns when the engine on rank
    0 shuts down; raises `EngineDeadError` when rank 0 goes away first."""
    rdzv = envs.rendezvous()
    if rdzv is None or rdzv.rank == 0:
        raise SystemExit(
            "agentrt.engine.worker.worker runs ranks 1..N-1 of a tensor-parallel engine: set RANK "
            "(>= 1), WORLD_SIZE, MASTER_ADDR and MASTER_PORT; rank 0 is the process that "
            "creates LLM(..., tensor_parallel_size=WORLD_SIZE)."
        )
    run_worker(
        rdzv.rank,
        rdzv.world_size,
        rdzv.master_addr,
        rdzv.master_port,
        rdzv.local_rank,
        rdzv.local_world_size,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    try:
        run_from_env()
    except EngineDeadError as exc:
        logger.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
