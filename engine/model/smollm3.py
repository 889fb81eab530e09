"""SmolLM3: Llama's layer, but every fourth layer rotates nothing (NoPE: HF's
`no_rope_layers`, 1 where a layer uses rope; llama.cpp's fixed step of 4 for a GGUF). Its
quantized layers run on Llama's fused CPU paths (model/llama.py), which skip the rotation."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM

NO_ROPE_LAYER_INTERVAL = 4


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(config)
    interval = config.get("no_rope_layer_interval") or NO_ROPE_LAYER_INTERVAL
    flags = config.get("no_rope_layers") or [
        int((i + 1) % interval != 0) for i in range(fields["num_layers"])
    ]
    return ModelArchConfig(
        **{**fields, "tie_word_embeddings": config.get("tie_word_embeddings", True)},
        rope_layers=tuple(bool(flag) for flag in flags),
    )


MODEL_CLASS = LlamaForCausalLM  # Llama's fused CPU paths take its NoPE layers
