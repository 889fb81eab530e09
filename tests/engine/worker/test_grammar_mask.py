"""apply_grammar_bitmask (a word at a time) gives the logits the reference kernel gives, bit
for bit: grammar-like rows (few tokens allowed, or nearly all), random rows, a subset of
rows, a vocabulary that ends inside a word, logits wider than the mask, fp32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrt.engine.worker.grammar_mask import apply_grammar_bitmask
from agentrt.kernels import apply_token_bitmask_ref


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> the int32 [R, ceil(V / 32)] bitmask (bit i % 32 of word i // 32)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    packed = np.packbits(padded.numpy(), axis=1, bitorder="little")  # (R, 4 W) bytes
    return torch.from_numpy(packed.view(np.int32).copy())


def masks(rows: int, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    few = torch.zeros(rows, vocab, dtype=torch.bool)  # between JSON tokens: a handful
    few[
        torch.arange(rows).repeat_interleave(5), torch.randint(0, vocab, (5 * rows,), generator=gen)
    ] = True
    most = torch.ones(rows, vocab, dtype=torch.bool)  # inside a string: all but a few
    most[
        torch.arange(rows).repeat_interleave(50),
        torch.randint(0, vocab, (50 * rows,), generator=gen),
    ] = False
    noise = torch.rand(rows, vocab, generator=gen) < 0.5
    mixed = torch.cat([few[: rows // 2], most[rows // 2 :]])
    return {"few": pack(few), "most": pack(most), "noise": pack(noise), "mixed": pack(mixed)}


@pytest.mark.parametrize("vocab,num_cols", [(4096, 4096), (1000, 1000), (1000, 1056), (70, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_logits_as_the_reference(vocab: int, num_cols: int, dtype: torch.dtype):
    num_rows = 6
    logits = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(1))
    logits = logits.to(dtype)
    for kind, bitmask in masks(num_rows, vocab).items():
        for rows in (
            torch.arange(num_rows),
            torch.tensor([4, 1]),
            torch.tensor([], dtype=torch.long),
        ):
            want, got = logits.clone(), logits.clone()
            apply_token_bitmask_ref(want, bitmask, rows)
            apply_grammar_bitmask(got, bitmask, rows)
            assert torch.equal(got, want), (kind, rows.tolist())
            untouched = [r for r in range(num_rows) if r not in rows.tolist()]
            assert torch.equal(got[untouched], logits[untouched])
            if len(rows):  # it did mask something, and only what the grammar bans
                assert torch.isinf(got[rows]).any()
                assert torch.isfinite(got[rows, :vocab][bitmask_allows(bitmask[rows], vocab)]).all()


def bitmask_allows(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))


def test_bad_shapes_are_refused():
    from agentrt.kernels import KernelInputError

    with pytest.raises(KernelInputError):
        apply_grammar_bitmask(
            torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), torch.arange(2)
        )
