"""A step's grammar bitmask applied to its logits, a word at a time on the CPU.

The bitmask format is grammar/bitmask.py's: int32 `[rows, ceil(V / 32)]`, bit `i % 32` of
word `i // 32` set = token `i` allowed. `agentrt.kernels.apply_token_bitmask` defines the
result (Triton on CUDA; elsewhere its pure-torch reference, which unpacks every bit of the
selected rows into a `[R, V]` bool tensor and masks every logit through it: several passes
over R x V, e.g. 3-8 ms a step for 8 rows of Qwen2.5's 151,936 tokens on one core).

A grammar's row is mostly whole words of one kind: between JSON tokens nearly every word is
0 (all banned), inside a string nearly every word is -1 (all allowed). So here each word
costs what it needs: an all-allowed word nothing, an all-banned word one 32-logit fill, and
only mixed words are unpacked bit by bit. The result is the reference's, bit for bit
(tests/engine/worker/test_grammar_mask.py); benchmarks/grammar_mask.py measures both.
"""

from __future__ import annotations

import torch

from agentrt.kernels import apply_token_bitmask
from agentrt.kernels.checks import check_bitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: `logits[r, t] = -inf` for each row `r` in `rows` and each token `t` that
    bitmask row `r` does not allow (columns past `32 * bitmask.shape[1]` included), as
    `apply_token_bitmask(logits, bitmask, rows)`. `logits` `[B, V]` (float), `bitmask`
    int32 `[B, W]`, `rows` `[R]` int64 (distinct). Other rows are not touched."""
    if logits.device.type != "cpu":
        apply_token_bitmask(logits, bitmask, rows)
        return
    check_bitmask(logits, bitmask, rows)
    rows = rows.long()
    vocab = logits.shape[1]
    num_cols = min(vocab, 32 * bitmask.shape[1])  # columns the bitmask covers
    num_words = num_cols // 32  # whole words among them
    words = bitmask[rows, :num_words]  # (R, num_words)
    blocks = logits[:, : 32 * num_words].unflatten(1, (num_words, 32))  # (B, num_words, 32)
    row, word = torch.nonzero(words == 0, as_tuple=True)  # all 32 tokens banned
    blocks[rows[row], word] = float("-inf")
    row, word = torch.nonzero((words != 0) & (words != -1), as_tuple=True)  # some banned
    if len(row):
        banned = ((words[row, word].unsqueeze(1) >> _SHIFTS) & 1) == 0  # (M, 32)
        at = (rows[row], word)
        blocks[at] = blocks[at].masked_fill_(banned, float("-inf"))
    if num_cols > 32 * num_words:  # a vocabulary that ends inside a word: its last bits
        start = 32 * num_words
        last = bitmask[rows, num_words].unsqueeze(1) >> _SHIFTS[: num_cols - start]
        tail = logits[rows, start:num_cols]  # (R, num_cols - start)
        logits[rows, start:num_cols] = tail.masked_fill_((last & 1) == 0, float("-inf"))
    if num_cols < vocab:  # columns the grammar never saw
        logits[rows, num_cols:] = float("-inf")
