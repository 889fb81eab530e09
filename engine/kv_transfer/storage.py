"""StorageConnector: full KV blocks saved to a directory and loaded back on a prefix match.

One safetensors file per block, `<storage_path>/<engine id>/<name[:2]>/<name>.safetensors`,
holding the block's KV of every layer and, as metadata, a MAC. Under tensor parallelism each
rank stores and loads its own KV heads, in its own folder (`<engine id>-tp<rank>of<size>`);
rank 0's files decide what is looked up and saved, and a rank whose file is missing or
unusable loads less, so the request computes from there (every rank loads the same tokens). Any instance of the same
model, dtype, quantization and block size with the same secret that points at the same
directory finds what another one saved: a session's history offloaded and restored, or a
prefix cache shared by several processes. Files are written whole and renamed into place (a
reader never sees half a file).

Trust: whoever can write the directory must not be able to plant KV for a prefix.
- A block's file name is a MAC of its chained hash (core/block_hash.py) and its MAC covers the
  engine id, the hash, the block's token ids and its data, under keys derived from the
  secret (auth.py): without the secret nobody can name the file of a prefix or make a file
  that loads. The tokens are not stored: the reader MACs its own, so a file holding other
  tokens fails like a tampered one. A file whose MAC, dtype or shape does not check out is
  deleted and the block computed again (and saved again).
- The secret is `kv_secret` (or AGENTRT_KV_SECRET); without one, a random key kept in
  `<storage_path>/.kv-secret`, readable by its owner only (enough for one user's offload;
  instances of several users or machines that share the directory set the same secret).
- Directories are created 0700 and files 0600 (KV reveals the prompt it was computed from).
- `storage_max_gb` caps the directory (each of N ranks its folder at 1/N of it): past it the
  least recently used files (saved or loaded) are deleted. Each process counts what it sees (the files present when it started,
  then its own writes), so several writers may exceed the cap by what the others wrote since.

The scheduler side (`StorageScheduler`) finds stored prefixes, plans loads and picks the
blocks to save; the worker side (`StorageWorker`, one per rank) reads and writes the files.
Saving: every block that becomes full of computed tokens (prompt or output) and is not
stored yet, copied out of the pool after the step's forward and written on a thread.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import struct
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.block_hash import BlockHash, extend_block_hashes
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request
from agentrt.engine.errors import ConfigError
from agentrt.engine.kv_transfer.auth import KVAuthError, derive_key, mac
from agentrt.engine.kv_transfer.base import (
    BlockSave,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLayout,
)
from agentrt.engine.records import SchedulerOutput

logger = logging.getLogger(__name__)

KEY_FILE = ".kv-secret"
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class StorageLoad:
    """Blocks of one request to read: pool block ids, their hashes and their tokens."""

    block_ids: list[int]
    block_hashes: list[BlockHash]
    token_ids: list[tuple[int, ...]]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StorageMetadata:
    """One step's transfers: loads by request, and the blocks full of computed tokens."""

    loads: dict[str, StorageLoad] = field(default_factory=dict)
    saves: list[BlockSave] = field(default_factory=list)


def storage_secret(storage_path: Path) -> str:
    """The key file's secret, created (0600, atomically) if there is none. Raises
    ConfigError if it is a link, not the user's, or others may read it."""
    path = storage_path / KEY_FILE
    if not path.exists():
        storage_path.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = storage_path / f"{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(partial, path)  # fails if another process made one first: use that
        except FileExistsError:
            pass
        finally:
            partial.unlink()
    info = path.lstat()
    problem = None
    if path.is_symlink():
        problem = "is a link"
    elif info.st_uid != os.getuid():
        problem = "is not yours"
    elif info.st_mode & 0o077:
        problem = "is readable by others"
    if problem is not None:
        raise ConfigError(
            f"{path} (the storage connector's key) {problem}: delete it (a new one is made), "
            "or set kv_secret / AGENTRT_KV_SECRET."
        )
    return path.read_text().strip()


