"""Rotary position embeddings (neox layout, as HF Llama), with default / linear / llama3 /
longrope scaling, over each head's whole dims or its first `rotary_dim` (partial rotary:
Phi-4-mini turns 96 of 128, the frequencies then those of a 96-dim head, as HF computes)."""

from __future__ import annotations

import math

import torch

import agentrt.kernels as kernels
from agentrt.engine.errors import ModelLoadError


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict | None, factors: torch.Tensor | None = None
) -> torch.Tensor:
    """(head_dim // 2,) float32 on the CPU (also under a meta-device context, where torch's
    reference ops would import torch._dynamo), computed exactly as transformers does.
    `factors`: a divisor per frequency stored with the weights (llama.cpp's `rope_freqs`,
    which a llama 3.x GGUF holds instead of its config's scaling), as llama.cpp applies it."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if factors is not None:
        if factors.shape != inv_freq.shape:
            raise ModelLoadError(
                f"rope_freqs has {factors.numel()} factors; head_dim {head_dim} needs "
                f"{inv_freq.numel()}."
            )
        inv_freq = inv_freq / factors.to(device="cpu", dtype=torch.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if rope_type in ("longrope", "su"):  # the short factors; `rope_table` switches to long
        return _longrope(head_dim, theta, scaling["short_factor"])
    raise ModelLoadError(
        f"rope scaling {rope_type!r} is not supported (default, linear, llama3, longrope)."
    )


def rope_table(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None,
    factors: torch.Tensor | None = None,
    start: int = 0,
) -> torch.Tensor:
    """(max_positions - start, head_dim) fp32, the rows of positions start .. max_positions:
    cos of the head_dim / 2 frequencies at each position, then sin (each row the same
    whatever `start`: elementwise ops). LongRoPE (Phi-3): positions within the original
    context turn with the short factors, those past it with the long ones (transformers
    switches the whole sequence once it is longer: the same up to the original context), cos
    and sin times the attention factor, as transformers does."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, factors)
    positions = torch.arange(start, max_positions, dtype=torch.float32, device="cpu")
    freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("longrope", "su"):
        past = max(0, scaling["original_max_position_embeddings"] - start)  # first long row
        long = _longrope(head_dim, theta, scaling["long_factor"])
        freqs[past:] = positions[past:, None] * long[None, :]
        attention_factor = scaling.get("attention_factor") or 1.0
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _longrope(head_dim: int, theta: float, factors) -> torch.Tensor:
    """transformers' LongRoPE frequencies: 1 / (factor * theta ** (2i / head_dim))."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.as_tensor(factors, dtype=torch.float32, device="cpu") * theta**steps)


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


# Rows a CPU table is filled by at a time (`RotaryEmbedding.cover`): 4 MiB at head_dim 256.
FILL_ROWS = 4096


class RotaryEmbedding:
    """cos and sin of every position, in the kernels package's `cos_sin_cache` layout: (P, R),
    cos of the R / 2 frequencies in the first half, sin in the second; R is `rotary_dim`, the
    dims of each head that turn (None: all, R = D; fewer: partial rotary, the rest pass).
    With `kernel_ops` the kernels package rotates q and k (one fused Triton kernel on CUDA);
    else torch ops follow HF step for step (HF's rounding in bf16, no per-call input checks:
    the CPU path).

    On the CPU the table is filled as positions are reached, FILL_ROWS at a time (`cover`,
    which the model calls before each step): its rows past the longest sequence served are
    never written, so they take no memory (e.g. Gemma 3's two tables of 32,768 positions of
    head_dim 256: 64 MiB filled, 8 MiB once 4,096 positions are). The tensor is the whole
    table from the start, so the fused C paths keep its address and bounds."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        *,
        kernel_ops: bool = False,
        device: torch.device | None = None,
        factors: torch.Tensor | None = None,
        rotary_dim: int | None = None,
    ):
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.kernel_ops = kernel_ops
        self._rope = (theta, scaling, factors)
        if torch.device(device or "cpu").type == "cpu":
            # Untouched pages of a fresh allocation are not resident until `cover` writes them.
            self.cos_sin_cache = torch.empty(max_positions, self.rotary_dim)  # (P, R)
            self.num_filled = 0
        else:
            table = rope_table(self.rotary_dim, max_positions, *self._rope)
            self.cos_sin_cache = table.to(device)  # (P, R)
            self.num_filled = max_positions

    def cover(self, positions: torch.Tensor) -> None:
        """Fill the table's rows up to the largest of `positions` (T,) if not yet filled."""
        num_positions = self.cos_sin_cache.shape[0]
        if self.num_filled == num_positions or positions.numel() == 0:
            return
        needed = int(positions.max()) + 1
        if needed > self.num_filled:
            start, stop = self.num_filled, min(num_positions, -(-needed // FILL_ROWS) * FILL_ROWS)
            rows = rope_table(self.rotary_dim, stop, *self._rope, start=start)
            self.cos_sin_cache[start:stop] = rows
            self.num_filled = stop

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotate:
        """The rotation of one step's tokens at `positions` (T,), shared by every layer."""
        self.cover(positions)
        if self.kernel_ops:
            return Rotate(positions, self.cos_sin_cache, None, None, self.head_dim)
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        # Both halves of the turning dims take the same angles: (T, R/2) -> (T, 1, R).
        cos, sin = cos.repeat(1, 2)[:, None, :], sin.repeat(1, 2)[:, None, :]
        return Rotate(positions, self.cos_sin_cache, cos, sin, self.head_dim)


class Rotate:
    """One step's rotation. `rotate(q, k)` returns the rotated q (T, H, D) and k (T, KVH, D)
    (in place through the kernels package when built with `kernel_ops`, i.e. without cos /
    sin); `rotate.heads(x)` rotates any (T, heads, D) tensor with torch ops (q and k side by
    side in one call)."""

    __slots__ = ("positions", "cos_sin_cache", "cos", "sin", "head_dim")

    def __init__(self, positions, cos_sin_cache, cos, sin, head_dim: int) -> None:
        self.positions = positions  # (T,)
        self.cos_sin_cache = cos_sin_cache  # (P, R)
        self.cos, self.sin = cos, sin  # (T, 1, R) in the model's dtype, or None
        self.head_dim = head_dim

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None:
            kernels.rotary_embedding(self.positions, q, k, self.cos_sin_cache, self.head_dim)
            return q, k
        return self.heads(q), self.heads(k)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) -> rotated (T, H, D), neox style: rotate_half on the two halves of its
    first R dims, cos and sin (T, 1, R); with R < D the other dims pass through (HF's
    apply_rotary_pos_emb for a partial rotary factor)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((turned, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
