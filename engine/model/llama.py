"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Runs a flat varlen batch: `input_ids` and `positions` are (T,) for all requests of the
step back to back; attention reads and writes the paged KV cache through the metadata.
q/k/v and gate/up projections are fused into one matmul each, and each residual add into
the norm that follows it (vLLM's layout); the math otherwise follows transformers'
implementation step for step so greedy decoding matches it token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import agentrt.kernels as kernels
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.ggml_linear import GGMLLinear
from agentrt.engine.model.rope import RotaryEmbedding, Rotate
from agentrt.engine.worker.attention import AttentionMetadata
from agentrt.kernels.cpu_decoder import CpuDecoder, LayerWeights, block_format
from agentrt.kernels.ggml_library import default_kernels

if TYPE_CHECKING:
    from agentrt.engine.worker.distributed import TensorParallelGroup


class RMSNorm(nn.Module):
    """RMSNorm, HF Llama numerics: normalise in fp32, cast, times the weight. With
    `residual`, vLLM's fused add: returns (norm(x + residual), x + residual).

    With `kernel_ops` it runs the kernels package's rms_norm (one fused Triton kernel on
    CUDA); else these torch ops, which are the same arithmetic without the per-call input
    checks (~10 us per call, 61 calls per step on the embedded model: the CPU path)."""

    def __init__(self, size: int, eps: float, kernel_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel_ops = kernel_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel_ops:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class DecoderLayer(nn.Module):
    """`cfg` is this rank's share of the model under tensor parallelism (`tp`; see
    model/parallel.py): o_proj and down_proj then give partial sums, all-reduced here."""

    def __init__(
        self, cfg: ModelArchConfig, kernel_ops: bool, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_split = (q_size, kv_size, kv_size)
        self.kernel_ops = kernel_ops

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, cfg.rms_norm_eps, kernel_ops)

        self.input_layernorm = norm(cfg.hidden_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, hidden)
        residual: torch.Tensor | None,  # (T, hidden); None before the first layer
        rotate: Rotate,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, residual) unsummed: the next norm adds them, fused with it (HF
        adds first, then normalises: the same two operations)."""
        num_tokens = hidden.shape[0]
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None and not self.kernel_ops:
            # q and k side by side are one (T, H + KVH, D) tensor: rotated in one go (half the
            # small ops of rotating each); the query is copied out contiguous for attention.
            heads = self.num_heads + self.num_kv_heads
            qk, v = qkv.split((heads * self.head_dim, self.qkv_split[2]), dim=-1)
            qk = rotate.heads(qk.view(num_tokens, heads, self.head_dim))  # (T, H + KVH, D)
            q, k = qk[:, : self.num_heads].contiguous(), qk[:, self.num_heads :]
        else:
            q, k, v = qkv.split(self.qkv_split, dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, k)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        attn = attention.forward(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        hidden = self.o_proj(attn.reshape(num_tokens, -1))
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        hidden = self.down_proj(F.silu(gate) * up)
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        return hidden, residual

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward_fused(
        self,
        hidden: torch.Tensor | None,  # (T, hidden) bf16: the previous layer's down_proj output
        residual: torch.Tensor,  # (T, hidden) fp32, updated in place
        step: FusedStep,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` for quantized projections on the CPU (LlamaForCausalLM.cpu_ops): the
        glue between the products runs in three fused C calls (kernels/cpu_ops.c), and the
        products take and give bf16 (which `forward` casts to and from). Returns the
        down_proj output (T, hidden) bf16, unsummed."""
        ops, eps = step.ops, self.input_layernorm.eps
        normed = ops.add_rms_norm(hidden, residual, self.input_layernorm.weight, eps)
        qkv = self.qkv_proj.forward_bf16(normed)
        query = ops.rope_qkv(
            qkv, kv_cache, step.meta.key_rows, step.positions, step.cos_sin, self.num_heads
        )
        attn = step.attention.forward_query(query, kv_cache, step.meta, self.scale)
        hidden = self.o_proj.forward_bf16(attn.view(query.shape[0], -1).to(torch.bfloat16))
        normed = ops.add_rms_norm(hidden, residual, self.post_attention_layernorm.weight, eps)
        return self.down_proj.forward_bf16(ops.silu_mul(self.gate_up_proj.forward_bf16(normed)))


class FusedStep(NamedTuple):
    """What every layer's `forward_fused` shares in one step."""

    ops: kernels.CpuOps
    attention: Any  # the 'cpu' attention backend (engine/worker/attention.py)
    meta: AttentionMetadata
    positions: torch.Tensor  # (T,) int64
    cos_sin: torch.Tensor  # (max positions, head_dim) fp32


class LlamaForCausalLM(nn.Module):
    """`kernel_ops`: RMSNorm and RoPE through the kernels package (its fused Triton kernels
    on CUDA, its references elsewhere) instead of inline torch ops. The model runner turns it
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
        # Built on the meta device and filled by the loader: an explicit `_weight` skips
        # nn.Embedding's random init, whose meta-device normal_ imports torch._dynamo
        # (~1 s of every engine start, several on a loaded machine).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, kernel_ops, tp) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernel_ops)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, kernel_ops=kernel_ops
        )
        # The output projection when quantized (a GGMLLinear: the loader sets it, over the
        # embedding's own blocks when tied); else the lm_head or tied embedding weight.
        self.logits_proj: nn.Module | None = None
        # The fused CPU glue, which the layers then run through (`forward_fused`): set by the
        # model runner for quantized fp32 models on the CPU attention backend...
        self.cpu_ops: kernels.CpuOps | None = None
        # ... and with it, when every projection is in block formats, all layers in one C
        # call over the runner's KV caches (`build_cpu_decoder`).
        self.cpu_decoder: CpuDecoder | None = None

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
        if self.cpu_ops is not None:
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
                return hidden.float() + residual
            step = FusedStep(self.cpu_ops, attention, meta, positions, self.rotary.cos_sin_cache)
            residual, hidden = hidden, None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden = layer.forward_fused(hidden, residual, step, kv_cache)
            return hidden.float() + residual
        rotate = self.rotary.for_step(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rotate, kv_cache, meta, attention)
        return hidden + residual  # the final norm runs on the sampled rows only

    def quantized_layers(self) -> bool:
        """Whether every layer projection is a GGMLLinear (the fused CPU glue needs that)."""
        return all(isinstance(p, GGMLLinear) for layer in self.layers for p in layer.projections())

    def build_cpu_decoder(self, attention, kv_caches: list[torch.Tensor]) -> CpuDecoder | None:
        """`forward_fused`'s layers as one C call (kernels/cpu_decoder.py) over `kv_caches`,
        for the 'cpu' attention backend `attention`; None when a projection has a dense part
        (forward_fused then runs it through torch)."""
        layers = []
        for layer in self.layers:
            projections = layer.projections()
            if not all(block_format(w) for p in projections for w in p.weights):
                return None
            norms = (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data)
            layers.append(LayerWeights(*norms, *(p.weights for p in projections)))
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
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) of the sampled positions -> logits (S, vocab) in fp32."""
        if self.logits_proj is not None:
            return self.logits_proj(self.norm(hidden)).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(hidden), weight).float()

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
