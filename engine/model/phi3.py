"""Phi-3 / Phi-3.5 (mini, medium): Llama's layer with q/k/v in one stored matrix and
gate/up in another, and LongRoPE scaling (its short and long per-frequency factors, cos and
sin times an attention factor: model/rope.py).

A GGUF keeps LongRoPE's factors as tensors (`rope_factors_short` / `rope_factors_long`) and
its original context and attention factor in metadata; the GGUF loader hands them to the
model (`rope_scaling`), as llama 3.x's `rope_freqs`. The fused matrices load as they are
(one part each), so the layer is Llama's math and runs Llama's fused CPU paths.
"""

from __future__ import annotations

import math
from typing import Any

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields(config)
    rope = dict(config.get("rope_parameters") or {})
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(
            f"{fields['architecture']} with partial_rotary_factor {partial} (Phi-4-mini's "
            "partial RoPE) is not supported yet; Phi-3 and Phi-3.5 models are."
        )
    scaling = fields["rope_scaling"]
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = longrope_scaling(
            scaling,
            config.get("original_max_position_embeddings"),
            fields["max_position_embeddings"],
        )
    return ModelArchConfig(**{**fields, "rope_scaling": scaling}, fused_projections=True)


def longrope_scaling(scaling: dict, original: int | None, max_positions: int) -> dict:
    """LongRoPE's settings completed as transformers completes them: the original context
    (a 4.x config keeps it beside rope_scaling) and the attention factor
    sqrt(1 + ln(factor) / ln(original)), factor max_positions / original unless given."""
    scaling = dict(scaling)
    original = scaling.setdefault("original_max_position_embeddings", original)
    if original is None:
        raise ModelLoadError("LongRoPE scaling without original_max_position_embeddings.")
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor") or max_positions / original
        scaling["attention_factor"] = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return scaling


MODEL_CLASS = LlamaForCausalLM
