"""What a loader yields: the model's parameters by the model's own names, each made of the
checkpoint tensors (HF names) it fuses, sliced for one tensor-parallel rank.

    layers.{i}.qkv_proj.weight      q_proj, k_proj, v_proj rows    column-parallel
    layers.{i}.qkv_proj.bias        their biases (Qwen2)           column-parallel
    layers.{i}.o_proj.weight        o_proj                         row-parallel
    layers.{i}.gate_up_proj.weight  gate_proj, up_proj rows        column-parallel
    layers.{i}.down_proj.weight     down_proj                      row-parallel
    norms, embed_tokens, lm_head                                   whole on every rank

Column-parallel splits each part's output rows into `size` equal slices, row-parallel the
input columns (model/parallel.py has the layout). A part is a dense torch tensor in the
checkpoint's dtype, or a `GGMLWeight` (kernels/ggml_linear.py): a GGUF tensor's rows in its
own block format.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from agentrt.engine.model.arch import ModelArchConfig
from agentrt.kernels.ggml_linear import GGMLWeight


class Split(enum.Enum):
    NONE = "none"  # replicated
    COLUMN = "column"  # output rows (dim 0) split between ranks
    ROW = "row"  # input columns (dim 1) split between ranks


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's tensor-parallel rank; Shard(0, 1) without tensor parallelism."""

    rank: int
    size: int

    def span(self, n: int) -> tuple[int, int]:
        """Rank's [start, stop) of `n` elements split evenly (n divides by size: checked by
        parallel.check_tensor_parallel before loading)."""
        step = n // self.size
        return self.rank * step, (self.rank + 1) * step


Part = torch.Tensor | GGMLWeight


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of the engine's model: `parts` (checkpoint names) concatenated along
    the output rows, split by `split`. `optional`: a tied model's checkpoint may lack it."""

    name: str
    parts: tuple[str, ...]
    split: Split
    optional: bool = False

    @property
    def is_projection(self) -> bool:
        """A decoder layer's matrix (quantization applies to these and the vocabulary ones)."""
        return self.name.startswith("layers.") and self.name.endswith("proj.weight")


