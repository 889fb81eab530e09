"""Weight-only quantization of a loaded model: `quantize_model(model, "int4", gguf_file)`.

Every projection of every decoder layer (qkv, o, gate_up, down) becomes a `QuantizedLinear`
with the kernels package's int8 or int4 kernel; the output projection (the tied embedding on
the embedded model) becomes int8 in both modes: it is the largest matrix (49,152 x 576),
stored as Q8_0 in the embedded GGUF, and int4 there costs quality the benchmark shows. The
embedding lookup and the norms keep the model's dtype.

int4 from a GGUF file whose projections are Q4_0/Q4_1 takes the file's own blocks (group
32; the Q/K rows un-permuted as the converter does): the weights are the ones llama.cpp
runs, not a requantization. Other checkpoints are quantized to the same format (groups of
32, min/max, round to nearest).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
from torch import nn

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.gguf_convert import gguf_to_hf_name, reverse_rope_permute
from agentrt.engine.model.parallel import shard_int4_blocks
from agentrt.kernels.quantized_linear import (
    COMPUTE_DTYPE,
    Int4Weight,
    int4_linear,
    int8_linear,
    pack_int4,
    quantize_int4,
    quantize_int8,
)

# GGML type ids (gguf.GGMLQuantizationType) of the blocks read as they are, and their bytes.
_Q4_0, _Q4_1 = 2, 3
_BLOCK_BYTES = {_Q4_0: 18, _Q4_1: 20}
# "int4+dense": steps of more rows than this run the dense weights. Measured on 2 cores, a
# decode step of the embedded model for n requests, int4 + the fused glue vs fp32 + torch's
# (ms): 16: 52.6 vs 67.5, 24: 76.3 vs 78.5, 32: 100.7 vs 91.2, 64: 188.5 vs 150.9.
DENSE_ABOVE_ROWS = 24
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held as int8 (per channel) or int4 (groups): the input is
    rounded to bf16 for torch's kernel and the output cast back to the input's dtype."""

    def __init__(self, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None, mode: str):
        super().__init__()
        self.mode = mode
        if mode == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(COMPUTE_DTYPE))
            self.out_features = q.shape[0]
        elif mode == "int4":
            int4 = weight if isinstance(weight, Int4Weight) else quantize_int4(weight)
            self.group_size = int4.group_size
            packed, scales_and_zeros = pack_int4(int4)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", scales_and_zeros)
            self.out_features = int4.q.shape[0]
        else:
            raise ValueError(f"unknown quantization mode {mode!r}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (T, K)
        if self.mode == "int8":
            out = int8_linear(flat, self.qweight, self.scales)
        else:
            out = int4_linear(flat, self.qweight, self.scales, self.group_size)
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) bf16, contiguous -> (T, N) bf16: the kernel alone, without the casts and
        checks of `forward` (the fused CPU path, llama.py, hands it what it takes; no bias)."""
        if self.mode == "int8":
            return _INT8_MM(x, self.qweight, self.scales)
        return _INT4_MM(x, self.qweight, self.group_size, self.scales)


def quantize_model(
    model: nn.Module,
    mode: str,
    gguf_file: str | os.PathLike[str] | None = None,
    *,
    tp: tuple[ModelArchConfig, int, int] | None = None,
) -> None:
    """Replace the model's projections by `QuantizedLinear`s in place (see the module doc);
    "int4+dense" keeps the dense projections and puts the int4 ones beside them
    (`layer.quantized`, `model.dense_above_rows`; llama.py picks per step).
    `gguf_file`: the GGUF the checkpoint was converted from, whose Q4 blocks int4 reads.
    `tp`: (full arch, rank, size) when `model` is one tensor-parallel rank's shard: the
    file's blocks are then read for the full model and sliced like the weights."""
    keep_dense = mode == "int4+dense"
    kernel_mode = "int4" if keep_dense else mode
    blocks = {}
    if kernel_mode == "int4" and gguf_file:
        full_arch, rank, size = tp or (model.cfg, 0, 1)
        blocks = shard_int4_blocks(
            read_gguf_int4_blocks(gguf_file, full_arch), full_arch, rank, size
        )
    for i, layer in enumerate(model.layers):
        quantized = {}
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            linear = getattr(layer, name)
            weight = blocks.get((i, name), linear.weight)
            quantized[name] = QuantizedLinear(weight, linear.bias, kernel_mode)
            if not keep_dense:
                setattr(layer, name, quantized[name])
        if keep_dense:
            layer.quantized = nn.ModuleDict(quantized)
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    model.logits_proj = QuantizedLinear(head.weight, None, "int8")
    if keep_dense:
        model.dense_above_rows = DENSE_ABOVE_ROWS


