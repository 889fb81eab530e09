"""Gemma 3 (text): the decoder skeleton with Gemma's settings.

- interleaved local and global layers: five sliding-window layers, then one global
  (transformers' `layer_types`, or its `sliding_window_pattern`), each kind with its own rope
  (local theta 10,000; the global one may be scaled, e.g. linear x8 on 4B and up);
- q/k RMSNorm per head before RoPE, and norms before and after attention and the MLP
  (the "sandwich" layout); every RMSNorm multiplies by (1 + w);
- a GeGLU MLP (tanh-approximated GELU), embeddings scaled by sqrt(hidden), tied output;
- attention scaled by query_pre_attn_scalar ** -0.5.

llama.cpp's GGUF keeps none of the layer pattern, local theta or query scalar: they are its
fixed values for the family (set here as transformers' defaults are), and its norm weights
hold 1 + w (model/registry.py's `gguf_norm_shift`).
"""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelArchConfig,
    common_fields,
)
from agentrt.engine.model.llama import LlamaForCausalLM

SLIDING_WINDOW_PATTERN = 6  # every sixth layer is global
LOCAL_ROPE_THETA = 10000.0


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    local = dict((config.get("rope_parameters") or {}).get(SLIDING_ATTENTION) or {})
    local_theta = config.get("rope_local_base_freq", local.get("rope_theta", LOCAL_ROPE_THETA))
    return gemma_config(
        config,
        pattern=config.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN,
        layers_of_27b=62,
        qk_norm=True,
        local_rope_theta=float(local_theta),
        local_rope_scaling=local if local.get("rope_type", "default") != "default" else None,
    )


def gemma_config(
    config: dict[str, Any], *, pattern: int, layers_of_27b: int, **family: Any
) -> ModelArchConfig:
    """What Gemma 2 and 3 share: sandwich norms of 1 + w, GeGLU, sqrt(hidden) embeddings,
    tied output, local layers (all but every `pattern`-th) and query_pre_attn_scalar."""
    fields = common_fields(config)
    num_layers = fields["num_layers"]
    layer_types = tuple(
        config.get("layer_types")
        or (SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers))
    )
    # transformers' default is 256 (the small models' head_dim); llama.cpp's rule for a GGUF
    # (which stores no scalar): head_dim, but hidden / heads for the 27B.
    default_scalar = fields["head_dim"]
    if num_layers == layers_of_27b:
        default_scalar = fields["hidden_size"] // fields["num_heads"]
    scalar = config.get("query_pre_attn_scalar") or default_scalar
    return ModelArchConfig(
        **{
            **fields,
            "tie_word_embeddings": config.get("tie_word_embeddings", True),
            "qk_norm": family.pop("qk_norm", False),
        },
        norm_layout="sandwich",
        norm_offset=1.0,
        activation="gelu_tanh",
        embedding_scale=fields["hidden_size"] ** 0.5,
        attention_scale=float(scalar) ** -0.5,
        final_logit_softcap=config.get("final_logit_softcapping"),
        layer_types=layer_types,
        sliding_window=config.get("sliding_window"),
        **family,
    )


MODEL_CLASS = LlamaForCausalLM  # the skeleton with the fused CPU paths, which take its layer
