"""Qwen3: Llama's layer with an RMSNorm on each query and key head before RoPE, and a
head_dim of its own (not hidden / heads)."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    return ModelArchConfig(**{**common_fields(config), "qk_norm": True})


# Llama's math with q/k norms per head, which the fused C paths apply (rope_qkv, in fp32).
MODEL_CLASS = LlamaForCausalLM
