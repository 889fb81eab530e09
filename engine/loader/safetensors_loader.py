"""SafetensorsLoader: an HF checkpoint directory's tensors by name, in their stored dtype.

Each file is opened with `safe_open` (a memory map); a rank's slice is read with
`get_slice`, so a tensor-parallel rank reads only its rows or columns. Nothing is cast here:
the model loader casts to the engine's dtype where it differs (load.py), so a bf16
checkpoint run in bf16 is read once and never held in fp32.

`StateDictLoader` serves a state dict already in memory the same way (tests, the draft
model of speculative decoding).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.checkpoint import safetensors_files
from agentrt.engine.loader.hf_experts import (
    StackedCache,
    aliased_names,
    aliased_table,
    expert_aliases,
)
from agentrt.engine.loader.weights import Shard, Split, slice_dense


class SafetensorsLoader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self._files = {}  # name -> the open file holding it
        self._handles = []
        for file in safetensors_files(path):
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc
            self._handles.append(handle)
            for name in handle.keys():
                if name in self._files:
                    raise ModelLoadError(
                        f"tensor {name!r} appears in more than one shard of {path}"
                    )
                self._files[name] = handle
        # A MoE's experts stored fused or under Mixtral's names, served per expert.
        moe = (n for n in self._files if ".experts." in n or ".block_sparse_moe." in n)
        self._aliases = expert_aliases(
            {n: tuple(self._files[n].get_slice(n).get_shape()) for n in moe}
        )
        self._stacked = StackedCache(lambda n: self._files[n].get_tensor(n))

    def names(self) -> set[str]:
        return aliased_names(set(self._files), self._aliases)

    def release(self, parts: list) -> None:
        pass  # every read is already a copy

    def mapped_pages(self, part) -> None:
        return None  # every read is already a copy

    def row_reader(self, part) -> None:
        return None  # its parts are copies or dense

    def rope_factors(self) -> None:
        return None  # HF checkpoints state their rope scaling in config.json

    def rope_scaling(self) -> None:
        return None

    def read(self, name: str, split: Split, shard: Shard) -> torch.Tensor:
        source = self._aliases.get(name)
        if source is not None and source.expert is not None:  # a part of a fused tensor
            part = source.take(self._stacked.get(source.stored))
            return slice_dense(part, tuple(part.shape), split, shard)
        name = name if source is None else source.stored
        handle = self._files.get(name)
        if handle is None:
            raise ModelLoadError(f"checkpoint {self.path} is missing tensor {name!r}.")
        if split is Split.NONE or shard.size == 1:
            return handle.get_tensor(name)
        tensor = handle.get_slice(name)
        return slice_dense(tensor, tuple(tensor.get_shape()), split, shard)

    def tensor_table(self) -> dict[str, tuple[int, int, int | None]]:
        table = {}
        for name, handle in self._files.items():
            info = handle.get_slice(name)
            numel = math.prod(info.get_shape())
            table[name] = (numel, numel * _dtype_bytes(info.get_dtype()), None)
        return aliased_table(table, self._aliases)


class StateDictLoader:
    """Tensors already in memory, keyed by HF name (slices are views)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self._aliases = expert_aliases({n: tuple(t.shape) for n, t in state.items()})

    def names(self) -> set[str]:
        return aliased_names(set(self.state), self._aliases)

    def release(self, parts: list) -> None:
        pass  # the state dict is the caller's

    def mapped_pages(self, part) -> None:
        return None  # the state dict is the caller's

    def row_reader(self, part) -> None:
        return None  # its parts are copies or dense

    def rope_factors(self) -> None:
        return None  # HF checkpoints state their rope scaling in config.json

    def rope_scaling(self) -> None:
        return None

    def read(self, name: str, split: Split, shard: Shard) -> torch.Tensor:
        source = self._aliases.get(name)
        if source is not None:
            name = source.stored
        if name not in self.state:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}.")
        tensor = self.state[name] if source is None else source.take(self.state[name])
        return slice_dense(tensor, tuple(tensor.shape), split, shard)

    def tensor_table(self) -> dict[str, tuple[int, int, int | None]]:
        table = {n: (t.numel(), t.numel() * t.element_size(), None) for n, t in self.state.items()}
        return aliased_table(table, self._aliases)


def _dtype_bytes(dtype: str) -> int:
    """Bytes of a safetensors dtype name ("F32", "BF16", "I64", ...)."""
    digits = "".join(c for c in dtype if c.isdigit())
    return max(1, int(digits) // 8) if digits else 1
