"""Granite 3.x (dense): Llama's layer with four multipliers: the embedding's rows, each
residual branch (attention's and the MLP's outputs), attention's scale (in place of
head_dim ** -0.5) and the logits (divided by `logits_scaling`)."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    return ModelArchConfig(
        **{**common_fields(config), "tie_word_embeddings": config.get("tie_word_embeddings", True)},
        embedding_scale=float(config.get("embedding_multiplier", 1.0)),
        residual_scale=float(config.get("residual_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)),
    )


MODEL_CLASS = LlamaForCausalLM  # its multipliers are in Llama's fused CPU paths
