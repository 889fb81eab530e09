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
  rendezvous store at MASTER_ADDR:MASTER_PORT and sends the workers the model and cache
  parts of its resolved engine config; each worker loads its shard of the checkpoint at the
  path rank 0 resolved (the same checkpoint must be at that path on every machine).

Protocol, all through the store and then the groups of distributed.py: a worker connects,
says `hello/<rank>`, reads rank 0's config (`encode_worker_config`), joins the groups,
loads its shard, says `ready/<rank>` ("ok" or the error that stopped it), then runs
forwards (and its worker side of a KV connector, when rank 0 starts one) until rank 0 shuts
the group down. A worker exits when rank 0 does: its next wait fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable

import torch

from agentrt.engine import envs
from agentrt.engine.config import CacheConfig, ModelConfig
from agentrt.engine.errors import EngineDeadError, ModelLoadError
from agentrt.engine.loader.load import get_loader
from agentrt.engine.worker.distributed import KV_SETUP, STEP, TensorParallelGroup, connect_store
from agentrt.engine.worker.model_runner import ModelRunner, decode_kv_setup

logger = logging.getLogger(__name__)


def encode_worker_config(model: ModelConfig, cache: CacheConfig) -> str:
    """The parts of rank 0's resolved engine config every rank builds its shard from, as the
    JSON it sends through the rendezvous store: the checkpoint's resolved path and config,
    the dtype by its canonical name, the KV pool as rank 0 sized it."""
    return json.dumps({"model": model.to_json_dict(), "cache": dataclasses.asdict(cache)})


def decode_worker_config(data: bytes | str) -> tuple[ModelConfig, CacheConfig]:
    parts = json.loads(data)
    return ModelConfig.from_json_dict(parts["model"]), CacheConfig(**parts["cache"])


def rank_device(model: ModelConfig, local_rank: int) -> torch.device:
    """The device of the rank with this `local_rank`: the CPU, or GPU `local_rank`."""
    return torch.device("cpu" if model.device == "cpu" else f"cuda:{local_rank}")


def threads_per_rank(local_world_size: int) -> int:
    """Torch threads of one rank: `AGENTRT_NUM_THREADS`, else this machine's cores shared
    evenly by its ranks (at least one)."""
    return envs.num_threads() or max(1, (os.cpu_count() or 1) // local_world_size)


def build_runner(
    model: ModelConfig,
    cache: CacheConfig,
    device: torch.device,
    tp: TensorParallelGroup | None,
    alongside: Callable[[], object] | None = None,
) -> ModelRunner:
    """This rank's model runner, of the resolved config: the checkpoint at `model.path`, its
    loader reading only this rank's slices (`tp`). Nothing is resolved again here.
    `alongside` runs on this thread while the weights are interleaved (load.py)."""
    if not model.path.exists():
        raise ModelLoadError(
            f"{model.path} (the checkpoint rank 0 resolved {model.model!r} to) is not on this "
            "machine: every rank reads the same checkpoint at the same path."
        )
    return ModelRunner(
        model.arch,
        get_loader(model.path),
        dtype=model.dtype,
        device=device,
        block_size=cache.block_size,
        num_blocks=cache.num_blocks,
        max_model_len=model.max_model_len,
        attention_backend=model.attention_backend,
        quantization=model.quantization,
        tp=tp,
        alongside=alongside,
    )


def run_worker(
    rank: int, world_size: int, host: str, port: int, local_rank: int, local_world_size: int
) -> None:
    """Join rank 0's group as `rank` and run forwards until it shuts the group down."""
    timeout_s = envs.tp_timeout_s()
    store = connect_store(rank, world_size, host, port, timeout_s)
    store.set(f"hello/{rank}", "")
    model, cache = decode_worker_config(store.get("config"))
    torch.set_num_threads(threads_per_rank(local_world_size))
    device = rank_device(model, local_rank)
    tp = TensorParallelGroup(store, rank, world_size, device, timeout_s)
    try:
        runner = build_runner(model, cache, device, tp)
    except Exception as exc:
        store.set(f"ready/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"ready/{rank}", "ok")
    try:
        with torch.inference_mode():
            while (message := tp.receive()) is not None:
                if message.kind == KV_SETUP:
                    runner.start_kv_connector(*decode_kv_setup(message.kv))
                elif message.kind == STEP:
                    runner.run_step(message.inp, runner.decode_kv(message.kv))
                else:
                    runner.kv_transfer(runner.decode_kv(message.kv))
    finally:
        if runner.connector is not None:
            runner.connector.shutdown()  # its writes finish before the process exits


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