class WeightLoader(Protocol):
    """A checkpoint in one format (safetensors_loader.py, gguf_loader.py)."""

    def names(self) -> set[str]:
        """Every tensor the checkpoint holds, by HF name."""
        ...

    def read(self, name: str, split: Split, shard: Shard) -> Part:
        """Rank `shard`'s slice of tensor `name`: reads only that slice where the format
        allows (raises ModelLoadError when the checkpoint lacks it)."""
        ...

    def tensor_table(self) -> dict[str, tuple[int, int, int | None]]:
        """HF name -> (elements, bytes stored, GGML block type or None for dense), read
        from the checkpoint's header alone (fit.py)."""
        ...

    def release(self, parts: list[Part]) -> None:
        """Parts read from this loader were copied: drop what holds their source bytes in
        memory, if anything (the GGUF map's pages; nothing for the others)."""
        ...

    def mapped_pages(self, part: Part) -> tuple[int, int] | None:
        """The whole pages of this loader's memory map that `part` (a view of the map) covers,
        as (address, bytes), for a caller that drops them itself once the part is copied
        (`release` drops the same pages); None where the part is no view of a map."""
        ...

    def row_reader(self, part: Part) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For a block-format embedding read from this loader and used for lookups only: a
        function of row ids (int64) that reads those rows of `part` from the file, (T, row
        bytes) uint8, without mapping them; None where the part is not read from a file."""
        ...

    def rope_factors(self) -> torch.Tensor | None:
        """The divisors of the rope frequencies (head_dim / 2,) fp32 that the checkpoint
        stores as a tensor (a llama 3.x GGUF's `rope_freqs`), or None."""
        ...

    def rope_scaling(self) -> dict | None:
        """Rope scaling the checkpoint stores beside its config (a Phi-3 GGUF's LongRoPE
        factors), in config.json's `rope_scaling` form; None when the config has it all."""
        ...


def parameter_specs(arch: ModelArchConfig) -> list[ParamSpec]:
    """Every parameter of the model of `arch` (model/decoder.py, the full model, before
    sharding), by the checkpoint's HF names."""
    specs = [
        ParamSpec("embed_tokens.weight", ("model.embed_tokens.weight",), Split.NONE),
        ParamSpec("norm.weight", ("model.norm.weight",), Split.NONE),
        ParamSpec(
            "lm_head.weight", ("lm_head.weight",), Split.NONE, optional=arch.tie_word_embeddings
        ),
    ]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        attn = tuple(f"{p}self_attn.{n}_proj" for n in "qkv")
        qkv_parts = tuple(f"{n}.weight" for n in attn)
        gate_up_parts = (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight")
        if arch.fused_projections:  # stored fused (Phi-3): one part each
            qkv_parts, gate_up_parts = (
                (f"{p}self_attn.qkv_proj.weight",),
                (f"{p}mlp.gate_up_proj.weight",),
            )
        specs += [
            *_norm_specs(arch, p, m),
            ParamSpec(f"{m}qkv_proj.weight", qkv_parts, Split.COLUMN),
            ParamSpec(f"{m}o_proj.weight", (f"{p}self_attn.o_proj.weight",), Split.ROW),
        ]
        specs += _mlp_specs(arch, p, m, gate_up_parts)
        if arch.qkv_bias:
            specs.append(
                ParamSpec(f"{m}qkv_proj.bias", tuple(f"{n}.bias" for n in attn), Split.COLUMN)
            )
        if arch.qk_norm:
            specs += [
                ParamSpec(f"{m}q_norm.weight", (f"{p}self_attn.q_norm.weight",), Split.NONE),
                ParamSpec(f"{m}k_norm.weight", (f"{p}self_attn.k_norm.weight",), Split.NONE),
            ]
    return specs


def _mlp_specs(
    arch: ModelArchConfig, p: str, m: str, gate_up_parts: tuple[str, ...]
) -> list[ParamSpec]:
    """A layer's MLP: the dense gate_up / down, or a sparse MoE's router and each expert's
    (HF's per-expert names; a GGUF's 3-D expert tensors are read one expert at a time)."""
    if not arch.num_experts:
        return [
            ParamSpec(f"{m}gate_up_proj.weight", gate_up_parts, Split.COLUMN),
            ParamSpec(f"{m}down_proj.weight", (f"{p}mlp.down_proj.weight",), Split.ROW),
        ]
    specs = [ParamSpec(f"{m}mlp.gate.weight", (f"{p}mlp.gate.weight",), Split.NONE)]
    for e in range(arch.num_experts):
        hf, ours = f"{p}mlp.experts.{e}.", f"{m}mlp.experts.{e}."
        gate_up = (f"{hf}gate_proj.weight", f"{hf}up_proj.weight")
        specs += [
            ParamSpec(f"{ours}gate_up_proj.weight", gate_up, Split.COLUMN),
            ParamSpec(f"{ours}down_proj.weight", (f"{hf}down_proj.weight",), Split.ROW),
        ]
    return specs


def _norm_specs(arch: ModelArchConfig, p: str, m: str) -> list[ParamSpec]:
    """A layer's norms (model/decoder.py's names) by the layout. HF's Gemma names its pre-MLP
    norm `pre_feedforward_layernorm` and the norm of attention's output
    `post_attention_layernorm`, which is Llama's pre-MLP norm; OLMo 2 has only the norms
    of the outputs, under Gemma's names."""
    names = {"input_layernorm": "input_layernorm"}
    if arch.norm_layout == "sandwich":
        names |= {
            "post_attention_layernorm": "pre_feedforward_layernorm",
            "attn_output_norm": "post_attention_layernorm",
            "mlp_output_norm": "post_feedforward_layernorm",
        }
    elif arch.norm_layout == "post":
        names = {
            "attn_output_norm": "post_attention_layernorm",
            "mlp_output_norm": "post_feedforward_layernorm",
        }
    else:
        names |= {"post_attention_layernorm": "post_attention_layernorm"}
    return [
        ParamSpec(f"{m}{ours}.weight", (f"{p}{theirs}.weight",), Split.NONE)
        for ours, theirs in names.items()
    ]


def slice_dense(tensor, shape: tuple[int, ...], split: Split, shard: Shard):
    """Rank `shard`'s slice of a tensor-like (a torch tensor, or a safetensors slice, which
    then reads only those bytes) of `shape`."""
    if split is Split.NONE or shard.size == 1:
        return tensor[...] if len(shape) else tensor
    if split is Split.COLUMN or len(shape) == 1:
        start, stop = shard.span(shape[0])
        return tensor[start:stop]
    start, stop = shard.span(shape[1])
    return tensor[:, start:stop]
