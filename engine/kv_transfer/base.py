"""The KV connector interface (vLLM V1's `KVConnectorBase_V1` shape) and what connectors share.

A connector moves whole KV blocks between this engine's pool and somewhere else: a
directory (storage.py) or another running instance (p2p.py). It has two sides, which vLLM
runs in different processes and agentrt runs in the engine core's one:

- scheduler side: `get_num_new_matched_tokens` (how many of a new request's tokens, past
  its local prefix-cache hits, the connector can provide), `update_state_after_alloc` (the
  blocks they go into), `build_connector_meta` (this step's loads and saves, handed to the
  worker side with the step), `request_finished` (whether a finished request's blocks must
  stay until they are sent, and what to tell the instance that will fetch them);
- worker side: `start_load_kv`, `wait_for_layer_load`, `save_kv_layer`, `wait_for_save`,
  `get_finished`.

Loads are asynchronous: the scheduler parks a request in `WAITING_FOR_REMOTE_KVS` with its
blocks allocated, loads run on the connector's threads while other requests keep stepping,
and `get_finished` reports how many tokens arrived. A load that fails, or arrives only in
part, is never an error: the request computes the rest itself (counted in
`KVTransferStats.num_load_failures`). No block is read by attention before its load is
reported done, and no loaded block enters the prefix-cache index before that either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.block_hash import BlockHash, extend_block_hashes
from agentrt.engine.core.request import Request
from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import KVTransferStats, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's KV is and how it is laid out: blocks from an engine with another
    `engine_id` (another model, dtype, quantization or block size) are never loaded."""

    engine_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block across all layers: (layers, K/V, block_size, kv heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


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
class KVConnectorMetadata:
    """One step's transfers, from the connector's scheduler side to its worker side."""

    loads: dict[str, Any] = field(default_factory=dict)  # req_id -> the connector's plan
    saves: list[BlockSave] = field(default_factory=list)  # blocks full of computed tokens


@dataclass(frozen=True, slots=True)
class KVTransferResult:
    """What `get_finished` reports: loads that ended (req_id -> tokens that arrived; fewer
    than asked means the rest is computed) and requests whose held blocks may be freed."""

    finished_loads: dict[str, int]
    finished_sends: list[str]


class KVConnector:
    """Base of the connectors: the default of every hook does nothing; loads run on a small
    thread pool through `_load`, which each connector implements."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.stats = KVTransferStats()
        self.kv_caches: list[torch.Tensor] = []
        self._planned: dict[str, Any] = {}  # loads planned since the last step was built
        self._loading: dict[str, Future[int]] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="agentrt-kv")
        self._lock = threading.Lock()
        self._meta = KVConnectorMetadata()

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the request's first `num_computed_tokens` (its local prefix-cache
        hits, whole blocks) that this connector can load: whole blocks, and never the last
        token (the step after the load computes it, to sample)."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request's block table after allocating room for the loaded tokens (which
        follow `request.num_computed_tokens`): plan the load."""

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> KVConnectorMetadata:
        """The step's transfers: the loads planned since the last step, and the saves."""
        loads, self._planned = self._planned, {}
        return KVConnectorMetadata(loads=loads)

    def admit(self, request: Request) -> tuple[ErrorCode, str] | None:
        """Why a new request cannot be taken (the engine fails it at once with this code and
        message: `ErrorCode.OVERLOADED`, a 429, when it may fit later), or None. An admitted
        request may reserve room here, which `request_finished` gives back."""
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request finished (or was aborted). Returns whether its blocks must stay until
        `get_finished` reports it sent, and the `kv_transfer_params` for its output."""
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The pool: one (num_blocks, 2, block_size, kv heads, head_dim) tensor per layer."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._meta = metadata

    def start_load_kv(self) -> None:
        """Start the step's loads. They fill blocks of requests that wait for them, which no
        forward reads until they are reported done, so they overlap this step's forward."""
        for req_id, plan in self._meta.loads.items():
            self._loading[req_id] = self._pool.submit(self._load_logged, req_id, plan)

    def wait_for_layer_load(self, layer: int) -> None:
        """Loaded requests only run in a later step (see `start_load_kv`): nothing to wait for."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Called after the forward for each layer, with the layer's pool."""

    def wait_for_save(self) -> None:
        """Called once the step's layers are all saved."""

    def get_finished(self) -> KVTransferResult:
        done = {r: f for r, f in self._loading.items() if f.done()}
        for req_id in done:
            del self._loading[req_id]
        return KVTransferResult(
            finished_loads={r: f.result() for r, f in done.items()},
            finished_sends=self._take_finished_sends(),
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- for the connectors ------------------------------------------------------------------

    def _load(self, req_id: str, plan: Any) -> int:
        """Load one request's blocks (on a connector thread); returns the tokens loaded."""
        raise NotImplementedError

    def _load_logged(self, req_id: str, plan: Any) -> int:
        try:
            num_loaded = self._load(req_id, plan)
        except Exception as exc:  # noqa: BLE001 - any failure means: compute it instead
            logger.warning("KV load of request %s failed (%s): computing its prefill", req_id, exc)
            num_loaded = 0
        with self._lock:
            if num_loaded:
                self.stats.num_loads += 1
                self.stats.num_loaded_tokens += num_loaded
            if num_loaded < plan.num_tokens:
                self.stats.num_load_failures += 1
        return num_loaded

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
