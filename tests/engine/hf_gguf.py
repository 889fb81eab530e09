"""Tiny random HF transformers models of each family, written as llama.cpp-style GGUF files.

`write_family_gguf(family, path)` builds the family's tiny HF model (fp32, random weights,
norms perturbed around their init so a model that ignores one fails) and writes it with
gguf-py's GGUFWriter under llama.cpp's tensor names, as convert_hf_to_gguf.py does: llama's
Q/K rows permuted, Gemma's norms stored as 1 + w, projections and the embedding in Q8_0 (or
F32), norms F32. Every name written is checked against gguf-py's own per-architecture table
(`gguf.MODEL_TENSORS`), so the engine's name map is checked against llama.cpp's, not
against itself. The tokenizer is gguf_files' tiny one (TINY_VOCAB tokens).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from agentrt.engine.loader.gguf_file import GLOBAL_NAMES
from agentrt.engine.model.registry import FAMILIES

from .gguf_files import TINY_VOCAB, Q, _add_tokenizer, llama_cpp_permute

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,  # peaked logits: greedy tokens are not near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def family_of(name: str) -> str:
    """The registry family of a tiny config's name ("llama3": llama with llama3 rope)."""
    return {"llama3": "llama", "mixtral": "llama", "phi4": "phi3"}.get(name, name)


