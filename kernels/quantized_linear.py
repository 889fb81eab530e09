"""Weight-only quantized linear layers: torch's own CPU kernels, each with a pure-torch reference.

Two weight formats, both quantizing a weight (N, K) (out_features, in_features):

    int8  per output channel, symmetric:  w[n, k] = q[n, k] * scale[n]        q in [-127, 127]
    int4  groups of G along k (GGUF's Q4_1 block layout, G = 32 there):
              w[n, k] = q[n, k] * scale[n, g] + min[n, g]     q in [0, 15], g = k // G

A GGUF Q4_1 block is exactly one int4 group (scale = d, min = m); a Q4_0 block is one with
min = -8 d. The kernels are `torch.ops.aten._weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu`. Both take bf16 activations (and scales in the activations'
dtype): with fp32 activations torch runs a scalar path, measured 10-35x slower on a 2-core
AVX-512 machine (576x1536, one row: int4 1.3 ms fp32 vs 40 us bf16), so the wrappers round
the input to bf16, and int4 scales and mins are held in bf16 (torch's int4 kernel computes
(q - 8) * scale + zero, zero = min + 8 * scale). The references dequantize in fp32 and take
the same bf16-rounded input; the kernels match them to bf16 output rounding (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import KernelInputError

COMPUTE_DTYPE = torch.bfloat16  # activations, scales and outputs of the kernels


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """An int4 weight in the format above, unpacked: the form GGUF blocks are read into and
    `quantize_int4` writes. `q` uint8 (N, K) in [0, 15]; `scale`, `min` fp32 (N, K // G)."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """(N, K) fp32: q * scale + min, in GGUF's order of operations."""
        n, k = self.q.shape
        q = self.q.float().view(n, -1, self.group_size)  # (N, G groups, group_size)
        return (q * self.scale[..., None] + self.min[..., None]).view(n, k)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (q int8 (N, K), scale fp32 (N,)): round to nearest, absmax per row."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """weight (N, K) -> Int4Weight with groups of `group_size`: min/max per group, round to
    nearest (llama.cpp's Q4_1). Requantizing a dequantized Q4_1 weight gives back its blocks."""
    n, k = weight.shape
    if k % group_size:
        raise KernelInputError(f"in_features {k} is not a multiple of group_size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)  # (N, groups, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.view(n, k), scale, lo)


def pack_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout: (packed uint8 (N, K / 2), scales_and_zeros bf16 (K / G, N, 2))."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
    zero = weight.min + 8 * weight.scale
    scales_and_zeros = torch.stack([weight.scale, zero], dim=-1)  # (N, groups, 2)
    return packed, scales_and_zeros.transpose(0, 1).contiguous().to(COMPUTE_DTYPE)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ dequantized(q, scale).T -> (M, N) bf16. `scale` bf16 (N,)."""
    if x.dim() != 2 or q.dtype != torch.int8 or x.shape[1] != q.shape[1]:
        raise KernelInputError(f"int8_linear: x {tuple(x.shape)} and int8 weight {q.shape}")
    return torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE), q, scale)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K) @ the packed int4 weight's dequantized form.T -> (M, N) bf16 (CPU only)."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 2 or x.device.type != "cpu":
        raise KernelInputError(
            f"int4_linear: x {tuple(x.shape)} on {x.device} and packed weight {packed.shape}: "
            "expected a CPU x (M, K) with K = 2 * packed.shape[1]"
        )
    x = x.to(COMPUTE_DTYPE)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What int8_linear computes, in fp32 from the bf16-rounded input, not rounded after."""
    x = x.to(COMPUTE_DTYPE).float()
    return F.linear(x, q.float() * scale.float()[:, None])


def int4_linear_ref(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """What int4_linear computes from `pack_int4(weight)`, in fp32 (bf16-rounded input and
    scales, as the kernel holds them), not rounded after."""
    x = x.to(COMPUTE_DTYPE).float()
    scale = weight.scale.to(COMPUTE_DTYPE).float()
    zero = (weight.min + 8 * weight.scale).to(COMPUTE_DTYPE).float()
    n, k = weight.q.shape
    q = weight.q.float().view(n, -1, weight.group_size) - 8
    w = (q * scale[..., None] + zero[..., None]).view(n, k)
    return F.linear(x, w)
