"""The Llama family (Llama 2/3.x, SmolLM, Mistral): the decoder skeleton with Llama's math,
and the fused CPU paths that only that math fits.

On the CPU with quantized fp32 layers the model runner sets `cpu_ops`: the glue between a
layer's products then runs in three fused C calls (kernels/cpu_ops.c, `forward_fused`), and
when every projection is in block formats all layers run in one C call (`build_cpu_decoder`,
kernels/cpu_decoder.py). Both compute Llama's layer exactly: pre-norms, SiLU, RoPE (on every
layer but SmolLM3's NoPE layers), Granite's multipliers (the embedding's and logits' in
Python, the attention scale, each branch's output scaled as it joins the residual), and
optionally a qkv bias (Qwen2) and q/k RMSNorm per head (Qwen3), which rope_qkv applies in
fp32 to the qkv product's bf16 output; `runs_fused_glue` checks that before the runner may
set them, so a family of other math (its own module on the same skeleton) never takes them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import agentrt.kernels as kernels
from agentrt.engine.model.arch import ModelArchConfig, common_fields
from agentrt.engine.model.decoder import DecoderForCausalLM, DecoderLayer
from agentrt.engine.model.decoder import RMSNorm as RMSNorm  # re-exported for tests
from agentrt.engine.records import AttentionMetadata
from agentrt.kernels.cpu_decoder import CpuDecoder, LayerWeights, block_format
from agentrt.kernels.ggml_library import default_kernels


def arch_config(config: dict[str, Any]) -> ModelArchConfig:
    """A Llama / Mistral config.json. (Mistral's sliding window is not read: its released
    checkpoints set none, or one past their context.) A llama GGUF with experts is Mixtral:
    a sparse MoE MLP in every layer (model/moe.py), its experts of `intermediate_size`,
    the top k renormalised."""
    fields = common_fields(config)
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not num_experts:
        return ModelArchConfig(**fields)
    return ModelArchConfig(
        **fields,
        num_experts=num_experts,
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config.get("moe_intermediate_size") or fields["intermediate_size"],
        norm_topk_prob=True,
    )


class FusedStep(NamedTuple):
    """What every layer's `forward_fused` shares in one step."""

    ops: kernels.CpuOps
    attention: Any  # the 'cpu' attention backend (engine/worker/attention.py)
    meta: AttentionMetadata
    positions: torch.Tensor  # (T,) int64
    cos_sin: torch.Tensor  # (max positions, head_dim) fp32


def forward_fused(
    layer: DecoderLayer,
    hidden: torch.Tensor | None,  # (T, hidden) bf16: the previous layer's down_proj output
    residual: torch.Tensor,  # (T, hidden) fp32, updated in place
    step: FusedStep,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    """A Llama layer's `forward` for quantized projections on the CPU: the glue between the
    products runs in three fused C calls (kernels/cpu_ops.c), and the products take and give
    bf16 (which `forward` casts to and from). Returns the down_proj output (T, hidden) bf16,
    unsummed."""
    ops, eps = step.ops, layer.input_layernorm.eps
    scale = layer.residual_scale  # Granite's multiplier of each branch's output
    normed = ops.add_rms_norm(hidden, residual, layer.input_layernorm.weight, eps, scale)
    qkv = layer.qkv_proj.forward_bf16(normed)  # the bias, if any, is rope_qkv's
    query = ops.rope_qkv(
        qkv,
        kv_cache,
        step.meta.key_rows,
        step.positions,
        step.cos_sin,
        layer.num_heads,
        *qkv_extras(layer),
        eps,
        rotate=layer.use_rope,
    )
    attn = step.attention.forward_query(query, kv_cache, step.meta, layer.scale)
    hidden = layer.o_proj.forward_bf16(attn.view(query.shape[0], -1).to(torch.bfloat16))
    normed = ops.add_rms_norm(hidden, residual, layer.post_attention_layernorm.weight, eps, scale)
    if layer.mlp is not None:  # experts (Qwen3-MoE, Mixtral): the same glue, by expert
        return layer.mlp(normed, gated=ops.silu_mul)
    return layer.down_proj.forward_bf16(ops.silu_mul(layer.gate_up_proj.forward_bf16(normed)))


def qkv_extras(layer: DecoderLayer) -> tuple[torch.Tensor | None, ...]:
    """rope_qkv's qkv bias and per-head q/k norm weights of `layer`, None where it has none."""
    bias = layer.qkv_proj.bias
    norms = (None, None) if layer.q_norm is None else (layer.q_norm.weight, layer.k_norm.weight)
    return (None if bias is None else bias.data, *(n if n is None else n.data for n in norms))


class LlamaForCausalLM(DecoderForCausalLM):
    """The skeleton plus the fused CPU paths (module docstring)."""

    def runs_fused_glue(self) -> bool:
        """Llama's math exactly (a qkv bias, per-head q/k norms and NoPE layers allowed:
        rope_qkv's; Granite's multipliers: add_rms_norm's branch scale, the layer's attention
        scale, embed and compute_logits; a sparse MoE MLP of SiLU experts too, model/moe.py),
        every projection a GGMLLinear (the C glue's products)."""
        cfg = self.cfg
        llama_math = (
            cfg.norm_layout == "pre"
            and cfg.norm_offset == 0.0
            and cfg.activation == "silu"
            and cfg.final_logit_softcap is None
            and cfg.attn_logit_softcap is None
            and not cfg.layer_types
            and (not cfg.qk_norm or cfg.qk_norm_per_head)
        )
        return llama_math and self.quantized_layers()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attention,
    ) -> torch.Tensor:
        if self.cpu_ops is None:
            return super().forward(input_ids, positions, kv_caches, meta, attention)
        hidden = self.embed(input_ids)  # (T, hidden)
        decoder = self.cpu_decoder
        if decoder is not None and kv_caches is decoder.kv_caches:
            residual = hidden
            hidden = decoder.forward(
                residual,
                positions,
                meta.key_rows,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
            )
            return self.last_branch(hidden) + residual
        step = FusedStep(self.cpu_ops, attention, meta, positions, self.rotary.cos_sin_cache)
        residual, hidden = hidden, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = forward_fused(layer, hidden, residual, step, kv_cache)
        return self.last_branch(hidden) + residual

    def last_branch(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's down projection (T, hidden) bf16 as the fp32 residual adds it."""
        scale = self.cfg.residual_scale
        return hidden.float() * scale if scale != 1.0 else hidden.float()

    def build_cpu_decoder(self, attention, kv_caches: list[torch.Tensor]) -> CpuDecoder | None:
        """`forward_fused`'s layers as one C call (kernels/cpu_decoder.py) over `kv_caches`,
        for the 'cpu' attention backend `attention`; None when a projection has a dense part
        or the MLP has experts (forward_fused then runs them through torch)."""
        if self.cfg.num_experts:
            return None
        layers = []
        for layer in self.layers:
            projections = layer.projections()
            if not all(block_format(w) for p in projections for w in p.weights):
                return None
            norms = (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data)
            weights = (p.weights for p in projections)
            layers.append(LayerWeights(*norms, *weights, *qkv_extras(layer), layer.use_rope))
        return CpuDecoder(
            self.cpu_ops,
            attention.kernel,
            default_kernels(),
            layers,
            kv_caches,
            self.rotary.cos_sin_cache,
            self.cfg.num_heads,
            self.cfg.rms_norm_eps,
            self.layers[0].scale,
            self.cfg.residual_scale,
        )


MODEL_CLASS = LlamaForCausalLM