def hf_config(family: str) -> Any:
    """The tiny transformers config of `family`."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            **_COMMON, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=True
        )
    if family == "llama3":
        # Wavelengths of head_dim 16 span 6 .. 2e4 positions; an original context of 64 puts
        # some frequencies in each llama3 band (kept, interpolated, scaled by 1/8).
        return transformers.LlamaConfig(
            **_COMMON,
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "smollm3":  # layers 3 and 7 (every fourth) rotate nothing
        return transformers.SmolLM3Config(
            **_COMMON, num_hidden_layers=8, rope_theta=10000.0, tie_word_embeddings=True
        )
    if family == "olmo2":
        return transformers.Olmo2Config(
            **_COMMON, num_hidden_layers=2, rope_theta=500000.0, tie_word_embeddings=False
        )
    if family == "granite":
        return transformers.GraniteConfig(
            **_COMMON,
            num_hidden_layers=2,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.2,
            logits_scaling=8.0,
        )
    if family == "mixtral":  # llama.cpp's llama with 4 experts, top 2
        return transformers.MixtralConfig(
            **{**_COMMON, "intermediate_size": 32},
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(
            **_COMMON, num_hidden_layers=2, rope_theta=1000000.0, tie_word_embeddings=True
        )
    if family == "qwen3":  # q/k RMSNorm per head; head_dim not hidden / heads (as 0.6B's)
        return transformers.Qwen3Config(
            **{**_COMMON, "head_dim": 32},
            num_hidden_layers=2,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    if family == "qwen3moe":  # 4 experts, top 2, renormalised; head_dim as Qwen3's
        return transformers.Qwen3MoeConfig(
            **{**_COMMON, "head_dim": 32},
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        )
    if family == "phi3":
        # LongRoPE: positions within the original context (64) turn with the short factors,
        # past it with the long ones; cos and sin scaled by sqrt(1 + ln 8 / ln 64).
        half = _COMMON["head_dim"] // 2
        return transformers.Phi3Config(
            **{**_COMMON, "max_position_embeddings": 512},
            num_hidden_layers=2,
            tie_word_embeddings=False,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 2.0 * i for i in range(half)],
                "original_max_position_embeddings": 64,
            },
        )
    if family == "phi4":
        # Phi-4-mini's rope: the first 12 of each head's 16 dims turn (partial_rotary_factor
        # 0.75: its 96 of 128), LongRoPE's factors one per frequency of those; tied output.
        half = int(_COMMON["head_dim"] * 0.75) // 2
        return transformers.Phi3Config(
            **_COMMON,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 2.0 * i for i in range(half)],
                "original_max_position_embeddings": 64,
            },
        )
    if family == "gemma2":  # sliding and global layers alternate; scores and logits capped
        return transformers.Gemma2Config(
            **_COMMON,
            num_hidden_layers=4,
            sliding_window=8,
            query_pre_attn_scalar=16,
            rope_theta=10000.0,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        )
    if family == "gemma3":
        # Six layers: five sliding-window ones, then a global one (the family's pattern); a
        # window of 8 so prompts and decodes run past it.
        return transformers.Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=6,
            sliding_window=8,
            query_pre_attn_scalar=16,  # = head_dim: what llama.cpp assumes for a GGUF
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                # Gemma 3 4B and up scale the global layers' rope (llama.cpp: in metadata).
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
        )
    raise ValueError(f"no tiny config for {family!r}")


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny HF model, fp32, random weights (norms around their init, biases
    random: transformers initialises them to zero)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=0.1)
                elif name.endswith(".bias"):
                    param.normal_(0.0, 0.2)
    return model.eval()


def write_family_gguf(
    family: str, path: Path, *, qtype: int = Q.Q8_0, seed: int = 0
) -> tuple[Path, Any]:
    """The family's tiny model as a GGUF file at `path`; returns (path, its HF config)."""
    model = hf_model(family, seed)
    config = model.config
    entry = next(f for f in FAMILIES if f.name == family_of(family))
    arch = entry.gguf_architectures[0]
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_model_arch(arch)]}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if family != "qwen3moe":  # llama.cpp's converter writes key_length alone for it
        partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(int(config.head_dim * partial))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if family == "gemma2":
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
        writer.add_sliding_window(config.sliding_window)
    if family != "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    _add_tokenizer(writer)
    if family == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if family == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf.py's Phi3MiniModel
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        for kind in ("short", "long"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    block_names = {hf: name for name, hf in entry.gguf_tensor_names.items()}
    global_names = {hf: name for name, hf in GLOBAL_NAMES.items()}
    for hf_name, tensor in _gguf_order(model.state_dict()).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        if base.startswith("model.layers."):
            layer, _, part = base.removeprefix("model.layers.").partition(".")
            name = f"blk.{layer}.{block_names[part]}"
            assert name.replace(f"blk.{layer}.", "blk.{bid}.") in allowed, name
        else:
            name, part = global_names[base], ""
            assert name in allowed, name
        values = tensor.float().numpy()
        if entry.gguf_permutes_qk and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in part else config.num_key_value_heads
            values = llama_cpp_permute(values, heads)
        if entry.gguf_norm_shift and hf_name.endswith("norm.weight"):
            values = values + entry.gguf_norm_shift
        if values.ndim >= 2 and qtype != Q.F32:  # 3-D: a MoE's stacked experts
            blocks = gguf.quants.quantize(np.ascontiguousarray(values), qtype)
            writer.add_tensor(f"{name}.{suffix}", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, config


def llama3_rope_factors(config: Any) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` of a llama 3.x config: the divisor of each rope
    frequency under its scaling (the GGUF's metadata then states no scaling)."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _gguf_order(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with transformers' fused 3-D expert tensors (experts, 2I, H) split as
    llama.cpp stores them: gate_proj (experts, I, H), up_proj, down_proj (experts, H, I)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"{name}.weight"] = tensor
        else:
            out[name] = tensor
    return out


def hf_state(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """agentrt's HF-named state (load_state_dict: per-expert names) in transformers' own
    layout (each layer's experts stacked into 3-D tensors)."""
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)
    if not experts:
        return state
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."

        def stack(part: str, p=p) -> torch.Tensor:
            return torch.stack([state[f"{p}{e}.{part}.weight"] for e in range(experts)])

        out[f"{p}gate_up_proj"] = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        out[f"{p}down_proj"] = stack("down_proj")
    return out


def _model_arch(name: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)
