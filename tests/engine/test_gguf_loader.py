"""gguf_loader.py's row permutation of llama Q/K weights (the rest of the loader is tested
through whole loads in test_loader.py and test_gguf_file.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrt.engine.loader.gguf_file import reverse_rope_permute
from agentrt.engine.loader.gguf_loader import _permute_rows


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int16]
)
@pytest.mark.parametrize("shape", [(48, 40), (48,)])
def test_permuted_rows_are_the_rows_in_hf_order(dtype, shape) -> None:
    """Every dtype a part comes in (block rows, F16 / BF16 / F32 weights and biases): the
    same rows as indexing by the permuted row order, contiguous, the source untouched."""
    heads = 3  # 48 rows: 3 heads of 16
    source = (torch.arange(int(np.prod(shape))) % 251).reshape(shape).to(dtype)
    before = source.clone()
    order = torch.from_numpy(reverse_rope_permute(np.arange(shape[0]), heads))
    permuted = _permute_rows(source, heads)
    assert permuted.dtype == dtype and permuted.is_contiguous()
    assert torch.equal(permuted, source[order])
    assert torch.equal(source, before)
    assert not torch.equal(order, torch.arange(shape[0]))  # the order does move rows
