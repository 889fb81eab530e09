"""StorageConnector: full KV blocks saved to a directory and loaded back on a prefix match.

One safetensors file per block, `<storage_path>/<engine id>/<key[:2]>/<key>.safetensors`,
named by the block's chained content key (base.extend_block_keys), holding the block's KV
of every layer and, as metadata, its token ids and a CRC-32 of the data. Any instance of
the same model, dtype, quantization and block size that points at the same directory finds
what another one saved: a session's history offloaded and restored, or a prefix cache
shared by several processes. Files are written whole and renamed into place (a reader never
sees half a file); a file whose data, tokens or shape do not check out is deleted and the
block computed again.

Saving: every block that becomes full of computed tokens (prompt or output) and is not
stored yet, copied out of the pool after the step's forward and written on a thread.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.kv_transfer.base import (
    BlockSave,
    KVConnector,
    KVConnectorMetadata,
    KVLayout,
    checksum,
    extend_block_keys,
)
from agentrt.engine.records import SchedulerOutput
from agentrt.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StorageLoad:
    """Blocks of one request to read: pool block ids, their keys and their tokens."""

    block_ids: list[int]
    keys: list[str]
    token_ids: list[tuple[int, ...]]
    num_tokens: int


class StorageConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.root = Path(config.storage_path) / layout.engine_id
        self.root.mkdir(parents=True, exist_ok=True)
        self._keys: dict[str, list[str]] = {}  # per request: its full blocks' keys
        self._num_checked: dict[str, int] = {}  # per request: leading blocks saved or found
        self._saving: list[torch.Tensor] = []  # this step's blocks, one tensor per layer
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="agentrt-kv-writer")

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def _block_keys(self, request: Request) -> list[str]:
        keys = self._keys.setdefault(request.req_id, [])
        return extend_block_keys(keys, request.all_token_ids, self.layout.block_size)

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.loads:
            return 0
        bs = self.layout.block_size
        keys = self._block_keys(request)[num_computed_tokens // bs : (request.num_tokens - 1) // bs]
        num_found = 0
        for key in keys:
            if not self.path(key).exists():
                break
            num_found += 1
        return num_found * bs

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        blocks = range(first, first + num_external_tokens // bs)
        tokens = request.all_token_ids
        self._planned[request.req_id] = StorageLoad(
            block_ids=[block_ids[i] for i in blocks],
            keys=[self._keys[request.req_id][i] for i in blocks],
            token_ids=[tuple(tokens[i * bs : (i + 1) * bs]) for i in blocks],
            num_tokens=num_external_tokens,
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output, requests)
        if not self.config.saves:
            return meta
        bs = self.layout.block_size
        saves: dict[str, BlockSave] = {}  # by key: two requests may share a block
        for chunk in scheduler_output.chunks:
            request = requests[chunk.req_id]
            end = (chunk.start_pos + len(chunk.token_ids) - chunk.num_draft_tokens) // bs
            start = self._num_checked.get(chunk.req_id, 0)
            if end <= start:
                continue
            keys = self._block_keys(request)
            tokens = request.all_token_ids
            for i in range(start, end):
                if keys[i] not in saves and not self.path(keys[i]).exists():
                    block = tuple(tokens[i * bs : (i + 1) * bs])
                    saves[keys[i]] = BlockSave(chunk.block_ids[i], keys[i], block)
            self._num_checked[chunk.req_id] = end
        return KVConnectorMetadata(loads=meta.loads, saves=list(saves.values()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._keys.pop(request.req_id, None)
        self._num_checked.pop(request.req_id, None)
        return False, None  # saved blocks were copied out: nothing to hold

    # -- worker side -------------------------------------------------------------------------

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        if self._meta.saves:
            index = torch.tensor([s.block_id for s in self._meta.saves], device=kv_layer.device)
            self._saving.append(kv_layer.index_select(0, index).cpu())

    def wait_for_save(self) -> None:
        """The copies are taken; the files are written on the writer thread."""
        if self._saving:
            data = torch.stack(self._saving, dim=1)  # (blocks, layers, 2, bs, heads, dim)
            self._saving = []
            self._writer.submit(self._write, self._meta.saves, data)

    def _write(self, saves: list[BlockSave], data: torch.Tensor) -> None:
        for save, block in zip(saves, data, strict=True):
            path = self.path(save.key)
            try:
                path.parent.mkdir(exist_ok=True)
                block = block.contiguous()
                metadata = {"token_ids": json.dumps(save.token_ids), "crc32": str(checksum(block))}
                partial = path.with_suffix(f".{os.getpid()}.part")
                save_file({"kv": block}, partial, metadata=metadata)
                os.replace(partial, path)
            except OSError as exc:
                logger.warning("could not store KV block %s: %s", path, exc)
                continue
            with self._lock:
                self.stats.num_saved_blocks += 1

    def _load(self, req_id: str, plan: StorageLoad) -> int:
        """Read the blocks in order; stop at the first one missing or not checking out."""
        for num_loaded, (block_id, key, tokens) in enumerate(
            zip(plan.block_ids, plan.keys, plan.token_ids, strict=True)
        ):
            path = self.path(key)
            try:
                block = self._read(path, tokens)
            except Exception as exc:  # noqa: BLE001 - missing, truncated, corrupt: recompute
                logger.warning("KV block %s is unusable (%s): computing it again", path, exc)
                if not isinstance(exc, FileNotFoundError):
                    path.unlink(missing_ok=True)  # the recomputed block is saved again
                return num_loaded * self.layout.block_size
            self._write_blocks([block_id], block[None])
        return plan.num_tokens

    def _read(self, path: Path, tokens: tuple[int, ...]) -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            block = f.get_tensor("kv")
        if tuple(json.loads(metadata["token_ids"])) != tokens:
            raise ValueError("it holds other tokens")
        if block.shape != self.layout.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"{block.dtype} {tuple(block.shape)} is not this engine's layout")
        if checksum(block) != int(metadata["crc32"]):
            raise ValueError("checksum mismatch")
        return block

    def shutdown(self) -> None:
        """Finish writing what was saved, then stop."""
        self._writer.shutdown(wait=True)
        super().shutdown()
