"""GGUFLoader: a GGUF file's tensors by HF name, sliced for one rank, in the file's layout.

Block-format tensors (Q4_0 ... Q8_0, Q2_K ... Q6_K, and whatever else the file holds) come
as `GGMLWeight`s over the file's memory map: a column-parallel slice is a range of rows (a
view: nothing is read until a kernel reads it); llama Q/K rows are put back in HF's order by
moving whole rows of blocks (one copy of those rows); a row-parallel slice is a range of
whole blocks of every row (a copy of this rank's bytes only). A row-parallel slice that does
not fall on block boundaries (e.g. 448 of 896 columns in blocks of 256) is dequantized for
that rank, to fp32 (a dense part; `logger.warning` says so). F32 / F16 / BF16 tensors come as
torch views of the map.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable

import numpy as np
import torch

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.gguf_file import GGUFFile, open_gguf, reverse_rope_permute
from agentrt.engine.loader.weights import Part, Shard, Split, slice_dense
from agentrt.kernels.ggml_linear import (
    DENSE_DTYPES,
    QUANTIZED_TYPES,
    GGMLType,
    GGMLWeight,
    UnsupportedGGMLType,
    block_shape,
    check_ggml_type,
)

logger = logging.getLogger(__name__)


class GGUFLoader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.file: GGUFFile = open_gguf(path)
        # A sparse MoE's 3-D expert tensors (GGUF shape (K, N, experts): one expert's N rows
        # after another) served as one (N, K) matrix per expert under HF's per-expert
        # names: "...mlp.experts.gate_proj.weight" -> "...mlp.experts.{e}.gate_proj.weight".
        self._experts: dict[str, tuple[str, int]] = {}
        for name, tensor in self.file.tensors.items():
            if len(tensor.shape) == 3 and ".experts." in name:
                head, _, tail = name.partition(".experts.")
                for e in range(int(tensor.shape[2])):
                    self._experts[f"{head}.experts.{e}.{tail}"] = (name, e)
        self._stacked = {base for base, _ in self._experts.values()}

    def names(self) -> set[str]:
        return (set(self.file.tensors) - self._stacked) | set(self._experts)

    def tensor_table(self) -> dict[str, tuple[int, int, int | None]]:
        table = {}
        for name, t in self.file.tensors.items():
            qtype = None if int(t.tensor_type) in DENSE_DTYPES else int(t.tensor_type)
            table[name] = (int(t.n_elements), int(t.n_bytes), qtype)
        for name, (base, _) in self._experts.items():
            numel, stored, qtype = table[base]
            experts = int(self.file.tensors[base].shape[2])
            table[name] = (numel // experts, stored // experts, qtype)
        for base in self._stacked:
            del table[base]
        return table

    def _source(self, name: str) -> tuple[np.ndarray, int, tuple[int, ...]]:
        """(data, GGML type, shape (N, K) or (K,)) of tensor `name`, an expert's a slice of
        its stacked tensor's rows (a view of the map)."""
        stacked = self._experts.get(name)
        tensor = self._tensor(name if stacked is None else stacked[0])
        # gguf shapes list ne0 (the elements of a row) first: (K, N) for a matrix.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if stacked is None:
            return tensor.data, int(tensor.tensor_type), shape
        rows = shape[1]
        data = tensor.data.reshape(-1, tensor.data.shape[-1])  # (experts * N, row)
        return data[stacked[1] * rows : (stacked[1] + 1) * rows], int(tensor.tensor_type), shape[1:]

    def read(self, name: str, split: Split, shard: Shard) -> Part:
        data, qtype, shape = self._source(name)
        if qtype in DENSE_DTYPES:
            dense = _dense_view(data, qtype, shape)
            shift = self.file.family.gguf_norm_shift
            if shift and name.endswith("norm.weight"):  # llama.cpp stored Gemma's 1 + w
                dense = dense.float() - shift
            part = slice_dense(dense, shape, split, shard)
            return self._unpermute(name, part) if split is not Split.ROW else part
        if qtype not in QUANTIZED_TYPES:
            dense = _dequantized_fallback(name, data, qtype, shape)
            part = slice_dense(dense, shape, split, shard)
            return self._unpermute(name, part) if split is not Split.ROW else part
        rows = torch.from_numpy(data)  # (N, row bytes) uint8, the map itself
        blocks = GGMLWeight(rows, qtype, shape[1])
        if split is Split.NONE or shard.size == 1:
            return self._unpermute(name, blocks)
        if split is Split.COLUMN:
            start, stop = shard.span(shape[0])
            return self._unpermute(name, GGMLWeight(rows[start:stop], qtype, shape[1]))
        part = _column_blocks(name, blocks, shard)
        self.release([blocks])
        return part

    def release(self, parts: list[Part]) -> None:
        """Drop this process's pages of these views of the map, once their bytes have been
        copied (a permuted or fused copy): RSS then counts the copy only. The mapping is
        private and never written, so a page read again is read from the file."""
        memory = self.file.reader.data
        for part in parts:
            pages = self.mapped_pages(part)
            if pages is not None:
                memory._mmap.madvise(mmap.MADV_DONTNEED, pages[0] - memory.ctypes.data, pages[1])

    def mapped_pages(self, part: Part) -> tuple[int, int] | None:
        """(address, bytes) of the whole pages of the map inside `part`; None for a part that
        is no contiguous view of the map (a copy) or holds no whole page."""
        memory = self.file.reader.data
        base, size = memory.ctypes.data, memory.nbytes
        data = part.data if isinstance(part, GGMLWeight) else part
        start = data.data_ptr() - base
        if not 0 <= start < size or not data.is_contiguous():
            return None
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside it only
        last = (start + data.numel() * data.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
        return (base + first, last - first) if last > first else None

    def row_reader(self, part: Part) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Rows of a block-format view of the map, read with `os.pread` (from the page
        cache) instead of through the map. A row read through the map brings the whole
        page-cache folio around it into this process's RSS (0.2-0.5 MiB a lookup measured,
        on a kernel with large folios), so an embedding's lookups would grow RSS toward the
        whole vocabulary; read, they leave none of it there."""
        memory = self.file.reader.data
        data = part.data if isinstance(part, GGMLWeight) else None
        if data is None or part.interleaved or not data.is_contiguous():
            return None
        start = data.data_ptr() - memory.ctypes.data
        if not 0 <= start < memory.nbytes:
            return None  # not a view of the map (a copy)
        return _FileRows(self.file.path, start, data.shape[0], data.shape[1])

    def rope_factors(self) -> torch.Tensor | None:
        """llama.cpp's `rope_freqs.weight` (head_dim / 2,) fp32, or None: the divisor of each
        rope frequency that llama 3.x's scaling gives (convert_hf_to_gguf.py writes it in
        place of the config's `rope_scaling`, which the GGUF's metadata then lacks)."""
        tensor = next((t for t in self.file.reader.tensors if t.name == "rope_freqs.weight"), None)
        if tensor is None:
            return None
        return torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(-1)

    def rope_scaling(self) -> dict | None:
        """The rope scaling a GGUF states in its metadata and tensors, in transformers'
        `rope_scaling` form, or None. Linear (`rope.scaling.type`, e.g. Gemma 3 4B and up:
        8, on the global layers) and LongRoPE (a Phi-3 file's `rope_factors_short` /
        `rope_factors_long` tensors, original context and attention factor): transformers'
        GGUF config keeps neither, llama.cpp applies both."""
        tensors = {t.name: t for t in self.file.reader.tensors}
        short, long = (
            tensors.get("rope_factors_short.weight"),
            tensors.get("rope_factors_long.weight"),
        )
        arch = self.file.architecture
        if short is None or long is None:
            kind = self.file.reader.fields.get(f"{arch}.rope.scaling.type")
            factor = float(self.file.field(f"{arch}.rope.scaling.factor", 1.0))
            if kind == "linear" and factor != 1.0:
                return {"rope_type": "linear", "factor": factor}
            return None
        return {
            "rope_type": "longrope",
            "short_factor": np.array(short.data, dtype=np.float32).reshape(-1).tolist(),
            "long_factor": np.array(long.data, dtype=np.float32).reshape(-1).tolist(),
            "original_max_position_embeddings": int(
                self.file.field(f"{arch}.rope.scaling.original_context_length")
            ),
            "attention_factor": float(self.file.field(f"{arch}.rope.scaling.attn_factor", 1.0)),
        }

    def _tensor(self, name: str):
        tensor = self.file.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.file.path} has no tensor for {name!r}.")
        return tensor

    def _unpermute(self, name: str, part: Part) -> Part:
        """HF's row order for llama Q/K rows (see gguf_file); other tensors as they are."""
        if not self.file.permutes_qk or not (".q_proj." in name or ".k_proj." in name):
            return part
        heads = self.file.num_heads if ".q_proj." in name else self.file.num_kv_heads
        head_dim = int(self._tensor(name).shape[-1]) // heads  # the file's rows (ne1) / heads
        if isinstance(part, GGMLWeight):
            rows = _permute_rows(part.data, part.out_features // head_dim)
            permuted = GGMLWeight(rows, part.qtype, part.in_features)
        else:
            permuted = _permute_rows(part, part.shape[0] // head_dim)
        self.release([part])
        return permuted


class _FileRows:
    """Reads rows of a (rows, row bytes) tensor at byte `offset` of a file: one `os.pread`
    a row into a (T, row bytes) uint8 tensor. The file stays open as long as this does."""

    def __init__(self, path: os.PathLike[str], offset: int, rows: int, row_bytes: int) -> None:
        self.path, self.offset, self.rows, self.row_bytes = path, offset, rows, row_bytes
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((ids.numel(), self.row_bytes), dtype=torch.uint8)
        rows = out.numpy()
        for i, row in enumerate(ids.tolist()):
            if not 0 <= row < self.rows:
                raise IndexError(f"row {row} of a {self.rows}-row tensor")
            read = os.preadv(self._fd, [rows[i]], self.offset + row * self.row_bytes)
            if read != self.row_bytes:
                raise ModelLoadError(f"{self.path}: short read of row {row} ({read} bytes).")
        return out

    def __del__(self) -> None:
        if hasattr(self, "_fd"):  # not when os.open failed
            os.close(self._fd)


def _permute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`reverse_rope_permute` of a tensor's rows (N, ...), a contiguous copy made by numpy,
    one row at a time. torch's indexed copy of 8- and 16-bit elements runs as an OpenMP
    region (SmolLM2's Q4_1 Q rows, 576 x 360 bytes: 0.23 ms of CPU a weight on one thread;
    on two threads of a loaded machine 4 ms, spinning, and the embedded model's load spent
    0.5 s of CPU there); numpy takes 0.03 ms."""
    if rows.dtype == torch.bfloat16:  # numpy has no bf16: moved as its 16 bits
        return _permute_rows(rows.view(torch.int16), num_heads).view(torch.bfloat16)
    return torch.from_numpy(reverse_rope_permute(rows.numpy(), num_heads))


def _dense_view(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense GGUF tensor as a torch view of the map, in its own dtype."""
    if qtype == GGMLType.BF16:  # gguf-py maps BF16 as raw bytes
        return torch.from_numpy(data.view(np.uint8)).view(torch.bfloat16).view(shape)
    return torch.from_numpy(data).view(shape)


def _dequantized_fallback(
    name: str, data: np.ndarray, qtype: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """A block type the GGML kernels do not run (IQ*, TQ*): dequantized to fp32 by gguf-py,
    with a warning naming the tensor (the documented fallback; its memory is fp32's)."""
    from gguf.quants import dequantize

    try:
        check_ggml_type(qtype, name)
    except UnsupportedGGMLType as exc:
        logger.warning("%s Dequantized to fp32 instead (4-8x its memory).", exc)
    values = dequantize(np.asarray(data), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).view(shape)


def _column_blocks(name: str, blocks: GGMLWeight, shard: Shard) -> Part:
    """Rank's input columns of a block tensor: whole blocks of each row, else dequantized."""
    import gguf

    block_size, block_bytes = block_shape(blocks.qtype)
    start, stop = shard.span(blocks.in_features)
    if start % block_size == 0 and stop % block_size == 0:
        first, last = start // block_size * block_bytes, stop // block_size * block_bytes
        return GGMLWeight(blocks.data[:, first:last].contiguous(), blocks.qtype, stop - start)
    logger.warning(
        "%s: rank %d's input columns %d:%d are not whole blocks of %d (%s); dequantized to "
        "fp32 for this rank",
        name,
        shard.rank,
        start,
        stop,
        block_size,
        gguf.GGMLQuantizationType(blocks.qtype).name,
    )
    return blocks.dequantize()[:, start:stop].contiguous()
