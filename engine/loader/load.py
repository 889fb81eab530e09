"""Fill a model built on the meta device from a loader, one parameter at a time.

`load_weights(model, loader, ...)` walks `weights.parameter_specs`: each parameter's parts are
read already sliced for this rank, put in their format (quantization.py), and installed:
dense parts concatenated into the parameter (the only copy in memory: a tensor already in
the wanted dtype is not copied again), quantized projections as a `GGMLLinear` in place of
the `nn.Linear`, a quantized embedding as a `GGMLEmbedding` (tied: its weight also serves
the output projection). Every parameter must be filled and every checkpoint tensor used.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.gguf_file import is_gguf
from agentrt.engine.loader.quantization import convert, weight_format
from agentrt.engine.loader.weights import ParamSpec, Shard, WeightLoader, parameter_specs
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.ggml_linear import GGMLEmbedding, GGMLLinear
from agentrt.kernels.ggml_linear import (
    ROWS_INTERLEAVED,
    GGMLWeight,
    default_kernels,
    interleave,
    interleaved_row_bytes,
)


def get_loader(path: str | os.PathLike[str]) -> WeightLoader:
    """The loader of a resolved checkpoint (checkpoint.resolve_model): a .gguf file or an HF
    safetensors directory."""
    if is_gguf(path):
        from agentrt.engine.loader.gguf_loader import GGUFLoader

        return GGUFLoader(path)
    from agentrt.engine.loader.safetensors_loader import SafetensorsLoader

    return SafetensorsLoader(path)


def load_weights(
    model: nn.Module,
    loader: WeightLoader,
    arch: ModelArchConfig,
    *,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
) -> None:
    """Load every parameter of `model` (a LlamaForCausalLM of this rank's share of the full
    model `arch`) from `loader`, in place. `quantization` is concrete (not "auto")."""
    available = loader.names()
    used: set[str] = set()
    for spec in parameter_specs(arch):
        if spec.optional and not all(p in available for p in spec.parts):
            continue
        missing = [p for p in spec.parts if p not in available]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor {missing[0]!r}.")
        used.update(spec.parts)
        parts = [loader.read(p, spec.split, shard) for p in spec.parts]
        vocabulary = spec.name in ("embed_tokens.weight", "lm_head.weight")
        if spec.is_projection or vocabulary:
            parts = [
                convert(p, weight_format(p, quantization, vocabulary=vocabulary), dtype, n)
                for p, n in zip(parts, spec.parts, strict=True)
            ]
        else:
            parts = [convert(p, None, dtype, n) for p, n in zip(parts, spec.parts, strict=True)]
        interleaved = spec.name != "embed_tokens.weight" and device.type == "cpu"
        if len(parts) > 1 and _one_block_type(parts):
            # One kernel call instead of one per part: the rows of a fused qkv / gate_up
            # stacked into one weight (a copy; the map's pages of the parts are released).
            parts = [_fused(parts, loader, interleaved)]
        elif interleaved:
            parts = _kernel_layout(parts, loader)
        _install(model, spec, parts, dtype, device)
    embedding = model.embed_tokens
    if model.lm_head is None and model.logits_proj is None:
        if isinstance(embedding, GGMLEmbedding):  # tied: the same blocks project
            if device.type == "cpu":  # lookups gather their rows from the interleaved blocks
                embedding.weight = _kernel_layout([embedding.weight], loader)[0]
            model.logits_proj = GGMLLinear([embedding.weight])
    elif isinstance(embedding, GGMLEmbedding):  # lookups only: rows read from the file
        embedding.read_rows = loader.row_reader(embedding.weight)
    unused = sorted(n for n in available - used if "rotary_emb" not in n)
    if model.lm_head is None and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")  # tied checkpoints may still store it
    if unused:
        raise ModelLoadError(f"checkpoint has tensors the model does not use: {unused[:5]}")
    factors, scaling = loader.rope_factors(), loader.rope_scaling()
    if factors is not None or scaling is not None:  # the rope the weights come with
        model.rope_factors, model.rope_scaling = factors, scaling
        model.build_rotary(model.rotary.cos_sin_cache.shape[0])
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters not loaded: {left[:5]}"


def _fused(parts: list[GGMLWeight], loader: WeightLoader, interleaved: bool) -> GGMLWeight:
    """Parts of one block type stacked by rows into one weight: interleaved into one buffer
    part by part when the kernels take the type so (`interleaved` allowing), else
    concatenated; the map's pages of the parts released."""
    kernels, first = default_kernels(), parts[0]
    if interleaved and kernels.interleaves(first.qtype):
        if all(p.out_features % ROWS_INTERLEAVED == 0 for p in parts):
            width = interleaved_row_bytes(first.qtype, first.in_features)
            rows = sum(p.out_features for p in parts)
            out = torch.empty(rows // ROWS_INTERLEAVED, width, dtype=torch.uint8)
            start = 0
            for p in parts:
                stop = start + p.out_features // ROWS_INTERLEAVED
                kernels.interleave(p, out[start:stop])
                loader.release([p])
                start = stop
            return GGMLWeight(out, first.qtype, first.in_features, interleaved=True)
    fused = GGMLWeight(torch.cat([p.data for p in parts]), first.qtype, first.in_features)
    loader.release(parts)
    return _kernel_layout([fused], loader)[0] if interleaved else fused


def _kernel_layout(parts: list, loader: WeightLoader) -> list:
    """Each block part the CPU kernels run faster with its rows interleaved by 16
    (kernels/ggml_linear.py `interleave`; `GGMLKernels.interleaves` says which: Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0 and Q4_K on AVX-512, the same less Q4_K on AVX2), interleaved: a copy,
    the map's pages of the part released, so one layout is held (a tied embedding's lookups
    gather their rows from it)."""
    kernels = default_kernels()
    out = []
    for part in parts:
        if (
            isinstance(part, GGMLWeight)
            and not part.interleaved
            and part.out_features % ROWS_INTERLEAVED == 0
            and kernels.interleaves(part.qtype)
        ):
            packed = interleave(part)
            loader.release([part])
            part = packed
        out.append(part)
    return out


def _one_block_type(parts: list) -> bool:
    return all(isinstance(p, GGMLWeight) for p in parts) and len({p.qtype for p in parts}) == 1


def _install(
    model: nn.Module, spec: ParamSpec, parts: list, dtype: torch.dtype, device: torch.device
) -> None:
    module_name, _, attr = spec.name.rpartition(".")
    owner_name, _, child = module_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    quantized = any(isinstance(p, GGMLWeight) for p in parts)
    if quantized and module_name == "embed_tokens":
        model.embed_tokens = GGMLEmbedding(parts[0], dtype)
    elif quantized and module_name == "lm_head":
        model.logits_proj = GGMLLinear(parts)
        model.lm_head = None
    elif quantized:
        setattr(owner, child, GGMLLinear(parts))
    else:
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        tensor = tensor.to(device=device, dtype=dtype)
        module = getattr(owner, child)
        if isinstance(module, GGMLLinear):  # a quantized projection's bias
            module.bias = nn.Parameter(tensor.float(), requires_grad=False)
        else:
            setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
