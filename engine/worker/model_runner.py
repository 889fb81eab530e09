"""ModelRunner: owns the weights and the KV cache tensors; turns a SchedulerOutput into a
flat varlen batch, runs the model, and returns logits for the sampled positions only."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import mmap
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

import agentrt.kernels as kernels
from agentrt.engine import envs
from agentrt.engine.config import CacheConfig
from agentrt.engine.core.kv_cache_groups import kv_cache_layout
from agentrt.engine.loader.load import load_weights
from agentrt.engine.loader.safetensors_loader import StateDictLoader
from agentrt.engine.loader.weights import Shard, WeightLoader
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.parallel import shard_arch
from agentrt.engine.model.registry import model_class
from agentrt.engine.records import AttentionMetadata, ModelInput, ScheduledChunk, SchedulerOutput
from agentrt.engine.worker.attention import get_attention_backend

if TYPE_CHECKING:
    from agentrt.engine.config import KVTransferConfig
    from agentrt.engine.kv_transfer import KVConnectorWorker, KVLayout, KVTransferResult
    from agentrt.engine.worker.distributed import TensorParallelGroup


def kv_block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs: 2 (K and V) * block_size * kv heads * head_dim * dtype size,
    per layer, across all layers; with sliding-window layers across one KV cache group's
    (core/kv_cache_groups.py: a block holds one group's layers)."""
    per_layer = 2 * block_size * arch.num_kv_heads * arch.head_dim * dtype.itemsize
    return per_layer * kv_cache_layout(arch).group_size


