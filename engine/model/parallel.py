"""Tensor-parallel sharding of a Llama-family model (Megatron's layout, as vLLM runs it).

Each of N ranks holds one slice of every decoder layer:

    qkv_proj      column-parallel: its query heads H / N and KV heads KVH / N (rows of
                  q_proj, k_proj, v_proj, and their biases)
    o_proj        row-parallel: the input columns of its query heads -> a partial sum
    gate_up_proj  column-parallel: intermediate columns I / N of gate_proj and of up_proj
    down_proj     row-parallel: the matching input columns -> a partial sum

so attention and the MLP run on local heads and columns without communication, and one
all-reduce after o_proj and one after down_proj (in `DecoderLayer.forward`) turn the partial
sums into the layer's output on every rank. A rank's model is therefore a Llama with
`shard_arch`'s smaller head and intermediate counts (hidden size unchanged) and loads
`shard_state_dict`'s slices through the usual `load_hf_state_dict`; its KV cache holds its
own KV heads only.

The embedding, the final norm and the LM head are replicated, not vocab-parallel: only
rank 0 samples, so only rank 0 computes logits and the workers never run the LM head. A
vocab-parallel head would split that matmul across ranks but add a gather of (S, vocab)
logits every step, and a vocab-parallel embedding an all-reduce of (T, hidden) per step; on
the embedded model the head is 28M of 135M parameters, a memory cost each rank can afford.
"""

from __future__ import annotations

import dataclasses

import torch

from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.kernels.quantized_linear import Int4Weight

INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block (quantization.py's groups)


def check_tensor_parallel(arch: ModelArchConfig, size: int, quantization: str = "none") -> None:
    """Raise `ConfigError` unless `arch` splits into `size` ranks: query heads, KV heads and
    the MLP's intermediate size must all divide by it; with int4 weights, each rank's input
    columns of the row-parallel projections must be whole groups (the groups, and a GGUF's
    own Q4 blocks, are then split between ranks as they are)."""
    if size == 1:
        return
    counts = (arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
    if any(c % size for c in counts):
        allowed = [n for n in range(1, arch.num_kv_heads + 1) if not any(c % n for c in counts)]
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide the model's heads: it has "
            f"{arch.num_heads} query heads and {arch.num_kv_heads} KV heads (intermediate size "
            f"{arch.intermediate_size}), and each rank must hold the same number of each. "
            f"Allowed sizes for this model: {', '.join(map(str, allowed))}."
        )
    row_parallel_inputs = (arch.num_heads // size * arch.head_dim, arch.intermediate_size // size)
    if quantization.startswith("int4") and any(k % INT4_GROUP_SIZE for k in row_parallel_inputs):
        raise ConfigError(
            f"quantization='int4' with tensor_parallel_size={size} needs each rank's share of "
            f"o_proj and down_proj inputs ({row_parallel_inputs[0]} and "
            f"{row_parallel_inputs[1]} here) to be whole groups of {INT4_GROUP_SIZE}: use "
            "another size, or quantization='int8' or 'none'."
        )


def shard_arch(arch: ModelArchConfig, size: int) -> ModelArchConfig:
    """The architecture one rank of `size` runs: its share of the heads and MLP columns."""
    if size == 1:
        return arch
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // size,
        num_kv_heads=arch.num_kv_heads // size,
        intermediate_size=arch.intermediate_size // size,
    )


def shard_state_dict(
    state: dict[str, torch.Tensor], arch: ModelArchConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of an HF-named state dict (views, no copies); tensors that are
    not split (embedding, norms, LM head) are passed through."""
    if size == 1:
        return state
    d = arch.head_dim
    q_rows = arch.num_heads // size * d
    kv_rows = arch.num_kv_heads // size * d
    mlp_rows = arch.intermediate_size // size
    # (suffix, dim, slice size): dim 0 splits output rows, dim 1 input columns.
    splits = (
        ("self_attn.q_proj.weight", 0, q_rows),
        ("self_attn.q_proj.bias", 0, q_rows),
        ("self_attn.k_proj.weight", 0, kv_rows),
        ("self_attn.k_proj.bias", 0, kv_rows),
        ("self_attn.v_proj.weight", 0, kv_rows),
        ("self_attn.v_proj.bias", 0, kv_rows),
        ("self_attn.o_proj.weight", 1, q_rows),
        ("mlp.gate_proj.weight", 0, mlp_rows),
        ("mlp.up_proj.weight", 0, mlp_rows),
        ("mlp.down_proj.weight", 1, mlp_rows),
    )
    sharded = dict(state)
    for name, tensor in state.items():
        for suffix, dim, rows in splits:
            if name.startswith("model.layers.") and name.endswith(suffix):
                sharded[name] = tensor.narrow(dim, rank * rows, rows)
                break
    return sharded


def shard_int4_blocks(
    blocks: dict[tuple[int, str], Int4Weight], arch: ModelArchConfig, rank: int, size: int
) -> dict[tuple[int, str], Int4Weight]:
    """Rank `rank`'s slices of the fused int4 projections of the full model `arch` (as
    quantization.read_gguf_int4_blocks returns them): the same rows and columns as
    `shard_state_dict`, columns by whole groups (check_tensor_parallel ensures they are)."""
    if size == 1 or not blocks:
        return blocks
    d = arch.head_dim
    q, kv, mlp = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    # Output rows of each fused part (split per part) or input columns (dim 1).
    parts = {"qkv_proj": (0, (q, kv, kv)), "gate_up_proj": (0, (mlp, mlp))}
    parts |= {"o_proj": (1, (q,)), "down_proj": (1, (mlp,))}

    def take(t: torch.Tensor, dim: int, sizes: tuple[int, ...], unit: int) -> torch.Tensor:
        pieces = t.split([n // unit for n in sizes], dim)
        return torch.cat([p.chunk(size, dim)[rank] for p in pieces], dim).contiguous()

    sharded = {}
    for (layer, name), w in blocks.items():
        dim, sizes = parts[name]
        group = w.group_size if dim == 1 else 1  # scale/min have one column per group
        sharded[(layer, name)] = Int4Weight(
            take(w.q, dim, sizes, 1),
            take(w.scale, dim, sizes, group),
            take(w.min, dim, sizes, group),
        )
    return sharded
