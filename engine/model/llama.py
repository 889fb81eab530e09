"""The Llama family (Llama 2/3.x, SmolLM, Mistral): the decoder skeleton, and the fused CPU
paths, which every family whose layer they compute uses (MODEL_CLASS of its module).

On the CPU with quantized fp32 layers the model runner sets `cpu_ops`: the glue between a
layer's products then runs in three fused C calls (kernels/cpu_ops.c, `forward_fused`), and
when every projection is in block formats all layers run in one C call (`build_cpu_decoder`,
kernels/cpu_decoder.py). Both compute the skeleton's layer exactly: pre-norms, SiLU, RoPE (on
every layer but SmolLM3's NoPE layers), Granite's multipliers (the embedding's and logits'
in Python, the attention scale, each branch's output scaled as it joins the residual), and
optionally a qkv bias (Qwen2) and q/k RMSNorm per head (Qwen3, Gemma 3) or over all heads
(OLMo 2), which rope_qkv applies in fp32 to the qkv product's bf16 output; and the other
families' variants as data: RMSNorm's `1 + w` (Gemma's: the norm factor, `RMSNorm.factor`),
norms on attention's and the MLP's outputs before they join the residual (Gemma's sandwich,
OLMo 2's post-norms: add_rms_norm's `x_norm`), no input norm (OLMo 2), GeGLU (gelu_tanh_mul),
sliding-window layers with their own rope table and KV cache group, attention soft-caps
(Gemma 2; the kernel's) and the embedding scale and final logit cap (in Python).
`runs_fused_glue` checks the layer is made of those before the runner may set them, so a
family of other math never takes them.
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
    positions: torch.Tensor  # (T,) int64
    eps: float  # the model's RMSNorm epsilon


def forward_fused(
    layer: DecoderLayer,
    hidden: torch.Tensor | None,  # (T, hidden) bf16: the previous layer's down_proj output
    residual: torch.Tensor,  # (T, hidden) fp32, updated in place
    step: FusedStep,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,  # the layer's (its KV cache group's block tables)
    cos_sin: torch.Tensor,  # (max positions, head_dim) fp32: the layer's rope table
    hidden_norm: RMSNorm | None = None,  # the previous layer's MLP output norm
) -> torch.Tensor:
    """A layer's `forward` for quantized projections on the CPU: the glue between the
    products runs in three fused C calls (kernels/cpu_ops.c), and the products take and give
    bf16 (which `forward` casts to and from). Returns the down_proj output (T, hidden) bf16,
    unsummed and without the layer's MLP output norm (the next layer's add_rms_norm, or
    `last_branch`, applies it)."""
    ops, eps = step.ops, step.eps
    scale = layer.residual_scale  # Granite's multiplier of each branch's output
    normed = ops.add_rms_norm(
        hidden, residual, factor(layer.input_layernorm), eps, scale, factor(hidden_norm)
    )
    qkv = layer.qkv_proj.forward_bf16(normed)  # the bias, if any, is rope_qkv's
    query = ops.rope_qkv(
        qkv,
        kv_cache,
        meta.key_rows,
        step.positions,
        cos_sin,
        layer.num_heads,
        *qkv_extras(layer),
        eps,
        rotate=layer.use_rope,
        norm_all_heads=norms_all_heads(layer),
    )
    attn = step.attention.forward_query(
        query, kv_cache, meta, layer.scale, layer.sliding_window, layer.attn_softcap
    )
    hidden = layer.o_proj.forward_bf16(attn.view(query.shape[0], -1).to(torch.bfloat16))
    normed = ops.add_rms_norm(
        hidden,
        residual,
        factor(layer.post_attention_layernorm),
        eps,
        scale,
        factor(layer.attn_output_norm),
    )
    if layer.mlp is not None:  # experts (Qwen3-MoE, Mixtral): the same glue, by expert
        return layer.mlp(normed, gated=ops.silu_mul)
    gated = ops.gelu_tanh_mul if layer.activation == "gelu_tanh" else ops.silu_mul
    return layer.down_proj.forward_bf16(gated(layer.gate_up_proj.forward_bf16(normed)))


def factor(norm: RMSNorm | None) -> torch.Tensor | None:
    """The C glue's weight of `norm` (its factor: Gemma's 1 + w), None for no norm."""
    return None if norm is None else norm.factor()


def norms_all_heads(layer: DecoderLayer) -> bool:
    return layer.q_norm is not None and not layer.qk_norm_per_head


def qkv_extras(layer: DecoderLayer) -> tuple[torch.Tensor | None, ...]:
    """rope_qkv's qkv bias and q/k norm weights of `layer`, None where it has none."""
    bias = layer.qkv_proj.bias
    return (None if bias is None else bias.data, factor(layer.q_norm), factor(layer.k_norm))