def kv_pool_blocks(
    arch: ModelArchConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    draft_arch: ModelArchConfig | None = None,
) -> int:
    """Blocks in the pool: `cache.num_blocks`, or as many as the memory budget holds. With a
    draft model (speculative decoding) a block holds both models' KV for its positions."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = kv_block_bytes(arch, cache.block_size, dtype)
    if draft_arch is not None:
        block_bytes += kv_block_bytes(draft_arch, cache.block_size, dtype)
    return int(cache.kv_cache_memory_gb * 2**30) // block_bytes


def allocate_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Zeroed KV memory. On the CPU an anonymous mapping: pages are zero-filled lazily, so a
    large pool costs nothing until blocks are used (torch.zeros would write every byte up
    front), and where the OS supports it they are transparent huge pages, which makes both
    the first write of a block and attention's scattered block reads cheaper (measured ~20%
    faster decode attention: fewer page faults and TLB misses).
    Zeros matter: attention multiplies masked-out slots by probability 0, and 0 * NaN from
    uninitialised memory would poison the output."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps it mapped


# glibc's mallopt parameters: blocks from M_MMAP_THRESHOLD bytes on get a mapping of their
# own (given back when freed); the heap's free top is given back past M_TRIM_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LOAD_MMAP_THRESHOLD = 256 << 10
# What glibc's own adaptive thresholds reach once a block of 32 MiB has been freed.
_RUN_MMAP_THRESHOLD, _RUN_TRIM_THRESHOLD = 32 << 20, 64 << 20


@contextlib.contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """While loading, blocks of 256 KiB and up get mappings of their own (glibc, process-wide;
    elsewhere, or with the user's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_, this
    does nothing). By default glibc's threshold grows to the size of each mapped block freed,
    so a load's weight buffers and temporaries of 0.1-32 MiB came from the heap, whose freed
    pages stay in RSS: over four identical loads of the 1.1B Q8_0 file the heap held
    237-322 MiB (RSS after load 1,406-1,492 MiB); mapped, 132-144 MiB (1,398-1,412). After
    the load the thresholds are set where glibc's own would be by then (32 MiB, trim 64
    MiB): a step's buffers come from the heap again (mapped, each a fresh set of zeroed
    pages, they made a 512-token prefill 14-35% slower)."""
    own = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ)
    if own or platform.libc_ver()[0] != "glibc":
        yield
        return
    mallopt = ctypes.CDLL(None).mallopt
    mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _RUN_MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, _RUN_TRIM_THRESHOLD)


class ModelRunner:
    def __init__(
        self,
        arch: ModelArchConfig,
        weights: WeightLoader | dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        attention_backend: str = "auto",
        quantization: str = "none",
        tp: TensorParallelGroup | None = None,
        alongside: Callable[[], object] | None = None,
    ) -> None:
        """Builds the model and the KV cache; the weights come from `weights` (a loader of
        engine/loader/, or a state dict already in memory), in the format `quantization`
        names ('none', 'gguf', 'int8', 'int4': engine/loader/quantization.py).
        `tp`: this rank's tensor-parallel group; the runner then holds the rank's shard of
        the full model `arch` (model/parallel.py), its KV heads only, and rank 0 sends each
        step's input to the workers (`worker.py`), which run the same forward. `alongside`
        runs on this thread while the weights are interleaved (load.py `load_weights`)."""
        self.tp = tp
        shard = Shard(0, 1) if tp is None else Shard(tp.rank, tp.size)
        full_arch, arch = arch, shard_arch(arch, shard.size)
        self.arch = arch  # this rank's share under tensor parallelism
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.attention = get_attention_backend(attention_backend, device, arch, block_size)
        # The 'triton' backend is the CUDA path: the model's RMSNorm and RoPE then run the
        # kernels package's fused kernels too (their references on the CPU, as tested there).
        kernel_ops = self.attention.name == "triton"
        # The weights, the model and the KV cache (their memory: large_allocations_mapped).
        with large_allocations_mapped() if device.type == "cpu" else contextlib.nullcontext():
            with torch.device("meta"):
                model = model_class(arch.family)(
                    arch, max_positions=1, kernel_ops=kernel_ops, tp=tp
                )
            loader = StateDictLoader(weights) if isinstance(weights, dict) else weights
            load_weights(
                model,
                loader,
                full_arch,
                shard=shard,
                dtype=dtype,
                device=device,
                quantization=quantization,
                alongside=alongside,
            )
            model.build_rotary(max_model_len, device)
            self.model = model.eval()
            if model.runs_fused_glue() and fused_cpu_glue(dtype, self.attention.name, tp):
                self.model.cpu_ops = kernels.load_cpu_ops(envs.cache_dir() / "kernels")
            # One tensor per layer; with KV cache groups one per layer of a group, shared by
            # the groups' layers in the same place (core/kv_cache_groups.py).
            self.kv_layout = kv_cache_layout(arch)
            places = self.kv_layout.layer_places(arch.num_layers)
            self.layer_groups = [group for group, _ in places]
            shape = (num_blocks, 2, block_size, arch.num_kv_heads, arch.head_dim)
            tensors = [
                allocate_zeros(shape, dtype, device) for _ in range(self.kv_layout.group_size)
            ]
            self.kv_caches = [tensors[slot] for _, slot in places]
            if tp is not None:
                tp.num_kv_groups = len(self.kv_layout.groups)
            if self.model.cpu_ops is not None:
                self.model.cpu_decoder = self.model.build_cpu_decoder(
                    self.attention, self.kv_caches
                )
        self.connector: KVConnectorWorker | None = None

    def start_kv_connector(self, config: KVTransferConfig, layout: KVLayout) -> KVConnectorWorker:
        """Run this rank's worker side of a KV connector with every step: it moves this
        rank's KV heads (`layout` is the whole model's). Rank 0 has the workers start theirs
        (the config, its secret included, goes on the group's control channel, as every
        step's tokens do)."""
        from agentrt.engine.kv_transfer import create_connector_worker

        rank, size = (0, 1) if self.tp is None else (self.tp.rank, self.tp.size)
        if self.tp is not None and rank == 0:
            self.tp.send_kv_setup(encode_kv_setup(config, layout))
        self.connector = create_connector_worker(config, layout.shard(rank, size))
        self.connector.register_kv_caches(self.kv_caches)
        return self.connector

    def execute(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns fp32 logits (S, vocab) in chunk order: for each chunk with
        `sample=True`, one row per draft token and one after the last token."""
        inp = prepare_input(scheduler_output.chunks, self.block_size, self.device)
        meta = scheduler_output.kv_connector_metadata
        if self.tp is not None:  # the workers run the same step on their shards
            self.tp.send_step(inp, self._encode_kv(meta))
        hidden = self.run_step(inp, meta)
        return self.model.compute_logits(hidden.index_select(0, inp.logits_indices))

    def run_step(self, inp: ModelInput, kv_meta: object | None = None) -> torch.Tensor:
        """The step on this rank: its KV loads started, the forward, its blocks saved.
        Tensor-parallel workers call this with what rank 0 sent."""
        connector = self.connector
        if connector is not None and kv_meta is not None:
            connector.bind_connector_metadata(kv_meta)
            connector.start_load_kv()
        hidden = self.forward(inp)
        if connector is not None:
            for layer, kv_cache in enumerate(self.kv_caches):
                connector.save_kv_layer(layer, kv_cache)
            connector.wait_for_save()
        return hidden

    def transfer_kv(self, kv_meta: object | None) -> KVTransferResult:
        """Outside a forward: hand every rank's worker side `kv_meta` (loads of a step with
        nothing to compute, holds of requests that just finished), and report the transfers
        that finished, loads on every rank. Only rank 0 calls this; the workers follow."""
        if self.tp is not None and (kv_meta is not None or self.connector.load_status()):
            self.tp.send_kv(self._encode_kv(kv_meta))
        return self.kv_transfer(kv_meta)

    def kv_transfer(self, kv_meta: object | None) -> KVTransferResult:
        """`transfer_kv` on this rank: a load is done once it is done on every rank, with the
        tokens the rank that loaded fewest loaded (the ranks take their minimum)."""
        connector = self.connector
        if kv_meta is not None:
            connector.bind_connector_metadata(kv_meta)
            connector.start_load_kv()
        status = connector.load_status()
        if self.tp is not None and status:
            status = self.tp.all_reduce_min(status)
        return connector.get_finished(status)

    def _encode_kv(self, kv_meta: object | None) -> bytes:
        return b"" if kv_meta is None else msgspec.msgpack.encode(kv_meta)

    def decode_kv(self, data: bytes) -> object | None:
        """The worker side's metadata rank 0 sent (`_encode_kv`), None for none."""
        if not data:
            return None
        return msgspec.msgpack.decode(data, type=self.connector.metadata_type)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """The model over one step's input: hidden states (T, hidden), KV cache written.
        Tensor-parallel workers call this with the input rank 0 sent."""
        meta = attention_metadata(inp, self.block_size)
        if inp.group_block_tables:  # KV cache groups: each layer reads its group's tables
            metas = [meta] + [
                dataclasses.replace(meta, slot_mapping=slots, block_tables=tables)
                for slots, tables in zip(
                    inp.group_slot_mappings, inp.group_block_tables, strict=True
                )
            ]
            for group_meta in metas:
                self.attention.prepare(group_meta)
            meta = [metas[group] for group in self.layer_groups]
        else:
            self.attention.prepare(meta)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, meta, self.attention)


