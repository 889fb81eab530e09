"""The decoder skeleton every family runs on (model/<family>.py picks its settings).

Runs a flat varlen batch: `input_ids` and `positions` are (T,) for all requests of the
step back to back; attention reads and writes the paged KV cache through the metadata.
q/k/v and gate/up projections are fused into one matmul each, and each residual add into
the norm that follows it (vLLM's layout). What differs between families is data in
`ModelArchConfig` (model/arch.py), set by the family's module: the norm layout (Gemma's
norms after attention and the MLP too), RMSNorm's `1 + w`, the MLP's activation, q/k norms,
the embedding scale, sliding-window layers with their own rope, logit soft-capping. The
math otherwise follows transformers' implementations step for step, so greedy decoding
matches them token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import agentrt.kernels as kernels
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.ggml_linear import GGMLLinear
from agentrt.engine.model.moe import SparseMoE
from agentrt.engine.model.rope import RotaryEmbedding, Rotate
from agentrt.engine.records import AttentionMetadata
from agentrt.engine.worker.windowed_attention import windowed_attention

if TYPE_CHECKING:
    from agentrt.engine.worker.distributed import TensorParallelGroup


class RMSNorm(nn.Module):
    """RMSNorm, HF numerics: normalise in fp32, then times the weight. With `residual`,
    vLLM's fused add: returns (norm(x + residual), x + residual).

    `offset` 0 (Llama): `weight * h.to(dtype)`; else (Gemma): `(h * (offset + weight)).to(dtype)`
    in fp32. With `kernel_ops` (offset 0 only) it runs the kernels package's rms_norm (one
    fused Triton kernel on CUDA); else these torch ops, which are the same arithmetic without
    the per-call input checks (~10 us per call, 61 calls per step on the embedded model)."""

    def __init__(
        self, size: int, eps: float, kernel_ops: bool = False, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.kernel_ops = kernel_ops and offset == 0.0
        self._factor: tuple[tuple[int, int], torch.Tensor] | None = None

    def factor(self) -> torch.Tensor:
        """What the normalised value is multiplied by, fp32 (hidden,): the weight, or
        `offset + w` computed in fp32 as `forward` does (made once per weight version: the
        fused C glue of llama.py reads it every step)."""
        weight = self.weight.data
        if not self.offset:
            return weight
        key = (weight.data_ptr(), weight._version)
        if self._factor is None or self._factor[0] != key:
            self._factor = (key, (self.offset + weight.float()).contiguous())
        return self._factor[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel_ops:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            out = (h * (self.offset + self.weight.float())).to(x.dtype)
        else:
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


def activation(name: str):
    """The gated MLP's activation of `gate`: SiLU (Llama) or tanh-approximated GELU (Gemma)."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda gate: F.gelu(gate, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