def resolve_quantization(
    requested: str, dtype: str | torch.dtype, device: str, gguf_file: os.PathLike | None
) -> str:
    """`requested`, with "auto" made concrete: "int4+dense" when the model is a GGUF whose
    layer projections are all Q4_0/Q4_1 (int4 then runs the file's own weights), it runs on
    the CPU and `dtype` is "auto" too (a dtype asked for by name means those weights,
    exactly); else "none"."""
    if requested != "auto":
        return requested
    if dtype != "auto" or device != "cpu" or gguf_file is None:
        return "none"
    return "int4+dense" if _q4_projections(gguf_file) else "none"


def _gguf_reader(gguf_file: str | os.PathLike[str]):
    """The file's GGUFReader, parsed once per process (parsing the metadata, a 49k-token
    vocabulary included, takes ~2 s; the tensors stay memory-mapped)."""
    stat = os.stat(gguf_file)
    return _cached_reader(str(gguf_file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def _q4_projections(gguf_file: os.PathLike) -> bool:
    try:
        reader = _gguf_reader(gguf_file)
    except (ValueError, OSError):
        return False  # loading the model reports it
    projections = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    kinds = {
        int(t.tensor_type)
        for t in reader.tensors
        if t.name.startswith("blk.") and t.name.split(".")[-2] in projections
    }
    return bool(kinds) and kinds <= set(_BLOCK_BYTES)


def read_gguf_int4_blocks(
    gguf_file: str | os.PathLike[str], arch
) -> dict[tuple[int, str], Int4Weight]:
    """The Q4_0 / Q4_1 projections of a GGUF file as `Int4Weight`s, keyed (layer, fused
    projection name); empty when any part of a fused projection is stored otherwise."""
    try:
        reader = _gguf_reader(gguf_file)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{gguf_file} is not a readable GGUF file: {exc}") from exc
    is_llama = reader.fields["general.architecture"].contents() == "llama"
    parts: dict[str, Int4Weight] = {}
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        if kind not in _BLOCK_BYTES or not tensor.name.endswith(".weight"):
            continue
        weight = _unpack_q4(np.asarray(tensor.data), kind)
        if is_llama and ".attn_q." in tensor.name:
            weight = _permute_rows(weight, arch.num_heads)
        elif is_llama and ".attn_k." in tensor.name:
            weight = _permute_rows(weight, arch.num_kv_heads)
        parts[gguf_to_hf_name(tensor.name)] = weight
    fused = {
        "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "o_proj": ("self_attn.o_proj",),
        "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "down_proj": ("mlp.down_proj",),
    }
    blocks = {}
    for i in range(arch.num_layers):
        for name, members in fused.items():
            found = [parts.get(f"model.layers.{i}.{m}.weight") for m in members]
            if any(w is None for w in found):
                return {}  # a mixed file: quantize everything the same way instead
            blocks[(i, name)] = Int4Weight(
                torch.cat([w.q for w in found]),
                torch.cat([w.scale for w in found]),
                torch.cat([w.min for w in found]),
            )
    return blocks


def _unpack_q4(data: np.ndarray, kind: int) -> Int4Weight:
    """Raw GGUF rows (N, K / 32 * block bytes) uint8 -> Int4Weight with groups of 32.
    A block: fp16 d, (Q4_1: fp16 m,) 16 bytes whose low nibbles are elements 0-15 and high
    nibbles 16-31; Q4_1 is q * d + m, Q4_0 (q - 8) * d."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, _BLOCK_BYTES[kind])  # (N, groups, bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == _Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8 * d
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (N, groups, 32)
    return Int4Weight(
        torch.from_numpy(q.reshape(n, -1).copy()), torch.from_numpy(d), torch.from_numpy(m)
    )


def _permute_rows(weight: Int4Weight, num_heads: int) -> Int4Weight:
    """llama.cpp's Q/K row order back to HF's (rows carry their quantized groups along)."""
    q, scale, lo = (
        torch.from_numpy(reverse_rope_permute(t.numpy(), num_heads))
        for t in (weight.q, weight.scale, weight.min)
    )
    return Int4Weight(q.contiguous(), scale.contiguous(), lo.contiguous())
