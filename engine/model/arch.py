"""ModelArchConfig: the architecture facts the model code needs, read from an HF config.json.

`from_hf_dict` finds the config's family (model/registry.py) and lets the family's module
read it (`arch_config`): the fields every decoder has come from `common_fields`, and the
family sets what makes it different (norm layout, activation, sliding-window layers, ...)
in the fields below them, whose defaults are Llama's. Accepts both the transformers 4.x
layout (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentrt.engine.model.registry import family_for_hf

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    # --- what families set (model/<family>.py); Llama's defaults ---
    family: str = "llama"
    # "pre": a norm before attention and before the MLP (Llama); "sandwich": also one after
    # each of them, on its output before the residual add (Gemma 2/3); "post": only those
    # after (OLMo 2).
    norm_layout: str = "pre"
    # q/k norms over each head (Qwen3, Gemma 3), or over all heads at once (OLMo 2).
    qk_norm_per_head: bool = True
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's is 1
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    embedding_scale: float = 1.0  # the embedding's rows times this (Gemma: sqrt(hidden))
    residual_scale: float = 1.0  # attention's and the MLP's outputs times this (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcap: float | None = None  # attention scores the same way (Gemma 2)
    # The checkpoint stores q/k/v as one matrix `self_attn.qkv_proj` and gate/up as one
    # `mlp.gate_up_proj` (Phi-3), not as their parts.
    fused_projections: bool = False
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION (empty: every layer full); sliding
    # layers attend to the last `sliding_window` positions and rotate with the local rope.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # A sparse MoE MLP in every layer when num_experts > 0 (model/moe.py).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Per layer whether it rotates q and k (empty: every layer): SmolLM3's NoPE layers.
    rope_layers: tuple[bool, ...] = ()
    # The dims of each head that turn, the first ones (None: all): Phi-4-mini's 96 of 128.
    rotary_dim: int | None = None

    @classmethod
    def from_hf_dict(cls, config: dict) -> ModelArchConfig:
        """The architecture of an HF config; raises `ModelLoadError` for an unsupported one."""
        return family_for_hf(config).load().arch_config(config)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types


def rope_settings(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling or None) of a config's global rope, in either transformers layout."""
    rope = dict(config.get("rope_parameters") or {})
    if FULL_ATTENTION in rope:  # per layer type (transformers 5's Gemma 3)
        rope = dict(rope[FULL_ATTENTION])
    scaling = config.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    return float(theta), dict(scaling) if scaling else None


def common_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `ModelArchConfig` fields every decoder family reads the same way."""
    family = family_for_hf(config)
    arch = next(a for a in config["architectures"] if a in family.hf_architectures)
    theta, scaling = rope_settings(config)
    num_heads = config["num_attention_heads"]
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return {
        "architecture": arch,
        "family": family.name,
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // num_heads,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": config.get("max_position_embeddings", 2048),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "qkv_bias": bool(config.get("attention_bias", False)),
        "qk_norm": False,
        "eos_token_ids": eos_ids,
    }
