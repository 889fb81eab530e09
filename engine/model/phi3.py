"""Phi-3 / Phi-3.5 (mini, medium) and Phi-4-mini: Llama's layer with q/k/v in one stored
matrix and gate/up in another, and LongRoPE scaling (its short and long per-frequency factors,
cos and sin times an attention factor: model/rope.py). Phi-4-mini turns only the first 96 of
each head's 128 dims (`partial_rotary_factor` 0.75; a GGUF's `rope.dimension_count`, which
the loader writes as `rotary_dim`): its frequencies are a 96-dim head's.

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
    head_dim = fields["head_dim"]
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    rotary_dim = config.get("rotary_dim") or int(head_dim * partial)  # as transformers rounds
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelLoadError(
            f"{fields['architecture']}: rope over {rotary_dim} dims of heads of {head_dim}; "
            "expected an even number of them, at most the head's (partial_rotary_factor "
            "in (0, 1], or a GGUF's rope.dimension_count)."
        )
    scaling = fields["rope_scaling"]
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = longrope_scaling(
            scaling,
            config.get("original_max_position_embeddings"),
            fields["max_position_embeddings"],
        )
    return ModelArchConfig(
        **{**fields, "rope_scaling": scaling},
        fused_projections=True,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
    )


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