class DecoderLayer(nn.Module):
    """`cfg` is this rank's share of the model under tensor parallelism (`tp`; see
    model/parallel.py): o_proj and down_proj then give partial sums, all-reduced here.

    Norms by the engine's names (the loader maps the checkpoint's to them):
    `input_layernorm` before attention, `post_attention_layernorm` before the MLP (Llama's
    names), and with the "sandwich" layout `attn_output_norm` / `mlp_output_norm` on
    attention's and the MLP's outputs (Gemma's post_attention / post_feedforward norms)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        kernel_ops: bool,
        tp: TensorParallelGroup | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale or cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(index) else None
        self.use_rope = not cfg.rope_layers or cfg.rope_layers[index]
        self.attn_softcap = cfg.attn_logit_softcap
        self.residual_scale = cfg.residual_scale
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_split = (q_size, kv_size, kv_size)
        self.kernel_ops = kernel_ops
        self.activation = cfg.activation
        self.act = activation(cfg.activation)

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, cfg.rms_norm_eps, kernel_ops, cfg.norm_offset)

        pre = cfg.norm_layout != "post"
        post = cfg.norm_layout != "pre"
        self.input_layernorm = norm(cfg.hidden_size) if pre else None
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        per_head = cfg.qk_norm_per_head
        self.q_norm = norm(cfg.head_dim if per_head else q_size) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim if per_head else kv_size) if cfg.qk_norm else None
        self.qk_norm_per_head = per_head
        self.attn_output_norm = norm(cfg.hidden_size) if post else None
        self.post_attention_layernorm = norm(cfg.hidden_size) if pre else None
        self.mlp: SparseMoE | None = None
        if cfg.num_experts:  # a sparse MoE MLP in place of the dense one
            self.gate_up_proj = self.down_proj = None
            self.mlp = SparseMoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                self.act,
            )
        else:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.mlp_output_norm = norm(cfg.hidden_size) if post else None

    def forward(
        self,
        hidden: torch.Tensor,  # (T, hidden)
        residual: torch.Tensor | None,  # (T, hidden); None before the first layer
        rotate: Rotate | None,  # None: no rope in this layer
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, residual) unsummed: the next norm adds them, fused with it (HF
        adds first, then normalises: the same two operations)."""
        num_tokens = hidden.shape[0]
        if self.input_layernorm is None:  # the "post" layout: attention reads the sum
            hidden = residual = hidden if residual is None else hidden + residual
        elif residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None and not self.kernel_ops and rotate is not None:
            # q and k side by side are one (T, H + KVH, D) tensor: rotated in one go (half the
            # small ops of rotating each); the query is copied out contiguous for attention.
            heads = self.num_heads + self.num_kv_heads
            qk, v = qkv.split((heads * self.head_dim, self.qkv_split[2]), dim=-1)
            qk = rotate.heads(qk.view(num_tokens, heads, self.head_dim))  # (T, H + KVH, D)
            q, k = qk[:, : self.num_heads].contiguous(), qk[:, self.num_heads :]
        else:
            q, k, v = qkv.split(self.qkv_split, dim=-1)
            if self.q_norm is not None and not self.qk_norm_per_head:  # over all heads
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
            k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
            if self.q_norm is not None and self.qk_norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            if rotate is not None:
                q, k = rotate(q, k)
            else:  # a NoPE layer: the query as the attention kernels take it
                q = q.contiguous()
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        windowed = self.sliding_window is not None or self.attn_softcap is not None
        if windowed and attention.takes_windows:  # the C kernel's own
            attn = attention.forward(
                q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.attn_softcap
            )
        elif windowed:
            attn = windowed_attention(
                q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.attn_softcap
            )
        else:
            attn = attention.forward(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        hidden = self.o_proj(attn.reshape(num_tokens, -1))
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        if self.residual_scale != 1.0:
            hidden = hidden * self.residual_scale
        if self.attn_output_norm is not None:
            hidden = self.attn_output_norm(hidden)
        if self.post_attention_layernorm is None:  # the "post" layout: the MLP reads the sum
            hidden = residual = hidden + residual
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.mlp is not None:
            hidden = self.mlp(hidden)
        else:
            gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
            hidden = self.down_proj(self.act(gate) * up)
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        if self.residual_scale != 1.0:
            hidden = hidden * self.residual_scale
        if self.mlp_output_norm is not None:
            hidden = self.mlp_output_norm(hidden)
        return hidden, residual

    def projections(self) -> tuple[nn.Module, ...]:
        if self.mlp is not None:
            experts = [p for e in self.mlp.experts for p in (e.gate_up_proj, e.down_proj)]
            return self.qkv_proj, self.o_proj, *experts
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj


class DecoderForCausalLM(nn.Module):
    """A decoder-only model of any family, run layer by layer.

    `kernel_ops`: RMSNorm and RoPE through the kernels package (its fused Triton kernels on
    CUDA, its references elsewhere) instead of inline torch ops. The model runner turns it
    on with the 'triton' attention backend: that is the CUDA path.
    `tp`: this rank's tensor-parallel group; `cfg` is then the rank's shard (parallel.py)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        max_positions: int,
        kernel_ops: bool = False,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.kernel_ops = kernel_ops
        # Built on the meta device and filled by the loader: an explicit `_weight` skips
        # nn.Embedding's random init, whose meta-device normal_ imports torch._dynamo
        # (~1 s of every engine start, several on a loaded machine).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kernel_ops, tp, index) for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel_ops, cfg.norm_offset)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary: RotaryEmbedding
        self.local_rotary: RotaryEmbedding | None
        # Per-frequency divisors of the global rope stored with the weights (the loader sets
        # them: a llama 3.x GGUF's rope_freqs), else None.
        self.rope_factors: torch.Tensor | None = None
        # ... and scaling that replaces the config's (a Phi-3 GGUF's LongRoPE factors).
        self.rope_scaling: dict | None = None
        self.build_rotary(max_positions)
        # The output projection when quantized (a GGMLLinear: the loader sets it, over the
        # embedding's own blocks when tied); else the lm_head or tied embedding weight.
        self.logits_proj: nn.Module | None = None
        # The fused CPU glue (llama.py's LlamaForCausalLM, which every family whose layer the
        # C glue computes uses; the model runner sets it when `runs_fused_glue()`), and with
        # it the one-call decoder.
        self.cpu_ops: kernels.CpuOps | None = None
        self.cpu_decoder = None

    def build_rotary(self, max_positions: int, device: torch.device | None = None) -> None:
        """The rope tables of `max_positions` positions: the global layers' and, for a model
        with sliding-window layers of their own theta, the local layers'."""
        cfg = self.cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            max_positions,
            cfg.rope_theta,
            self.rope_scaling or cfg.rope_scaling,
            kernel_ops=self.kernel_ops,
            device=device,
            factors=self.rope_factors,
            rotary_dim=cfg.rotary_dim,
        )
        self.local_rotary = None
        if cfg.has_sliding_layers and cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                cfg.head_dim,
                max_positions,
                cfg.local_rope_theta,
                cfg.local_rope_scaling,
                kernel_ops=self.kernel_ops,
                device=device,
            )

    def cover_positions(self, positions: torch.Tensor) -> None:
        """Fill the rope tables' rows up to the step's `positions` (T,) (RotaryEmbedding.cover:
        the fused C paths read the tables' rows without `for_step`)."""
        self.rotary.cover(positions)
        if self.local_rotary is not None:
            self.local_rotary.cover(positions)

    def runs_fused_glue(self) -> bool:
        """Whether the model runner may set `cpu_ops` (the fused C glue of llama.py): only a
        model whose layers are Llama's math, all in block formats."""
        return False

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        if self.cfg.embedding_scale != 1.0:
            # HF casts the scale to the embedding's dtype first (Gemma's sqrt(hidden)).
            hidden = hidden * torch.tensor(self.cfg.embedding_scale, dtype=hidden.dtype)
        return hidden

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
        attention,
    ) -> torch.Tensor:
        """`meta`: the step's, or one per layer (KV cache groups: each layer's group's
        block tables, core/kv_cache_groups.py)."""
        metas = meta if isinstance(meta, list) else [meta] * len(self.layers)
        hidden = self.embed(input_ids)
        rotate = self.rotary.for_step(positions, hidden.dtype)
        local = self.local_rotary
        local_rotate = rotate if local is None else local.for_step(positions, hidden.dtype)
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
            layer_rotate = local_rotate if layer.sliding_window is not None else rotate
            if not layer.use_rope:
                layer_rotate = None
            hidden, residual = layer(
                hidden, residual, layer_rotate, kv_cache, layer_meta, attention
            )
        return hidden + residual  # the final norm runs on the sampled rows only

    def quantized_layers(self) -> bool:
        """Whether every layer projection is a GGMLLinear (the fused CPU glue needs that)."""
        return all(isinstance(p, GGMLLinear) for layer in self.layers for p in layer.projections())

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) of the sampled positions -> logits (S, vocab) in fp32."""
        if self.logits_proj is not None:
            logits = self.logits_proj(self.norm(hidden)).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(self.norm(hidden), weight).float()
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (one rank, dense, in the model's current dtype and device):
        engine/loader/load.py's `load_weights` over the state dict."""
        from agentrt.engine.loader.load import load_weights
        from agentrt.engine.loader.safetensors_loader import StateDictLoader
        from agentrt.engine.loader.weights import Shard

        param = self.norm.weight
        device = torch.device("cpu") if param.is_meta else param.device
        load_weights(
            self,
            StateDictLoader(state),
            self.cfg,
            shard=Shard(0, 1),
            dtype=param.dtype,
            device=device,
            quantization="none",
        )
