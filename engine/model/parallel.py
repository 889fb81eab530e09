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
`shard_arch`'s smaller head and intermediate counts (hidden size unchanged) whose weights
the loader reads as this rank's slices only (engine/loader/weights.py names each
parameter's split); its KV cache holds its own KV heads only.

The embedding, the final norm and the LM head are replicated, not vocab-parallel: only
rank 0 samples, so only rank 0 computes logits and the workers never run the LM head. A
vocab-parallel head would split that matmul across ranks but add a gather of (S, vocab)
logits every step, and a vocab-parallel embedding an all-reduce of (T, hidden) per step; on
the embedded model the head is 28M of 135M parameters, a memory cost each rank can afford.
"""

from __future__ import annotations

import dataclasses

from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import ModelArchConfig


def check_tensor_parallel(arch: ModelArchConfig, size: int) -> None:
    """Raise `ConfigError` unless `arch` splits into `size` ranks: query heads, KV heads and
    the MLP's intermediate size must all divide by it. (Block-format weights whose
    row-parallel slice is not whole blocks are dequantized for that rank: gguf_loader.py.)"""
    if size == 1:
        return
    if arch.fused_projections:
        raise ConfigError(
            f"tensor_parallel_size={size}: {arch.architecture} stores q/k/v and gate/up as one "
            "matrix each, which agentrt does not split between ranks yet; use 1."
        )
    if arch.num_experts:
        raise ConfigError(
            f"tensor_parallel_size={size}: {arch.architecture}'s experts are not split "
            "between ranks yet; use 1."
        )
    if arch.qk_norm and not arch.qk_norm_per_head:
        raise ConfigError(
            f"tensor_parallel_size={size}: {arch.architecture} normalises q and k over all "
            "heads at once, which agentrt does not split between ranks yet; use 1."
        )
    counts = (arch.num_heads, arch.num_kv_heads, arch.intermediate_size)
    if any(c % size for c in counts):
        allowed = [n for n in range(1, arch.num_kv_heads + 1) if not any(c % n for c in counts)]
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide the model's heads: it has "
            f"{arch.num_heads} query heads and {arch.num_kv_heads} KV heads (intermediate size "
            f"{arch.intermediate_size}), and each rank must hold the same number of each. "
            f"Allowed sizes for this model: {', '.join(map(str, allowed))}."
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
