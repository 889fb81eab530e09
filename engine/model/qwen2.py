"""Qwen2 (and Qwen2.5): Llama's layer with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    return ModelArchConfig(**{**common_fields(config), "qkv_bias": True})


# Llama's math with a bias, which the fused C paths add (rope_qkv, in fp32).
MODEL_CLASS = LlamaForCausalLM