class LlamaForCausalLM(DecoderForCausalLM):
    """The skeleton plus the fused CPU paths (module docstring)."""

    def runs_fused_glue(self) -> bool:
        """The layer is what the C glue computes (the module docstring: any norm layout and
        offset, SiLU or GeGLU, q/k norms per head or over all heads, NoPE layers, sliding
        windows, soft-caps; a sparse MoE MLP of SiLU experts too, model/moe.py), every
        projection a GGMLLinear (the C glue's products)."""
        cfg = self.cfg
        glue_math = (
            cfg.norm_layout in ("pre", "sandwich", "post")
            and cfg.activation in ("silu", "gelu_tanh")
            and (not cfg.num_experts or cfg.activation == "silu")
        )
        return glue_math and self.quantized_layers()

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
        self.cover_positions(positions)
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        decoder = self.cpu_decoder
        if decoder is not None and kv_caches is decoder.kv_caches:
            residual = hidden
            groups = self._group_metas(metas)
            hidden = decoder.forward(
                residual,
                positions,
                [m.key_rows for m in groups],
                metas[0].query_start_loc,
                metas[0].seq_lens,
                [m.block_tables for m in groups],
            )
            return self.last_branch(hidden) + residual
        step = FusedStep(self.cpu_ops, attention, positions, self.cfg.rms_norm_eps)
        residual, hidden, hidden_norm = hidden, None, None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
            cos_sin = self.rope_table(layer)
            hidden = forward_fused(
                layer, hidden, residual, step, kv_cache, layer_meta, cos_sin, hidden_norm
            )
            hidden_norm = layer.mlp_output_norm
        return self.last_branch(hidden) + residual

    def rope_table(self, layer: DecoderLayer) -> torch.Tensor:
        """The layer's rope table: the local rope's for a sliding-window layer with one."""
        local = layer.sliding_window is not None and self.local_rotary is not None
        return (self.local_rotary if local else self.rotary).cos_sin_cache

    def _group_metas(self, metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
        """Each KV cache group's metadata, by the decoder's group of each layer."""
        groups: list[AttentionMetadata | None] = [None] * self.cpu_decoder.num_groups
        for layer_meta, group in zip(metas, self._layer_groups, strict=True):
            groups[group] = layer_meta
        return groups

    def last_branch(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's down projection (T, hidden) bf16 as the fp32 residual adds it
        (scaled, then through the MLP's output norm where the family has one)."""
        scale = self.cfg.residual_scale
        hidden = hidden.float() * scale if scale != 1.0 else hidden.float()
        norm = self.layers[-1].mlp_output_norm
        return hidden if norm is None else norm(hidden)

    def build_cpu_decoder(self, attention, kv_caches: list[torch.Tensor]) -> CpuDecoder | None:
        """`forward_fused`'s layers as one C call (kernels/cpu_decoder.py) over `kv_caches`,
        for the 'cpu' attention backend `attention`; None when a projection has a dense part
        or the experts are not one C call's (model/moe.py's `expert_kernel`): forward_fused
        then runs them through torch."""
        from agentrt.engine.core.kv_cache_groups import kv_cache_layout

        places = kv_cache_layout(self.cfg).layer_places(len(self.layers))
        self._layer_groups = [group for group, _ in places]
        layers = []
        for layer, group in zip(self.layers, self._layer_groups, strict=True):
            projections, experts = layer.projections(), None
            if layer.mlp is not None:  # the MLP in one call, moe_forward's: no gate_up, down
                projections = projections[:2]
                experts = layer.mlp.expert_kernel(self.cpu_ops.silu_mul)
                if experts is None:
                    return None
            if not all(block_format(w) for p in projections for w in p.weights):
                return None
            weights = [p.weights for p in projections] + [[], []] * (experts is not None)
            norms = (factor(layer.input_layernorm), factor(layer.post_attention_layernorm))
            layers.append(
                LayerWeights(
                    *norms,
                    *weights,
                    *qkv_extras(layer),
                    rope=layer.use_rope,
                    attn_output_norm=factor(layer.attn_output_norm),
                    mlp_output_norm=factor(layer.mlp_output_norm),
                    norm_all_heads=norms_all_heads(layer),
                    cos_sin=self.rope_table(layer),
                    window=layer.sliding_window,
                    softcap=layer.attn_softcap,
                    group=group,
                    experts=experts,
                )
            )
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
            self.cfg.activation,
        )


MODEL_CLASS = LlamaForCausalLM
