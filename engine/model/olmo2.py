"""OLMo 2: no norms before attention or the MLP, one after each on its output (the "post"
layout, HF's post_attention / post_feedforward norms), and RMSNorm on q and k over all
heads at once (not per head) before RoPE."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    return ModelArchConfig(
        **{**common_fields(config), "qk_norm": True},
        norm_layout="post",
        qk_norm_per_head=False,
    )


MODEL_CLASS = LlamaForCausalLM  # the skeleton with the fused CPU paths, which take its layer
