"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Runs a flat varlen batch: `input_ids` and `positions` are (T,) for all requests of the
step back to back; attention reads and writes the paged KV cache through the metadata.
q/k/v and gate/up projections are fused into one matmul each; the math otherwise follows
transformers' implementation step for step so greedy decoding matches it token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.engine.attention import AttentionMetadata
from agentrt.engine.errors import ModelLoadError
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, scale in the model dtype (as HF Llama does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata, attention):
        num_tokens = hidden.shape[0]
        residual = hidden
        hidden = self.input_layernorm(hidden)
        q, k, v = self.qkv_proj(hidden).split(self.qkv_split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = attention.forward(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        hidden = residual + self.o_proj(attn.reshape(num_tokens, -1))
        residual = hidden
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden)).chunk(2, dim=-1)
        return residual + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attention,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary.tables(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta, attention)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) of the sampled positions -> logits (S, vocab) in fp32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), weight).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Every parameter must be
        filled and every checkpoint tensor used (rotary buffers excepted)."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r}.")
            used.add(name)
            return state[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = [f"{p}self_attn.{n}_proj" for n in "qkv"]
                torch.cat([take(f"{n}.weight") for n in attn], out=layer.qkv_proj.weight)
                if layer.qkv_proj.bias is not None:
                    torch.cat([take(f"{n}.bias") for n in attn], out=layer.qkv_proj.bias)
                layer.o_proj.weight.copy_(take(f"{p}self_attn.o_proj.weight"))
                if layer.q_norm is not None:
                    layer.q_norm.weight.copy_(take(f"{p}self_attn.q_norm.weight"))
                    layer.k_norm.weight.copy_(take(f"{p}self_attn.k_norm.weight"))
                gate_up = [take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")]
                torch.cat(gate_up, out=layer.gate_up_proj.weight)
                layer.down_proj.weight.copy_(take(f"{p}mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(take(f"{p}input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(f"{p}post_attention_layernorm.weight")
                )
        unused = sorted(k for k in state if k not in used and "rotary_emb" not in k)
        if self.lm_head is None and "lm_head.weight" in unused:
            unused.remove("lm_head.weight")  # tied checkpoints may still store it
        if unused:
            raise ModelLoadError(f"checkpoint has tensors the model does not use: {unused[:5]}")
