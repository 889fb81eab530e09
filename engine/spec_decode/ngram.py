"""N-gram prompt lookup: draft what followed the last time the request's latest tokens
appeared in its own prompt or output (vLLM's `ngram` method; Saxena 2023).

For the longest n in [prompt_lookup_min, prompt_lookup_max] whose last-n-token suffix occurs
earlier in the request (a match must start before the suffix itself), the most recent such
occurrence is taken and the up to `max_tokens` tokens after it are proposed, never reading
past the end of the request's tokens.

The search is numpy over candidate positions: the positions equal to the last token, then
kept while the token n back also matches, so one step costs O(len) comparisons once plus
O(candidates) per extra n, with no Python loop over the context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.text_lookup import TextLookup


class TokenArrays:
    """Each request's tokens as a numpy array, grown by the new tail on every call instead of
    converting the whole list each step. Capacity doubles, so appends are amortised O(1)."""

    def __init__(self) -> None:
        # req_id -> (the list read, buffer, number of its tokens in the buffer)
        self._arrays: dict[str, tuple[Sequence[int], np.ndarray, int]] = {}

    def get(self, context: DraftContext) -> np.ndarray:
        """`context.token_ids` then its `draft_ids` as an int64 array (a view, valid until
        the next call). The drafts are written after the request's tokens, not kept."""
        token_ids = context.token_ids
        length = len(token_ids)
        total = length + len(context.draft_ids)
        source, buffer, known = self._arrays.get(context.req_id, (None, None, 0))
        # A request's list only ever grows. Another list under the same req_id, a shorter one
        # or a changed last known token means it is not the same request: read it anew.
        if (
            source is not token_ids
            or known > length
            or (known and buffer[known - 1] != token_ids[known - 1])
        ):
            buffer, known = np.empty(max(2 * total, 16), dtype=np.int64), 0
        elif total > buffer.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if length > known:
            buffer[known:length] = token_ids[known:length]
        buffer[length:total] = context.draft_ids
        self._arrays[context.req_id] = (token_ids, buffer, length)
        return buffer[:total]

    def drop(self, req_id: str) -> None:
        self._arrays.pop(req_id, None)


def earlier_matches(tokens: np.ndarray, max_n: int) -> tuple[int, np.ndarray]:
    """The longest n <= `max_n` such that the last n tokens occur earlier in `tokens` (starting
    before the suffix itself, so each occurrence has at least one token after it), and the end
    positions of those occurrences in increasing order. `(0, empty)` when no token repeats."""
    length = tokens.shape[0]
    # ends[e]: an occurrence of the last n tokens ends at e (e <= length - 2).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) if length >= 2 else None
    if ends is None or ends.size == 0:
        return 0, np.empty(0, dtype=np.int64)
    n = 1
    while n < max_n and n < length - 1:
        longer = ends[ends >= n]  # the occurrence can reach n tokens back
        longer = longer[tokens[longer - n] == tokens[length - 1 - n]]
        if longer.size == 0:
            break
        ends, n = longer, n + 1
    return n, ends


class NgramProposer:
    """Prompt lookup over each request's own tokens, and by text in its prompt where the text
    knows better (`TextLookup.propose_with`, given a tokenizer). Keeps a numpy copy
    per running request (dropped in `request_finished`); learns nothing across requests."""

    method = "ngram"

    def __init__(self, config: SpeculativeConfig, tokenizer=None) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._tokens = TokenArrays()
        self._text = TextLookup(tokenizer) if tokenizer is not None else None

    def propose(self, contexts: list[DraftContext], max_tokens: list[int]) -> list[list[int]]:
        return [self._propose_one(c, n) for c, n in zip(contexts, max_tokens, strict=True)]

    def _propose_one(self, context: DraftContext, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or context.num_tokens <= self.min_n:
            return []
        if self._text is None:
            return self._match(context, max_tokens)[2]
        return self._text.propose_with(
            context, max_tokens, lambda: self._match(context, max_tokens)
        )

    def _match(self, context: DraftContext, max_tokens: int) -> tuple[int, bool, list[int]]:
        """The longest n-gram match: its length, whether it lies in the prompt only, and the
        tokens after its most recent occurrence ([] below `prompt_lookup_min`)."""
        tokens = self._tokens.get(context)
        n, ends = earlier_matches(tokens, self.max_n)
        copied = n > 0 and int(ends[-1]) < context.num_prompt_tokens
        if n < self.min_n:
            return n, copied, []
        start = int(ends[-1]) + 1  # the most recent occurrence
        return n, copied, tokens[start : start + max_tokens].tolist()

    def request_finished(self, context: DraftContext, completed: bool) -> None:
        self._tokens.drop(context.req_id)
        if self._text is not None:
            self._text.drop(context.req_id)