class StorageFiles:
    """Where one rank's blocks are stored and how they are signed (both sides use it)."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        if not _HEX.fullmatch(layout.engine_id):
            raise ValueError(f"engine id {layout.engine_id!r} is not hex")  # names a folder
        storage_path = Path(config.storage_path)
        secret = config.secret or storage_secret(storage_path)
        self._name_key = derive_key(secret, "storage name")
        self._file_key = derive_key(secret, "storage file")
        self.layout = layout
        self.root = storage_path / layout.shard_id
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, block_hash: BlockHash) -> Path:
        """Where a block's file is: a MAC of its hash, so only the secret's holders know."""
        name = mac(self._name_key, block_hash)
        return self.root / name[:2] / f"{name}.safetensors"

    def file_mac(self, block_hash: BlockHash, tokens: tuple[int, ...], data: torch.Tensor) -> str:
        token_bytes = struct.pack(f"<{len(tokens)}q", *tokens)
        kv_bytes = data.contiguous().view(torch.uint8).numpy().tobytes()
        return mac(self._file_key, self.layout.shard_id.encode(), block_hash, token_bytes, kv_bytes)


class StorageScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv: KVCacheManager) -> None:
        super().__init__(config, layout, kv)
        self.files = StorageFiles(config, layout)
        self._hashes: dict[str, list[BlockHash]] = {}  # per request: its full blocks' hashes
        self._num_checked: dict[str, int] = {}  # per request: leading blocks saved or found

    def path(self, block_hash: BlockHash) -> Path:
        """Where rank 0 stores a block (StorageFiles.path)."""
        return self.files.path(block_hash)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.req_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, self.layout.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.config.loads:
            return 0
        bs = self.layout.block_size
        hashes = self._block_hashes(request)
        num_found = 0
        for block_hash in hashes[num_computed_tokens // bs : (request.num_tokens - 1) // bs]:
            if not self.path(block_hash).exists():
                break
            num_found += 1
        return num_found * bs

    def _plan_load(self, request: Request, block_ids: list[int], num_tokens: int) -> StorageLoad:
        bs = self.layout.block_size
        first = request.num_computed_tokens // bs
        blocks = range(first, first + num_tokens // bs)
        tokens = request.all_token_ids
        return StorageLoad(
            block_ids=[block_ids[i] for i in blocks],
            block_hashes=[self._hashes[request.req_id][i] for i in blocks],
            token_ids=[tuple(tokens[i * bs : (i + 1) * bs]) for i in blocks],
            num_tokens=num_tokens,
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> StorageMetadata:
        loads = self._take_planned()
        if not self.config.saves:
            return StorageMetadata(loads)
        bs = self.layout.block_size
        saves: dict[BlockHash, BlockSave] = {}  # by hash: two requests may share a block
        for chunk in scheduler_output.chunks:
            request = requests[chunk.req_id]
            end = (chunk.start_pos + len(chunk.token_ids) - chunk.num_draft_tokens) // bs
            start = self._num_checked.get(chunk.req_id, 0)
            if end <= start:
                continue
            hashes = self._block_hashes(request)
            tokens = request.all_token_ids
            for i in range(start, end):
                if hashes[i] not in saves and not self.path(hashes[i]).exists():
                    block = tuple(tokens[i * bs : (i + 1) * bs])
                    saves[hashes[i]] = BlockSave(chunk.block_ids[i], hashes[i], block)
            self._num_checked[chunk.req_id] = end
        return StorageMetadata(loads, list(saves.values()))

    def request_finished(self, request: Request) -> dict | None:
        self._hashes.pop(request.req_id, None)
        self._num_checked.pop(request.req_id, None)
        return super().request_finished(request)  # saved blocks were copied out: none held


class StorageWorker(KVConnectorWorker):
    metadata_type = StorageMetadata

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.files = StorageFiles(config, layout)
        self._saving: list[torch.Tensor] = []  # this step's blocks, one tensor per layer
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="agentrt-kv-writer")
        self._max_bytes = (
            None
            if config.storage_max_gb is None
            else int(config.storage_max_gb * 2**30 / layout.tp_size)
        )
        self._files: OrderedDict[Path, int] = OrderedDict()  # least recently used first
        self._num_bytes = 0
        self._files_lock = threading.Lock()
        if self._max_bytes is not None:
            self._index_existing_files()

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        if self._meta is not None and self._meta.saves:
            index = torch.tensor([s.block_id for s in self._meta.saves], device=kv_layer.device)
            self._saving.append(kv_layer.index_select(0, index).cpu())

    def wait_for_save(self) -> None:
        """The copies are taken; the files are written on the writer thread."""
        if self._saving:
            data = torch.stack(self._saving, dim=1)  # (blocks, layers, 2, bs, heads, dim)
            self._saving = []
            self._writer.submit(self._write, self._meta.saves, data)

    def _write(self, saves: list[BlockSave], data: torch.Tensor) -> None:
        for save_, block in zip(saves, data, strict=True):
            path = self.files.path(save_.block_hash)
            block = block.contiguous()
            metadata = {"mac": self.files.file_mac(save_.block_hash, save_.token_ids, block)}
            blob = save({"kv": block}, metadata=metadata)
            try:
                path.parent.mkdir(mode=0o700, exist_ok=True)
                # A fresh name, never an existing file or link (someone else's planted one).
                partial = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.part")
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                fd = os.open(partial, flags, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(partial, path)
            except OSError as exc:
                logger.warning("could not store KV block %s: %s", path, exc)
                continue
            with self._lock:
                self.num_saved_blocks += 1
            if self._max_bytes is not None:
                self._used(path, len(blob))

    def _load(self, req_id: str, plan: StorageLoad) -> int:
        """Read the blocks in order; stop at the first one missing or not checking out."""
        for num_loaded, (block_id, block_hash, tokens) in enumerate(
            zip(plan.block_ids, plan.block_hashes, plan.token_ids, strict=True)
        ):
            path = self.files.path(block_hash)
            try:
                block = self._read(path, block_hash, tokens)
            except Exception as exc:  # noqa: BLE001 - missing, truncated, forged: recompute
                logger.warning("KV block %s is unusable (%s): computing it again", path, exc)
                if not isinstance(exc, FileNotFoundError):
                    path.unlink(missing_ok=True)  # the recomputed block is saved again
                return num_loaded * self.layout.block_size
            self._write_blocks([block_id], block[None])
            if self._max_bytes is not None:
                self._touch(path)
        return plan.num_tokens

    def _read(self, path: Path, block_hash: BlockHash, tokens: tuple[int, ...]) -> torch.Tensor:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            block = f.get_tensor("kv")
        if block.shape != self.layout.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"{block.dtype} {tuple(block.shape)} is not this engine's layout")
        found = metadata.get("mac")
        if not isinstance(found, str) or not hmac.compare_digest(
            found, self.files.file_mac(block_hash, tokens, block)
        ):
            raise KVAuthError("its MAC does not check out (unsigned, tampered, or other tokens)")
        return block

    # -- size cap ----------------------------------------------------------------------------

    def _index_existing_files(self) -> None:
        files = []
        for path in self.files.root.glob("*/*.safetensors"):
            try:
                info = path.stat()
            except OSError:
                continue
            files.append((info.st_mtime, path, info.st_size))
        for _, path, size in sorted(files):
            self._files[path] = size
            self._num_bytes += size
        self._evict()

    def _used(self, path: Path, size: int) -> None:
        """A file was written or read: it becomes the most recently used."""
        with self._files_lock:
            self._num_bytes += size - self._files.pop(path, 0)
            self._files[path] = size
            self._evict()

    def _touch(self, path: Path) -> None:
        """A file was loaded: the most recently used, here and (by mtime) for processes
        that start later."""
        try:
            os.utime(path)
            self._used(path, path.stat().st_size)
        except OSError:  # deleted meanwhile (evicted by another process)
            pass

    def _evict(self) -> None:
        """Delete least recently used files until the directory fits the cap (the caller
        holds the lock, or is the constructor)."""
        assert self._max_bytes is not None
        while self._num_bytes > self._max_bytes and len(self._files) > 1:
            path, size = self._files.popitem(last=False)
            self._num_bytes -= size
            path.unlink(missing_ok=True)

    def shutdown(self) -> None:
        """Finish writing what was saved, then stop."""
        self._writer.shutdown(wait=True)
        super().shutdown()
