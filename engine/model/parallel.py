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


def check_tensor_parallel(arch: ModelArchConfig, size: int, quantization: str = "none") -> None:
    """Raise `ConfigError` unless `arch` splits into `size` ranks: query heads, KV heads and
    the MLP's intermediate size must all divide by it. int4 weights are refused (their
    groups of 32 and a GGUF's own Q4 blocks are not split by rank)."""
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
    if quantization == "int4":
        raise ConfigError(
            f"quantization='int4' with tensor_parallel_size={size} is not supported: int4 "
            "groups (and a GGUF's own Q4 blocks) are not split across ranks. Use "
            "quantization='int8' or 'none' with tensor parallelism."
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