def encode_kv_setup(config: KVTransferConfig, layout: KVLayout) -> bytes:
    """What a tensor-parallel worker needs to start its worker side of the connector."""
    return json.dumps(
        {"config": dataclasses.asdict(config), "layout": layout.encode()}, default=list
    ).encode()


def decode_kv_setup(data: bytes) -> tuple[KVTransferConfig, KVLayout]:
    from agentrt.engine.config import KVTransferConfig
    from agentrt.engine.kv_transfer import KVLayout

    fields = json.loads(data)
    config = fields["config"]
    config["allowed_producers"] = tuple(config["allowed_producers"])
    return KVTransferConfig(**config), KVLayout.decode(fields["layout"])


def fused_cpu_glue(dtype: torch.dtype, attention: str, tp: TensorParallelGroup | None) -> bool:
    """Whether quantized layers run their glue fused (LlamaForCausalLM.cpu_ops): fp32
    activations on the CPU attention backend (which builds C kernels, so these build too)
    and one rank. The layers' math is the model's `runs_fused_glue()` to judge."""
    return attention == "cpu" and dtype == torch.float32 and tp is None


def prepare_input(
    chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device
) -> ModelInput:
    """One step's chunks as a flat varlen batch."""
    bs = block_size
    input_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
    positions: list[int] = []
    slot_mapping: list[int] = []
    group_slots: list[list[int]] = [[] for _ in chunks[0].group_block_ids]
    query_lens, context_lens, seq_lens, logits_indices = [], [], [], []
    cu = [0]
    for chunk in chunks:
        n = len(chunk.token_ids)
        span = range(chunk.start_pos, chunk.start_pos + n)
        positions.extend(span)
        slot_mapping.extend(chunk.block_ids[p // bs] * bs + p % bs for p in span)
        for slots, block_ids in zip(group_slots, chunk.group_block_ids, strict=True):
            slots.extend(block_ids[p // bs] * bs + p % bs for p in span)
        query_lens.append(n)
        context_lens.append(chunk.start_pos)
        seq_lens.append(chunk.start_pos + n)
        cu.append(cu[-1] + n)
        if chunk.sample:
            logits_indices.extend(range(cu[-1] - 1 - chunk.num_draft_tokens, cu[-1]))
    # One width for every group's tables (a sliding group's are as long as group 0's: the
    # entries before its window hold the null block).
    max_blocks = max(len(c.block_ids) for c in chunks)

    def tables(group_ids: Sequence[list[int]]) -> torch.Tensor:
        rows = [ids + [0] * (max_blocks - len(ids)) for ids in group_ids]
        return torch.tensor(rows, dtype=torch.int32, device=device)

    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables([c.block_ids for c in chunks]),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        query_lens=query_lens,
        context_lens=context_lens,
        max_seq_len=max(seq_lens),
        group_slot_mappings=[
            torch.tensor(slots, dtype=torch.int64, device=device) for slots in group_slots
        ],
        group_block_tables=[
            tables([c.group_block_ids[g] for c in chunks]) for g in range(len(group_slots))
        ],
    )


def attention_metadata(inp: ModelInput, block_size: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=inp.slot_mapping,
        query_start_loc=inp.query_start_loc,
        seq_lens=inp.seq_lens,
        block_tables=inp.block_tables,
        max_seq_len=inp.max_seq_len,
        query_lens=inp.query_lens,
        context_lens=inp.context_lens,
        block_size=block_size,
    )
