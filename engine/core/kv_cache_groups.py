"""KV cache groups: which layers share a block table (vLLM's hybrid KV cache manager, smaller).

A model of full-attention layers only has one group of every layer: one block table per
request, one cache tensor per layer, each block holding a position range of every layer.

A model with sliding-window layers (Gemma 2/3) keeps its full-attention and its sliding
layers in separate groups, each with its own block table, so that a sliding group can give
back the blocks that fall wholly out of its window (KVCacheManager). All groups draw from one
pool of blocks, and every group has the same number of layers, `group_size` (the last group of
each kind may be short: its missing layers are memory left unused): there are `group_size`
cache tensors, and tensor j holds the j-th layer of every group. A block belongs to one group
at a time, so its slice of each tensor belongs to one layer at a time, and a block costs
`group_size` layers' KV, not `num_layers`'.

Gemma 3 1B (26 layers, a global one every 6th): 4 full layers, 22 sliding ones, group size 4,
1 full group + 6 sliding groups (28 slots for 26 layers). At 4,096 tokens, window 512 and
blocks of 16 a request holds 256 + 6 * 33 blocks of 4 layers = 1,816 layer-blocks, against
256 blocks of 26 layers = 6,656 when every layer keeps its whole history.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layer indices; the group's i-th uses cache tensor i
    sliding_window: int | None  # None: full attention (the group keeps every position)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The groups of a model: full-attention groups first, so group 0 keeps every position
    whenever the model has a full-attention layer (a draft model's and a KV connector's
    block ids are group 0's)."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def group_size(self) -> int:
        """Layers per group: the number of cache tensors, and of layers a block holds."""
        return max(len(group.layers) for group in self.groups)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(group.sliding_window for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether any group frees blocks behind a window (more than today's one table)."""
        return any(window is not None for window in self.sliding_windows)

    def layer_places(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, cache tensor) of each model layer."""
        places = [(0, 0)] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                places[layer] = (g, slot)
        return places


def kv_cache_layout(arch: ModelArchConfig) -> KVCacheLayout:
    """The groups of `arch`: one group of every layer unless it has sliding-window layers;
    then groups of `min(full, sliding)` layers (vLLM's choice; a model of sliding layers
    only is one group)."""
    layers = range(arch.num_layers)
    window = arch.sliding_window
    if not arch.has_sliding_layers or window is None:
        return KVCacheLayout((KVCacheGroup(tuple(layers), None),))
    full = [i for i in layers if not arch.is_sliding(i)]
    sliding = [i for i in layers if arch.is_sliding(i)]
    size = min(len(full), len(sliding)) or len(sliding)
    groups = [KVCacheGroup(tuple(full[i : i + size]), None) for i in range(0, len(full), size)]
    groups += [
        KVCacheGroup(tuple(sliding[i : i + size]), window) for i in range(0, len(sliding), size)
    ]
    return KVCacheLayout(tuple(groups))


def check_kv_cache_layout(
    arch: ModelArchConfig, *, kv_connector: str | None, draft_arch: ModelArchConfig | None
) -> None:
    """Raise `ConfigError` for what a model with sliding-window groups cannot run with yet:
    a KV connector (it moves one block table per request, group 0's), and a draft model
    of sliding-window layers or beside a target with no full-attention group (the draft's
    KV sits in group 0's blocks, which must keep every position)."""
    layout = kv_cache_layout(arch)
    if kv_connector is not None and layout.is_hybrid:
        raise ConfigError(
            f"kv_connector={kv_connector!r}: {arch.architecture} has sliding-window layers, "
            "whose blocks the KV connectors do not move yet (they move one block table per "
            "request); run it without kv_connector."
        )
    if draft_arch is None:
        return
    if kv_cache_layout(draft_arch).is_hybrid or layout.sliding_windows[0] is not None:
        raise ConfigError(
            f"a draft model's KV sits in the target's group 0 blocks, which must keep every "
            f"position: the draft {draft_arch.architecture} has sliding-window layers, or the "
            f"target {arch.architecture} has no full-attention layer; use a draft of "
            "full-attention layers only, or the 'ngram' method."
        )


def max_request_tokens(
    layout: KVCacheLayout, num_blocks: int, block_size: int, max_chunk_tokens: int
) -> int:
    """Tokens one request can hold, alone, in a pool of `num_blocks` blocks: every block's
    for one group. A sliding group holds at most its window's blocks, those one step's
    chunk (at most `max_chunk_tokens`) fills and the one being written; the full groups
    hold every block. (A model of sliding groups only is counted as if each held every
    block: a bound, not the most.)"""
    if not layout.is_hybrid:
        return num_blocks * block_size
    num_sliding = sum(window is not None for window in layout.sliding_windows)
    num_full = len(layout.groups) - num_sliding
    window = max(window or 0 for window in layout.sliding_windows)
    cap = -(-(window - 1 + max_chunk_tokens) // block_size) + 1  # a sliding group's most
    per_group = num_blocks // len(layout.groups)
    if num_full and per_group >= cap:
        per_group = (num_blocks - num_sliding * cap) // num_full
    return per_group * block_size
