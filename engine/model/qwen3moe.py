"""Qwen3-MoE: Qwen3's attention (q/k norms per head) and a sparse MoE MLP in every layer
(model/moe.py): top-k of `num_experts`, the chosen weights renormalised
(`norm_topk_prob`, on in Qwen3-MoE's releases and in llama.cpp's qwen3moe)."""

from __future__ import annotations

from typing import Any

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.llama import LlamaForCausalLM


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    fields = common_fields({"intermediate_size": 0, **config})  # a GGUF's has none
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ModelLoadError(
            f"{fields['architecture']} with dense layers among the sparse ones "
            "(mlp_only_layers / decoder_sparse_step) is not supported yet."
        )
    return ModelArchConfig(
        **{**fields, "qk_norm": True},
        # Released configs say num_experts; transformers 5 saves it as num_local_experts.
        num_experts=config.get("num_experts") or config["num_local_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", True),
    )


# Qwen3's layer (Llama's math with q/k norms per head) with SiLU experts: on the CPU the
# one-call C decoder runs it, its MLP one call of model/moe.py's expert kernel a layer.
MODEL_CLASS = LlamaForCausalLM
