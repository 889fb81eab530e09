"""TensorParallelExecutor: rank 0's side of tensor parallelism. It starts the workers (or
meets the ones a torchrun-style launch started), joins the group with them, waits until
every rank has loaded its shard, and shuts them down. The steps themselves go through the
model runner (`ModelRunner.execute` sends each step's input; see distributed.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import torch

from agentrt.engine import envs
from agentrt.engine.config import CacheConfig, ModelConfig
from agentrt.engine.errors import ConfigError, EngineDeadError
from agentrt.engine.worker.distributed import TensorParallelGroup, connect_store
from agentrt.engine.worker.worker import encode_worker_config, rank_device, threads_per_rank

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_JOIN_S = 10.0  # a worker told to shut down gets this long to exit before it is killed


class TensorParallelExecutor:
    """Workers for ranks 1..size-1 of one engine.

    With RANK, WORLD_SIZE (= size), MASTER_ADDR and MASTER_PORT set (envs.rendezvous), this
    process must be rank 0: it hosts the store at MASTER_ADDR:MASTER_PORT and the other ranks
    run `python -m agentrt.engine.worker.worker`. Otherwise it starts size - 1 local workers, each
    that same command in a fresh interpreter with the rendezvous variables set (a free port
    of 127.0.0.1): spawn semantics, without multiprocessing's re-import of the caller's
    `__main__`, so a script with no `if __name__ == "__main__"` guard works too. Either way
    this process's torch threads become its share of the cores (restored by `shutdown`).

    Raises `ConfigError` when RANK says this process is not rank 0, `EngineDeadError` when a
    worker exits, fails to load or does not answer within `AGENTRT_TP_TIMEOUT_S`.
    """

    def __init__(self, size: int, model: ModelConfig, cache: CacheConfig) -> None:
        self.size = size
        self.processes: list[subprocess.Popen] = []
        self.timeout_s = envs.tp_timeout_s()
        rdzv = envs.rendezvous()
        if rdzv is not None and rdzv.world_size == size:
            if rdzv.rank != 0:
                raise ConfigError(
                    f"this process has RANK={rdzv.rank}: only rank 0 creates the engine; run "
                    "`python -m agentrt.engine.worker.worker` (or agentrt.engine.worker.worker."
                    "run_from_env()) on ranks 1..WORLD_SIZE-1."
                )
            host, port = rdzv.master_addr, rdzv.master_port
            local_rank, local_world_size = rdzv.local_rank, rdzv.local_world_size
        else:
            host, port, local_rank, local_world_size = "127.0.0.1", 0, 0, size
        self._previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(local_world_size))
        self.store = connect_store(0, size, host, port, self.timeout_s)
        self.store.set("config", encode_worker_config(model, cache))
        if rdzv is None or rdzv.world_size != size:
            self.processes = [self._spawn(rank, self.store.port) for rank in range(1, size)]
        self.device = rank_device(model, local_rank)
        self.group: TensorParallelGroup | None = None
        try:
            self._wait_for_all("hello")
            self.group = TensorParallelGroup(self.store, 0, size, self.device, self.timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard (call after loading rank 0's)."""
        self._wait_for_all("ready")
        for rank in range(1, self.size):
            status = self.store.get(f"ready/{rank}").decode()
            if status != "ok":
                raise EngineDeadError(f"tensor-parallel rank {rank} failed to start: {status}")

    def check_alive(self) -> None:
        """Raise `EngineDeadError` if a spawned worker has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                key = f"ready/{rank}"  # a worker that failed to load says why there
                why = f": {self.store.get(key).decode()}" if self.store.check([key]) else ""
                raise EngineDeadError(
                    f"tensor-parallel rank {rank} exited (code {process.returncode}){why}; "
                    "start a new engine."
                )

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for spawned ones (killing any that linger), and
        give this process its threads back. Safe to call more than once, and after a
        worker died."""
        told = False
        if self.group is not None and not self.group.closed:
            try:
                self.group.send_shutdown()
                told = True
            except EngineDeadError:
                pass  # a worker is already gone
        for rank, process in enumerate(self.processes, start=1):
            try:
                # Workers not told (the group died) may wait for a step forever: end them.
                process.wait(_JOIN_S if told else 0)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not exit: killing it", rank)
                process.kill()
                process.wait()
        self.processes = []
        if self._previous_threads:
            torch.set_num_threads(self._previous_threads)
            self._previous_threads = 0

    def _spawn(self, rank: int, port: int) -> subprocess.Popen:
        """Worker `rank` on this machine: `python -m agentrt.engine.worker.worker`."""
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(self.size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        return subprocess.Popen([sys.executable, "-m", "agentrt.engine.worker.worker"], env=env)

    def _wait_for_all(self, stage: str) -> None:
        """Wait until every worker has set `<stage>/<rank>` in the store, failing fast when a
        spawned one exits and after the timeout otherwise."""
        keys = [f"{stage}/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise EngineDeadError(
                    f"tensor-parallel workers did not answer within {self.timeout_s:.0f} s "
                    f"(missing {', '.join(missing)}): start ranks 1..{self.size - 1} with "
                    "`python -m agentrt.engine.worker.worker` and the same MASTER_ADDR/MASTER_PORT, "
                    "or raise AGENTRT_TP_TIMEOUT_S."
                )
            time.sleep(_POLL_S)
