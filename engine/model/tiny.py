"""Tiny random-weight checkpoints of every supported architecture, for tests and demos.

Built with transformers' own model classes and saved with `save_pretrained`, so they are
exactly what a user's HF checkpoint looks like, only small (about 3.5M parameters, almost
all in the 49,152-row embedding). Each architecture exercises what makes it different:

    arch      class               tied  extras
    llama     LlamaForCausalLM    yes   rope_type "llama3" scaling (original context 64)
    qwen2     Qwen2ForCausalLM    no    q/k/v projection biases
    qwen3     Qwen3ForCausalLM    yes   q/k RMSNorm; head_dim 32 != hidden / heads (16)
    mistral   MistralForCausalLM  no    sliding_window None (plain causal attention)

Shared: hidden 64, 2 layers, 4 query heads, 2 KV heads, intermediate 128, and the
tokenizer (vocab 49,152, ChatML template) of the embedded SmolLM2 unless told otherwise.
HF initialises norms to one and biases to zero, which would hide a model that ignores
them, so every norm weight and bias is perturbed too. Same seed, same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.checkpoint import resolve_model
from agentrt.engine.loader.tokenizer import load_tokenizer

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    # Larger than HF's 0.02 so logits are peaked: greedy tokens are then not near-ties that
    # flip under harmless reordering of float sums (engine vs HF comparisons).
    "initializer_range": 0.2,
}
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": {
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        # Wavelengths of head_dim 16 span 6 .. 2e4 positions; an original context of 64
        # puts some frequencies in each llama3 band (kept, interpolated, scaled by 1/8).
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {"tie_word_embeddings": False, "rope_theta": 1000000.0},
    "qwen3": {"tie_word_embeddings": True, "rope_theta": 1000000.0, "head_dim": 32},
    "mistral": {"tie_word_embeddings": False, "rope_theta": 10000.0, "sliding_window": None},
}


def tiny_config(arch: str, *, vocab_size: int, bos_token_id: int, eos_token_id: int) -> Any:
    """The transformers config of the tiny `arch` model (see the module table)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
    }
    if arch not in config_classes:
        raise ModelLoadError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    kwargs = {**_COMMON, **_PER_ARCH[arch]}
    config = config_classes[arch](
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        **kwargs,
    )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def make_tiny_checkpoint(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a tiny random `arch` checkpoint (fp32 safetensors + tokenizer) to `path`.

    `tokenizer_from` is a checkpoint directory whose tokenizer is copied; None uses the
    embedded SmolLM2 one (converting the embedded model once if needed). The model's
    vocab_size is the tokenizer's length. Does not touch the global torch RNG.
    Returns `path`, which is created if needed (existing files are overwritten).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in TINY_ARCHS:
        raise ModelLoadError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHS}")
    source = Path(tokenizer_from) if tokenizer_from is not None else resolve_model(None)
    tokenizer = load_tokenizer(source)
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=0.1)  # around 1
                elif name.endswith(".bias"):
                    param.copy_(torch.randn_like(param) * 0.1)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    return out
