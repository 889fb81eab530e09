"""A quantized decoder's layers in one C call on the CPU (cpu_ops.c's decoder_forward).

LlamaForCausalLM's `forward_fused` runs a layer as ~10 calls from Python: two norms, RoPE,
attention, four products, SiLU, a cast. Each costs ~5-15 us of Python and ctypes around
microseconds of work for one decoded token, which on the embedded model was 2.5 of a
forward's 6.5 ms (one thread, CPU time). `CpuDecoder` lays every layer's weights, norms
and KV cache out once as C structs; a step then fills one struct of its shapes, metadata
and buffers, checks them once, and makes one call, which runs the same operations in the
same order (the same bits as the layer-by-layer path; tests/kernels/test_cpu_decoder.py).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from .cpu_attention import CpuAttention
from .cpu_ops import CpuOps, check_qkv_extras
from .errors import KernelInputError
from .ggml_experts import ExpertKernel
from .ggml_library import GGMLKernels
from .ggml_linear import DENSE_DTYPES, GGMLWeight, type_name

MAX_PARTS = 4  # cpu_ops.c's: the block types one fused projection may mix
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [("weight", _PTR), *((name, _I64) for name in ("stride", "qtype", "rows"))]
    _fields_ += [("interleaved", _I64)]


class _Projection(ctypes.Structure):
    _fields_ = [("in_features", _I64), ("out_features", _I64), ("num_parts", _I64)]
    _fields_ += [("parts", _Part * MAX_PARTS)]


_NORMS = ("input_norm", "post_norm", "attn_output_norm", "mlp_output_norm")


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _PTR) for name in _NORMS), ("kv_cache", _PTR)]
    _fields_ += [(name, _Projection) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [(name, _PTR) for name in ("qkv_bias", "q_norm", "k_norm", "cos_sin")]
    _fields_ += [(name, _I64) for name in ("norm_all_heads", "window", "group")]
    _fields_ += [("softcap", _F32), ("moe", _PTR), ("moe_args", _PTR)]


_SHAPES = ("tokens", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "block_size")
_SHAPES += ("rot_dim",)
_BUFFERS = ("residual", "query", "attn", "out", "normed", "qkv", "attn_bf16", "gate_up")
_BUFFERS += ("act_out",)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # cpu_ops.c's ACT_SILU, ACT_GELU_TANH


class _Step(ctypes.Structure):
    _fields_ = [(name, _I64) for name in _SHAPES]
    _fields_ += [("eps", _F32), ("scale", _F32), ("residual_scale", _F32), ("num_threads", _I64)]
    _fields_ += [("act", _I64)]
    _fields_ += [(name, _PTR) for name in ("positions", "key_rows")]
    _fields_ += [(name, _PTR) for name in ("query_start_loc", "seq_lens", "block_tables")]
    _fields_ += [("table_strides", _PTR), ("num_requests", _I64)]
    _fields_ += [(name, _PTR) for name in _BUFFERS]
    _fields_ += [("linear", _PTR), ("attention", _PTR)]
    _fields_ += [("failed_layer", _I64), ("failed_op", _I64)]


class LayerWeights(NamedTuple):
    """One decoder layer as the C loop reads it: RMSNorm weights (hidden,) fp32 (the factor
    of the normalised value: Gemma's 1 + w) and each projection's block-format parts,
    stacked by output rows; a qkv bias ((H + 2 KVH) D,) fp32 (Qwen2) and q/k norm weights,
    per head (D,) fp32 (Qwen3, Gemma 3) or over all heads ((H D,), (KVH D,)) with
    `norm_all_heads` (OLMo 2), or None (Llama); `rope` False for a layer that rotates
    nothing (SmolLM3's NoPE layers). `input_norm` None: the layer reads the residual itself
    (OLMo 2); `attn_output_norm` / `mlp_output_norm` normalise attention's and the MLP's
    outputs before they join the residual (Gemma's sandwich, OLMo 2). `cos_sin` is the
    layer's rope table (None: the decoder's); `window` its sliding window (None: none),
    `softcap` its score cap (Gemma 2), `group` its KV cache group (core/kv_cache_groups.py).
    `experts`: a sparse MoE layer's MLP (ggml_experts.py; its gate_up and down then empty),
    None for the dense gate_up and down."""

    input_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    qkv: list[GGMLWeight]
    o: list[GGMLWeight]
    gate_up: list[GGMLWeight]
    down: list[GGMLWeight]
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope: bool = True
    attn_output_norm: torch.Tensor | None = None
    mlp_output_norm: torch.Tensor | None = None
    norm_all_heads: bool = False
    cos_sin: torch.Tensor | None = None
    window: int | None = None
    softcap: float | None = None
    group: int = 0
    experts: ExpertKernel | None = None


def block_format(weight: object) -> bool:
    """Whether the C loop runs this part of a projection (a dense one it does not)."""
    return isinstance(weight, GGMLWeight) and weight.qtype not in DENSE_DTYPES


def _projection(name: str, parts: list[GGMLWeight], k: int, n: int) -> _Projection:
    if not 1 <= len(parts) <= MAX_PARTS:
        raise KernelInputError(f"{name}: {len(parts)} parts; at most {MAX_PARTS}.", arg=name)
    for part in parts:
        if not block_format(part) or part.in_features != k:
            raise KernelInputError(
                f"{name}: a {type_name(part.qtype)} part of {part.in_features} inputs; the "
                f"decoder takes block-format parts of {k}.",
                arg=name,
            )
    if (total := sum(p.out_features for p in parts)) != n:
        raise KernelInputError(f"{name}: its parts give {total} outputs; expected {n}.", arg=name)
    proj = _Projection(k, n, len(parts))
    for slot, part in zip(proj.parts, parts, strict=False):
        ptr, stride, qtype, rows, _ = part._c_args
        slot.weight, slot.stride, slot.qtype, slot.rows = ptr, stride, qtype, rows
        slot.interleaved = part.interleaved
    return proj


class CpuDecoder:
    """Every layer of a model, laid out for decoder_forward. The tensors it points at are
    held here, so they live as long as it does; `kv_caches` are the runner's (they are
    written by every step)."""

    def __init__(
        self,
        ops: CpuOps,
        attention: CpuAttention,
        linear: GGMLKernels,
        layers: list[LayerWeights],
        kv_caches: list[torch.Tensor],
        cos_sin: torch.Tensor,
        num_heads: int,
        eps: float,
        scale: float,
        residual_scale: float = 1.0,
        activation: str = "silu",
    ) -> None:
        if len(layers) != len(kv_caches) or not layers:
            raise KernelInputError("one KV cache per layer, and at least one layer.")
        if activation not in ACTIVATIONS:
            raise KernelInputError(f"activation {activation!r}: one of {sorted(ACTIVATIONS)}.")
        shape = kv_caches[0].shape
        _, _, self.block_size, self.kv_heads, self.head_dim = shape
        self.hidden, self.heads = layers[0].o[0].out_features, num_heads
        dense = [layer for layer in layers if layer.experts is None]
        self.intermediate = dense[0].down[0].in_features if dense else 0  # the dense MLPs'
        q_size, kv_size = num_heads * self.head_dim, self.kv_heads * self.head_dim
        hidden, inter = self.hidden, self.intermediate
        self._layers = (_Layer * len(layers))()
        for slot, layer, cache in zip(self._layers, layers, kv_caches, strict=True):
            if cache.shape != shape or cache.dtype != torch.float32 or not cache.is_contiguous():
                raise KernelInputError("the KV caches must be alike, fp32 and contiguous.")
            for name in _NORMS:
                norm = getattr(layer, name)
                if norm is not None and (norm.dtype != torch.float32 or norm.shape != (hidden,)):
                    raise KernelInputError(f"{name}: norm weights must be fp32 ({hidden},).")
                setattr(slot, name, None if norm is None else norm.data_ptr())
            slot.kv_cache = cache.data_ptr()
            slot.qkv = _projection("qkv", layer.qkv, hidden, q_size + 2 * kv_size)
            slot.o = _projection("o", layer.o, q_size, hidden)
            if layer.experts is None:
                slot.gate_up = _projection("gate_up", layer.gate_up, hidden, 2 * inter)
                slot.down = _projection("down", layer.down, inter, hidden)
            elif layer.gate_up or layer.down or layer.experts.hidden != hidden:
                raise KernelInputError(f"a MoE layer: experts of {hidden} inputs, no gate_up.")
            else:
                slot.moe = layer.experts.library.address
                slot.moe_args = layer.experts.decoder_args.buffer_info()[0]
            extras = (layer.qkv_bias, layer.q_norm, layer.k_norm)
            sizes = (q_size, kv_size) if layer.norm_all_heads else (self.head_dim,) * 2
            check_qkv_extras(q_size + 2 * kv_size, sizes, *extras)
            slot.qkv_bias, slot.q_norm, slot.k_norm = (
                None if t is None else t.data_ptr() for t in extras
            )
            table = cos_sin if layer.cos_sin is None else layer.cos_sin
            if table.shape != cos_sin.shape or table.dtype != torch.float32:
                raise KernelInputError("every layer's rope table must be like the decoder's.")
            slot.cos_sin = table.data_ptr() if layer.rope else None
            if (layer.window is not None and layer.window < 1) or (
                layer.softcap is not None and layer.softcap <= 0
            ):
                raise KernelInputError("a layer's window and softcap: each None or positive.")
            slot.norm_all_heads = int(layer.norm_all_heads)
            slot.window, slot.softcap = layer.window or 0, layer.softcap or 0.0
            if layer.group < 0:
                raise KernelInputError("a layer's KV cache group must be >= 0.")
            slot.group = layer.group
        self.num_groups = max(layer.group for layer in layers) + 1
        self._layer_weights = layers
        self.kv_caches, self.cos_sin = kv_caches, cos_sin
        self._ops, self._attention = ops, attention
        self._step = _Step(
            hidden=hidden,
            intermediate=inter,
            heads=num_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            rot_dim=cos_sin.shape[-1],
            eps=eps,
            scale=scale,
            residual_scale=residual_scale,
            act=ACTIVATIONS[activation],
            linear=linear.linear_address,
            attention=attention.address,
        )

    def forward(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        key_rows: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor | list[torch.Tensor],
    ) -> torch.Tensor:
        """residual (T, hidden) fp32: the embeddings, updated in place to what the last
        layer's down projection is added to; returns that projection (T, hidden) bf16,
        without the last layer's output norm. The metadata are attention's and rope_qkv's
        (cpu_attention.py, cpu_ops.py); `key_rows` and `block_tables` one tensor, or a list of
        one per KV cache group (the layers' `group`)."""
        tokens = residual.shape[0]
        if (
            residual.dtype != torch.float32
            or residual.shape != (tokens, self.hidden)
            or not residual.is_contiguous()
        ):
            raise KernelInputError(
                f"residual must be fp32 (T, {self.hidden}), contiguous.", arg="residual"
            )
        heads, dim = self.heads, self.head_dim
        f32, bf16 = torch.float32, torch.bfloat16
        buffers = {
            "residual": residual,
            "query": torch.empty((tokens, heads, dim), dtype=f32),
            "attn": torch.empty((tokens, heads, dim), dtype=f32),
            "out": torch.empty((tokens, self.hidden), dtype=bf16),
            "normed": torch.empty((tokens, self.hidden), dtype=bf16),
            "qkv": torch.empty((tokens, (heads + 2 * self.kv_heads) * dim), dtype=bf16),
            "attn_bf16": torch.empty((tokens, heads * dim), dtype=bf16),
            "gate_up": torch.empty((tokens, 2 * self.intermediate), dtype=bf16),
            "act_out": torch.empty((tokens, self.intermediate), dtype=bf16),
        }
        rows = key_rows if isinstance(key_rows, list) else [key_rows]
        tables = block_tables if isinstance(block_tables, list) else [block_tables]
        if len(rows) != self.num_groups or len(tables) != self.num_groups:
            raise KernelInputError(
                f"key_rows and block_tables: one per KV cache group ({self.num_groups}).",
                arg="block_tables",
            )
        cache = self.kv_caches[0]
        query, attn = buffers["query"], buffers["attn"]
        for group_rows, table in zip(rows, tables, strict=True):
            self._ops.check_rope(cache, group_rows, positions, self.cos_sin, tokens)
            self._attention.check(query, cache, query_start_loc, seq_lens, table, attn)
        step = self._step
        step.tokens, step.num_threads = tokens, torch.get_num_threads()
        step.positions = positions.data_ptr()
        step.query_start_loc, step.seq_lens = query_start_loc.data_ptr(), seq_lens.data_ptr()
        # Arrays of the groups' pointers and strides, held until the call returns.
        row_ptrs = (_PTR * len(rows))(*(t.data_ptr() for t in rows))
        table_ptrs = (_PTR * len(tables))(*(t.data_ptr() for t in tables))
        strides = (_I64 * len(tables))(*(t.shape[1] for t in tables))
        step.key_rows, step.block_tables = ctypes.addressof(row_ptrs), ctypes.addressof(table_ptrs)
        step.table_strides, step.num_requests = ctypes.addressof(strides), seq_lens.shape[0]
        for name, tensor in buffers.items():
            setattr(step, name, tensor.data_ptr())
        rc = self._ops.decoder_forward(
            ctypes.addressof(step), ctypes.addressof(self._layers), len(self._layers)
        )
        if rc:
            where = {1: "a projection", 2: "attention", 3: "the MoE MLP"}[step.failed_op]
            if rc == -2:
                raise MemoryError(f"layer {step.failed_layer}: {where} ran out of memory.")
            raise KernelInputError(f"layer {step.failed_layer}: {where} refused its input ({rc}).")
        return buffers["out"]
