"""The KV connector interface (vLLM V1's `KVConnectorBase_V1` split by `KVConnectorRole`) and
what connectors share.

A connector moves whole KV blocks between this engine's pool and somewhere else: a
directory (storage.py) or another running instance (p2p.py). It is two objects:

- its scheduler side (`KVConnectorScheduler`), one per engine beside the scheduler, which
  calls `admit`, `get_num_new_matched_tokens` (how many of a new request's tokens, past its
  local prefix-cache hits, the connector can provide), `update_state_after_alloc` (the
  blocks they go into), `build_connector_meta` (this step's transfers) and
  `request_finished` (free a finished request's blocks, or hold them until they are sent,
  and what to tell the instance that will fetch them); the engine core hands it what the
  worker sides finished (`update_from_output`): loaded requests may run, sent blocks go back;
- its worker side (`KVConnectorWorker`), one per tensor-parallel rank beside the model
  runner, which moves that rank's KV heads: `register_kv_caches`, `bind_connector_metadata`,
  `start_load_kv`, `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`, `get_finished`.

The two talk only through the step's metadata (a connector's own record, plain data: under
tensor parallelism it travels to ranks 1..N-1 with the step, distributed.py) and, back,
`KVTransferResult`. Loads are asynchronous: the scheduler parks a request in
`WAITING_FOR_REMOTE_KVS` with its blocks allocated, every rank loads its heads on its
connector's threads while other requests keep stepping, and a load is done once it is done
on every rank (the tokens that arrived: the fewest any rank loaded). A load that fails, or
arrives only in part, is never an error: the request computes the rest itself (counted in
`KVTransferStats.num_load_failures`). No block is read by attention before its load is
reported done, and no loaded block enters the prefix-cache index before that either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.block_hash import BlockHash, extend_block_hashes
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import KVTransferStats, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's KV is and how one rank lays it out: blocks from an engine with another
    `engine_id` (another model, dtype, quantization or block size), or from another rank or
    tensor-parallel size (`shard_id`), are never loaded."""

    engine_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block across all layers: (layers, K/V, block_size, kv heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def shard_id(self) -> str:
        """The name of this rank's share of the KV: the engine id, and the rank of the size."""
        if self.tp_size == 1:
            return self.engine_id
        return f"{self.engine_id}-tp{self.tp_rank}of{self.tp_size}"

    def shard(self, rank: int, size: int) -> KVLayout:
        """The layout of rank `rank` of `size`, from the whole model's (which has tp_size 1):
        each rank holds num_kv_heads / size of the heads (model/parallel.py)."""
        assert self.tp_size == 1 and self.num_kv_heads % size == 0
        heads = self.num_kv_heads // size
        return dataclasses.replace(self, num_kv_heads=heads, tp_rank=rank, tp_size=size)

    def encode(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def decode(cls, fields: dict[str, Any]) -> KVLayout:
        return cls(**{**fields, "dtype": getattr(torch, fields["dtype"])})


def engine_id(
    model_path: Path, hf_config: dict, *, dtype: torch.dtype, quantization: str, block_size: int
) -> str:
    """A name for the KV an engine computes: the model (its config and the size of its weight
    files), dtype, quantization and block size."""
    files = [model_path] if model_path.is_file() else sorted(model_path.iterdir())
    weights = sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".bin", ".gguf"))
    text = json.dumps([hf_config, weights, str(dtype), quantization, block_size], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_key(token_ids: list[int], block_size: int) -> str:
    """The name of a prefix of whole blocks: its last block's chained hash (core/block_hash.py,
    the prefix cache's) in hex; equal keys mean equal tokens."""
    return extend_block_hashes([], token_ids, block_size)[-1].hex()


@dataclass(frozen=True, slots=True)
class BlockSave:
    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVTransferResult:
    """What the worker sides report (`get_finished`): loads that ended on every rank (req_id
    -> tokens that arrived; fewer than asked means the rest is computed) and requests whose
    held blocks may be freed (sent, or no longer waited for)."""

    finished_loads: dict[str, int]
    finished_sends: list[str]


class KVConnectorScheduler:
    """Scheduler side: the default of every hook loads nothing and holds nothing. It owns
    the requests whose prefix is loading and the finished ones whose blocks it holds; the
    scheduler's KV cache manager frees their blocks when the transfers end."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv: KVCacheManager) -> None:
        """`layout`: rank 0's (the scheduler side names what rank 0 stores)."""
        self.config = config
        self.layout = layout
        self.kv = kv
        self.stats = KVTransferStats()
        self.loading: dict[str, Request] = {}  # prefix being loaded (aborted ones too)
        self.held: dict[str, Request] = {}  # finished; blocks kept until sent
        self._planned: dict[str, Any] = {}  # loads planned since the last metadata was built
        self._num_planned: dict[str, int] = {}  # per loading request: the tokens asked for

    # -- called by the scheduler -------------------------------------------------------------

    def admit(self, request: Request) -> tuple[ErrorCode, str] | None:
        """Why a new request cannot be taken (the engine fails it at once with this code and
        message: `ErrorCode.OVERLOADED`, a 429, when it may fit later), or None. An admitted
        request may reserve room here, which `request_finished` gives back."""
        return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the request's first `num_computed_tokens` (its local prefix-cache
        hits, whole blocks) that this connector can load: whole blocks, and never the last
        token (the step after the load computes it, to sample)."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's block table after allocating room for the loaded tokens (which
        follow `request.num_computed_tokens`): plan the load; the request waits here until
        every rank has loaded it."""
        self._planned[request.req_id] = self._plan_load(request, block_ids, num_external_tokens)
        self._num_planned[request.req_id] = num_external_tokens
        self.loading[request.req_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]):
        """The step's transfers for the worker sides: the loads planned since the last
        metadata, and what the connector adds (saves, holds)."""
        raise NotImplementedError

    def request_finished(self, request: Request) -> dict | None:
        """A request finished (or was aborted, or its load ended after an abort): free its
        blocks, or hold them until a worker side reports them sent. Returns the
        `kv_transfer_params` for its output."""
        hold, params = self._hold(request, self.kv.block_ids(request.req_id))
        if hold:
            self.held[request.req_id] = request
        else:
            self.kv.free(request)
        return params

    # -- called by the engine core -----------------------------------------------------------

    def take_pending_meta(self):
        """Metadata for the worker sides outside a step (what finishing requests added, e.g.
        holds), or None when there is none."""
        return None

    def update_from_output(self, result: KVTransferResult) -> None:
        """Take what the worker sides finished: loaded requests may run (computing what did
        not arrive themselves), sent requests' blocks go back."""
        for req_id, num_loaded in result.finished_loads.items():
            request = self.loading.pop(req_id)
            num_planned = self._num_planned.pop(req_id)
            if num_loaded:
                self.stats.num_loads += 1
                self.stats.num_loaded_tokens += num_loaded
            if num_loaded < num_planned:
                self.stats.num_load_failures += 1
            if request.status.finished:  # aborted while loading: no transfer to hold for
                self.request_finished(request)
                continue
            request.num_computed_tokens += num_loaded
            self.kv.cache_computed_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
        for req_id in result.finished_sends:
            request = self.held.pop(req_id, None)
            if request is not None:
                self.kv.free(request)

    def shutdown(self) -> None:
        """Nothing runs on the scheduler side."""

    # -- for the connectors ------------------------------------------------------------------

    def _plan_load(self, request: Request, block_ids: list[int], num_tokens: int) -> Any:
        """What a worker side needs to load the request's tokens into its blocks."""
        raise NotImplementedError

    def _take_planned(self) -> dict[str, Any]:
        loads, self._planned = self._planned, {}
        return loads

    def _hold(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Whether a finished request's blocks must stay until sent, and its params."""
        return False, None


class KVConnectorWorker:
    """Worker side, one per rank: loads run on a small thread pool through `_load`, which
    each connector implements; saves and serving are the connector's own."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        """`layout`: this rank's (its KV heads)."""
        self.config = config
        self.layout = layout
        self.kv_caches: list[torch.Tensor] = []
        self.num_saved_blocks = 0  # blocks this rank wrote to storage or sent to a peer
        self._loading: dict[str, Future[int]] = {}  # in the order the loads started
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="agentrt-kv")
        self._lock = threading.Lock()
        self._meta = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """This rank's pool: one (num_blocks, 2, block_size, kv heads, head_dim) tensor per
        layer."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata) -> None:
        self._meta = metadata

    def start_load_kv(self) -> None:
        """Start the bound metadata's loads. They fill blocks of requests that wait for them,
        which no forward reads until they are reported done, so they overlap the forward."""
        if self._meta is None:
            return
        for req_id, plan in self._meta.loads.items():
            self._loading[req_id] = self._pool.submit(self._load_logged, req_id, plan)

    def wait_for_layer_load(self, layer: int) -> None:
        """Loaded requests only run in a later step (see `start_load_kv`): nothing to wait for."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Called after the forward for each layer, with the layer's pool."""

    def wait_for_save(self) -> None:
        """Called once the step's layers are all saved."""

    def load_status(self) -> list[int]:
        """Per load in flight, in the order they started (the same on every rank): the
        tokens it loaded once done, else -1. Ranks combine theirs by their minimum."""
        return [f.result() if f.done() else -1 for f in self._loading.values()]

    def get_finished(self, status: list[int] | None = None) -> KVTransferResult:
        """The loads `status` (this rank's `load_status`, or every rank's minimum) says are
        done, forgotten here, and the held requests whose blocks may be freed."""
        status = self.load_status() if status is None else status
        done = {}
        for req_id, num_loaded in zip(list(self._loading), status, strict=True):
            if num_loaded >= 0:
                done[req_id] = num_loaded
                del self._loading[req_id]
        return KVTransferResult(finished_loads=done, finished_sends=self._take_finished_sends())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- for the connectors ------------------------------------------------------------------

    def _load(self, req_id: str, plan: Any) -> int:
        """Load one request's blocks (on a connector thread); returns the tokens loaded."""
        raise NotImplementedError

    def _load_logged(self, req_id: str, plan: Any) -> int:
        try:
            return self._load(req_id, plan)
        except Exception as exc:  # noqa: BLE001 - any failure means: compute it instead
            logger.warning("KV load of request %s failed (%s): computing its prefill", req_id, exc)
            return 0

    def _take_finished_sends(self) -> list[str]:
        return []

    def _write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy (blocks, *block_shape) into the pool's blocks: one indexed copy per layer."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        for layer, kv in enumerate(self.kv_caches):
            kv.index_copy_(0, index, data[:, layer].to(kv.device))

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The pool's blocks as one contiguous (blocks, *block_shape) tensor."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        return torch.stack([kv.index_select(0, index) for kv in self.kv_caches], dim=1).cpu()
