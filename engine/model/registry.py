"""Model families: which module runs a checkpoint, found from its config or GGUF metadata.

vLLM's model registry: one `ModelFamily` per family, keyed by the names checkpoints carry:

    HF config.json `architectures`   "Gemma3ForCausalLM"  -> family_for_hf(config)
    GGUF `general.architecture`      "gemma3"             -> family_for_gguf("gemma3")
    GGUF config `model_type`         "gemma3"             -> (the HF class of a GGUF's config)

Each family's math lives in its own module under engine/model/ (`module`), which reads the
family's config into a `ModelArchConfig` (`arch_config`) and names the model class that runs
it (`MODEL_CLASS`); imported only when a model is built. This table stays free of torch:
resolving a checkpoint reads it without importing the model stack.

`gguf_tensor_names` maps llama.cpp's per-block tensor names (gguf-py's `TENSOR_NAMES`,
`blk.{i}.<name>`) to the HF parameter under `model.layers.{i}.`; the global ones
(`token_embd`, `output_norm`, `output`) are the same for every family.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from agentrt.engine.errors import ModelLoadError

# llama.cpp's names of the blocks every llama-style family shares.
LLAMA_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORM_NAMES: Mapping[str, str] = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 2/3: a norm before and after attention and before and after the MLP. llama.cpp's
# `ffn_norm` is the pre-MLP norm, HF's `post_attention_layernorm` the norm of attention's
# output.
SANDWICH_NORM_NAMES: Mapping[str, str] = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


# A sparse MoE's router and its 3-D expert tensors (one expert's rows after another): the
# GGUF loader serves them under HF's per-expert names (`mlp.experts.{e}.gate_proj`, ...).
MOE_NAMES: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One family of decoder models. `gguf_permutes_qk`: llama.cpp stores the family's Q/K
    rows in its own rope order (undone on load); `gguf_norm_shift`: llama.cpp stored the
    norm weights plus this (Gemma's `1 + w` norms), subtracted again on load."""

    name: str
    module: str  # under agentrt.engine.model
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    gguf_tensor_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_BLOCK_NAMES)
    gguf_permutes_qk: bool = False
    gguf_norm_shift: float = 0.0

    def load(self) -> ModuleType:
        """The family's module: `arch_config(config) -> ModelArchConfig`, `MODEL_CLASS`."""
        return importlib.import_module(f"agentrt.engine.model.{self.module}")


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "llama",
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"),
        ("llama",),  # llama.cpp stores Mistral and Mixtral models as llama
        gguf_tensor_names={**LLAMA_BLOCK_NAMES, **MOE_NAMES},  # MoE: Mixtral
        gguf_permutes_qk=True,
    ),
    ModelFamily("qwen2", "qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    ModelFamily(
        "qwen3",
        "qwen3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        gguf_tensor_names={**LLAMA_BLOCK_NAMES, **QK_NORM_NAMES},
    ),
    ModelFamily(
        "qwen3moe",
        "qwen3moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3moe",),
        gguf_tensor_names={
            **{k: v for k, v in LLAMA_BLOCK_NAMES.items() if not k.startswith("ffn_")},
            "ffn_norm": "post_attention_layernorm",
            **QK_NORM_NAMES,
            **MOE_NAMES,
        },
    ),
    ModelFamily(
        "phi3",
        "phi3",
        ("Phi3ForCausalLM",),
        ("phi3",),
        gguf_tensor_names={
            **LLAMA_BLOCK_NAMES,
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate and up rows, as HF stores them
        },
    ),
    # llama.cpp's converter treats both as Llama (Q/K rows permuted).
    ModelFamily("smollm3", "smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), gguf_permutes_qk=True),
    ModelFamily("granite", "granite", ("GraniteForCausalLM",), ("granite",), gguf_permutes_qk=True),
    ModelFamily(
        "olmo2",
        "olmo2",
        ("Olmo2ForCausalLM",),
        ("olmo2",),
        gguf_tensor_names={
            **{k: v for k, v in LLAMA_BLOCK_NAMES.items() if k not in ("attn_norm", "ffn_norm")},
            **QK_NORM_NAMES,
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
    ModelFamily(
        "gemma2",
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        gguf_tensor_names={**LLAMA_BLOCK_NAMES, **SANDWICH_NORM_NAMES},
        gguf_norm_shift=1.0,
    ),
    ModelFamily(
        "gemma3",
        "gemma3",
        ("Gemma3ForCausalLM",),
        ("gemma3",),
        gguf_tensor_names={**LLAMA_BLOCK_NAMES, **QK_NORM_NAMES, **SANDWICH_NORM_NAMES},
        gguf_norm_shift=1.0,
    ),
)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.hf_architectures)
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.gguf_architectures)
# A GGUF config's `model_type` (transformers' GGUF mapping) -> the HF class config.json names.
MODEL_TYPE_TO_ARCHITECTURE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def family_for_hf(config: Mapping[str, Any], *, source: object = "config") -> ModelFamily:
    """The family of an HF config (its `architectures`); raises `ModelLoadError` listing the
    supported classes."""
    names = config.get("architectures") or []
    for family in FAMILIES:
        if any(name in family.hf_architectures for name in names):
            return family
    raise ModelLoadError(
        f"{source}: architecture {names or 'missing'} is not supported; agentrt runs "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (the `architectures` field of config.json)."
    )


def family_for_gguf(architecture: str, *, source: object = "GGUF file") -> ModelFamily:
    """The family of a GGUF `general.architecture`; raises `ModelLoadError` listing the
    supported ones."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    raise ModelLoadError(
        f"GGUF architecture {architecture!r} in {source} is not supported; supported GGUF "
        f"architectures: {', '.join(GGUF_ARCHITECTURES)}."
    )


def model_class(family: str) -> type:
    """The model class of the family named `family` (`ModelArchConfig.family`)."""
    for entry in FAMILIES:
        if entry.name == family:
            return entry.load().MODEL_CLASS
    raise ModelLoadError(f"no model family {family!r}; known: {[f.name for f in FAMILIES]}")
