"""HF MoE checkpoints' other expert layouts, served under the per-expert names the engine
loads (weights.py: `model.layers.{i}.mlp.gate.weight`, the router, and
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`):

    transformers 5's fused 3-D tensors    mlp.experts.gate_up_proj (E, 2 I, H): gate rows, then up
                                          mlp.experts.down_proj    (E, H, I)
    Mixtral's released checkpoints        block_sparse_moe.gate.weight (the router)
                                          block_sparse_moe.experts.{e}.w1 / w3 / w2.weight
                                          (gate, up, down)

The safetensors and state-dict loaders read an aliased name from its stored tensor: a
renamed one as it is, an expert's part of a fused one as a slice of it (the stacked tensor
is read once and kept while its experts are read in turn).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# Mixtral's expert matrices by transformers' Llama-style names.
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL = re.compile(r"(.*)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)$")
_FUSED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True, slots=True)
class ExpertSource:
    """Where an aliased tensor is stored: `stored`, whole (`expert` None), or expert
    `expert`'s matrix of it, all its rows (`half` None) or its gate (0) or up (1) half."""

    stored: str
    expert: int | None = None
    half: int | None = None

    def take(self, tensor):
        """This source's part of `tensor`, the stored tensor (or a safetensors slice)."""
        if self.expert is None:
            return tensor
        matrix = tensor[self.expert]  # (2 I, H) or (H, I)
        if self.half is None:
            return matrix
        rows = matrix.shape[0] // 2
        return matrix[self.half * rows : (self.half + 1) * rows]


def expert_aliases(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, ExpertSource]:
    """Per-expert name -> its source, for the stored tensors (`shapes`: name -> shape) in
    one of the other layouts; empty for a checkpoint already in per-expert names."""
    aliases = {}
    for name, shape in shapes.items():
        if mixtral := _MIXTRAL.match(name):
            head, tail, expert, part = mixtral.groups()
            if expert is None:  # the router
                aliases[f"{head}.mlp.gate.weight"] = ExpertSource(name)
            else:
                ours = f"{head}.mlp.experts.{expert}.{_MIXTRAL_PARTS[part]}.weight"
                aliases[ours] = ExpertSource(name)
        elif (fused := _FUSED.match(name)) and len(shape) == 3:
            head, kind = fused.groups()
            for e in range(shape[0]):
                prefix = f"{head}.mlp.experts.{e}."
                if kind == "down_proj":
                    aliases[f"{prefix}down_proj.weight"] = ExpertSource(name, e)
                else:
                    aliases[f"{prefix}gate_proj.weight"] = ExpertSource(name, e, 0)
                    aliases[f"{prefix}up_proj.weight"] = ExpertSource(name, e, 1)
    return aliases


def aliased_names(stored: set[str], aliases: Mapping[str, ExpertSource]) -> set[str]:
    """The names a loader serves: its stored ones, each aliased one under its new names."""
    return (stored - {s.stored for s in aliases.values()}) | set(aliases)


def aliased_table(
    table: dict[str, tuple[int, int, int | None]], aliases: Mapping[str, ExpertSource]
) -> dict[str, tuple[int, int, int | None]]:
    """A loader's `tensor_table` (stored names) under the served names: an expert's part of a
    fused tensor counts its share of the elements and bytes."""
    sources = {s.stored for s in aliases.values()}
    # Matrices per fused tensor: its experts' (gate and up halves counted once here).
    experts = Counter(s.stored for s in aliases.values() if s.expert is not None and s.half != 1)
    out = {n: v for n, v in table.items() if n not in sources}
    for name, source in aliases.items():
        numel, stored, qtype = table[source.stored]
        share = 1
        if source.expert is not None:
            share = experts[source.stored] * (1 if source.half is None else 2)
        out[name] = (numel // share, stored // share, qtype)
    return out


class StackedCache:
    """The fused tensors read last, kept while their experts are read (load.py reads a layer's
    experts in turn, each expert's gate_up then its down: two stored tensors alternate), so
    each is read from the checkpoint once."""

    def __init__(self, read: Callable[[str], torch.Tensor], size: int = 2) -> None:
        self._read, self._size = read, size
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            if len(self._tensors) == self._size:
                del self._tensors[next(iter(self._tensors))]  # the oldest
            self._tensors[name] = self._read(name)
        return self._tensors[name]
