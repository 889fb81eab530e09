"""Rotary position embeddings (neox layout, as HF Llama), with default/linear/llama3 scaling."""

from __future__ import annotations

import math

import torch

from agentrt.engine.errors import ModelLoadError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """(head_dim // 2,) float32, computed exactly as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ModelLoadError(f"rope scaling {rope_type!r} is not supported (default, linear, llama3).")


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are scaled down by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin for `positions` (T,), shaped (T, 1, D) to broadcast over heads."""
        cos = self.cos.index_select(0, positions).to(dtype)[:, None, :]
        sin = self.sin.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) -> rotated (T, H, D), neox style: rotate_half on the two halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
