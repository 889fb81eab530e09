"""Pure-torch references for the elementwise kernels: grammar bitmask, RMSNorm and RoPE.

They define what the Triton kernels compute and are the engine's CPU path. Arithmetic runs in
fp32 and results are rounded once to the input dtype.
"""

from __future__ import annotations

import torch

from .checks import check_bitmask, check_rms_norm, check_rotary


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size]; True = allowed.

    Bit i % 32 of word i // 32 is token i (xgrammar layout). Tokens past the mask's
    32 * words columns are not allowed: a token the grammar never saw must not be sampled.
    """
    rows, words = bitmask.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (rows, words, 32)
    allowed = bits.reshape(rows, words * 32).bool()
    if vocab_size <= words * 32:
        return allowed[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place: logits[r, t] = -inf wherever bitmask row r disallows token t.

    logits: [batch, vocab]; bitmask: int32 [batch, ceil(vocab / 32)] (xgrammar layout).
    indices: the rows to mask (of both logits and bitmask, as in xgrammar); all rows if None.
    Columns of logits beyond 32 * bitmask.shape[1] are set to -inf.
    """
    check_bitmask(logits, bitmask, indices)
    rows = indices.long() if indices is not None else None
    mask_rows = bitmask if rows is None else bitmask[rows]
    allowed = unpack_bitmask(mask_rows, logits.shape[1])
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, HF Llama numerics: normalise in fp32, cast, times weight.

    With `residual`, first h = x + residual (the new residual, in x's dtype), then normalise
    h; returns (out, h) (vLLM's fused_add_rms_norm, without mutating inputs). Else returns out.
    """
    check_rms_norm(x, weight, residual)
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, h)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> None:
    """In place RoPE on query and key ([T, H * D] or [T, H, D]) at per-token positions.

    cos_sin_cache: [max_position, rot_dim], cos in the first rot_dim / 2 columns, sin in the
    rest (vLLM layout). Only the first rot_dim dims of each head rotate. Neox style pairs
    dim i with i + rot_dim / 2; GPT-J style (is_neox=False) pairs 2i with 2i + 1.
    """
    check_rotary(positions, query, key, cos_sin_cache, head_size)
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()  # (T, rot_dim)
    cos = cos_sin[:, None, :half]  # (T, 1, half)
    sin = cos_sin[:, None, half:]
    for t in (query, key):
        if t is None:
            continue
        heads = t.view(t.shape[0], -1, head_size)  # (T, H, D), shares storage with t
        rot = heads[..., :rot_dim].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            rotated = torch.cat([o1, o2], dim=-1)
        else:
            rotated = torch.stack([o1, o2], dim=-1).flatten(-2)  # (T, H, half, 2) -> rot_dim
        heads[..., :rot_dim] = rotated.to(t.dtype)
