"""Gemma 2: Gemma 3's layer (model/gemma3.py) without q/k norms, sliding-window and global
layers alternating (one rope for both), and soft-capped attention scores (50) and logits
(30). A GGUF stores neither cap where transformers reads it, so the family's values are
the defaults; the capped scores run through worker/windowed_attention.py's matrix products
(SDPA has no cap)."""

from __future__ import annotations

from typing import Any

from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.gemma3 import gemma_config
from agentrt.engine.model.llama import LlamaForCausalLM

ATTN_LOGIT_SOFTCAP, FINAL_LOGIT_SOFTCAP = 50.0, 30.0


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    config = {"final_logit_softcapping": FINAL_LOGIT_SOFTCAP, **config}
    return gemma_config(
        config,
        pattern=2,
        layers_of_27b=46,
        attn_logit_softcap=config.get("attn_logit_softcapping", ATTN_LOGIT_SOFTCAP),
    )


MODEL_CLASS = LlamaForCausalLM  # the skeleton with the fused CPU paths, which take its layer
