"""Triton kernel: apply a packed grammar bitmask to logits in place (disallowed -> -inf).

Bitmask layout (xgrammar): int32 [rows, ceil(vocab / 32)], bit i % 32 of word i // 32 set =
token i allowed. Columns past the mask's 32 * words are disallowed.
Imports Triton at module level; reference: `reference_ops.apply_token_bitmask_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_bitmask

# Logit columns per program: 128 int32 mask words, 16 KiB of fp32 logits.
_BLOCK_VOCAB = 4096


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    vocab_size,
    num_words,
    stride_logits_row,
    stride_bitmask_row,
    HAS_INDICES: tl.constexpr,
    BLOCK_VOCAB: tl.constexpr,
):
    # Grid: (rows to mask, column blocks). Writes only the disallowed logits; reads none.
    if HAS_INDICES:
        row = tl.load(indices_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    col_block = tl.program_id(1)
    words = col_block * (BLOCK_VOCAB // 32) + tl.arange(0, BLOCK_VOCAB // 32)
    packed = tl.load(
        bitmask_ptr + row * stride_bitmask_row + words, mask=words < num_words, other=0
    )
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # (BLOCK_VOCAB // 32, 32)
    disallowed = tl.reshape(bits == 0, [BLOCK_VOCAB])
    cols = col_block * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
    neg_inf = tl.full([BLOCK_VOCAB], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(
        logits_ptr + row * stride_logits_row + cols,
        neg_inf,
        mask=(cols < vocab_size) & disallowed,
    )


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Triton version of `apply_token_bitmask_ref` (same arguments, same in-place effect)."""
    check_bitmask(logits, bitmask, indices)
    num_rows = logits.shape[0] if indices is None else indices.shape[0]
    vocab_size = logits.shape[1]
    if num_rows == 0 or vocab_size == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK_VOCAB))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK_VOCAB=_BLOCK_VOCAB,
    )
