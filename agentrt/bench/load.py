"""How a benchmark's requests are sent: `LoadConfig` (arrival rate, concurrency, scoring) and
`drive`, which sends a workload through any `send` (the in-process engine in runner.py, HTTP in
http.py) and times it."""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from agentrt.bench.datasets import BenchRequest
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.results import RequestRecord


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How requests are sent and scored. Validated on creation (`BenchConfigError`)."""

    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None  # requests in flight at most (None: no cap)
    num_iters: int = 10  # latency mode: measured requests
    num_iters_warmup: int = 2  # latency mode: requests run first, not measured
    temperature: float = 0.0
    goodput_e2e_ms: float | None = None
    goodput_ttft_ms: float | None = None
    progress: bool = False  # a tqdm bar on stderr

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise BenchConfigError(
                f"request_rate={self.request_rate} is invalid: expected requests per second "
                "> 0, or inf to send every request at once."
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchConfigError(
                f"max_concurrency={self.max_concurrency} is invalid: expected >= 1."
            )
        if self.num_iters < 1 or self.num_iters_warmup < 0:
            raise BenchConfigError(
                f"num_iters={self.num_iters}, num_iters_warmup={self.num_iters_warmup}: "
                "expected num_iters >= 1 and num_iters_warmup >= 0."
            )
        for name in ("goodput_e2e_ms", "goodput_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise BenchConfigError(f"{name}={value} is invalid: expected > 0 ms.")


async def drive(
    requests: list[BenchRequest],
    load: LoadConfig,
    send: Callable[[BenchRequest], Awaitable[RequestRecord]],
    seed: int,
) -> tuple[list[RequestRecord], float]:
    """Send every request (Poisson arrivals at `load.request_rate`, at most
    `load.max_concurrency` in flight); returns the records in request order and the wall
    time from the first send to the last completion."""
    from tqdm import tqdm

    rng = random.Random(seed)
    records: list[RequestRecord | None] = [None] * len(requests)
    limit = anyio.Semaphore(load.max_concurrency or len(requests))
    with tqdm(total=len(requests), disable=not load.progress, file=sys.stderr) as bar:

        async def one(index: int) -> None:
            try:
                records[index] = await send(requests[index])
            finally:
                limit.release()
                bar.update(1)

        start = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for index in range(len(requests)):
                await limit.acquire()
                tasks.start_soon(one, index)
                if math.isfinite(load.request_rate) and index + 1 < len(requests):
                    await anyio.sleep(rng.expovariate(load.request_rate))
        duration = time.perf_counter() - start
    return [r if r is not None else RequestRecord(error="not sent") for r in records], duration
