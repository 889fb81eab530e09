"""Suffix cache across requests (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975): agent
loops and extraction pipelines repeat themselves, so what earlier requests with the same
`cache_key` wrote is a good guess of what this one writes next.

The draft for a request is read from its own prompt + output together with the completed
outputs of earlier requests that share its key:

1. match: the longest suffix of the request's tokens (at least `prompt_lookup_min`, at most
   MAX_MATCH_TOKENS) that occurs, followed by at least one token, in a cached output or
   earlier in the request itself; every such occurrence is kept;
2. extend: append the token that most occurrences continue with (ties: the lowest id), keep
   only the occurrences that continue with it, and repeat while any is left, up to
   `max_tokens`. A cached output's end stops its occurrences, the request's end its own.

This is the paper's frequency-weighted walk down a suffix tree, on a flat structure that is
exact and cheap to maintain: per key, the outputs concatenated with a separator, and the
positions of each token (`_KeyOutputs`). One step costs one O(len) comparison over the
request's own tokens, then numpy over the occurrences of its last token, each compared up to
MAX_MATCH_TOKENS back (about 0.8 ms with 1,024 near-identical cached outputs of 500 tokens
under one key, 0.2 ms for a 30k-token request alone, on this project's 2-core dev machine).

Only outputs of completed requests are learnt (tokens after the prompt). At most
`suffix_cache_max_requests` outputs are kept over all keys together, the oldest forgotten
first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import numpy as np

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.ngram import TokenArrays
from agentrt.engine.spec_decode.text_lookup import TextLookup

# Longest suffix matched (ArcticInference's default suffix-tree depth): longer matches rarely
# change the draft, and each extra token costs a numpy pass over the occurrences.
MAX_MATCH_TOKENS = 24
# Separates cached outputs (token ids are >= 0): no match or continuation crosses it.
_SEPARATOR = -1


def _grown(buffer: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`buffer` with room for at least `size` entries (doubling; new room holds `fill`)."""
    if size <= buffer.shape[0]:
        return buffer
    grown = np.full(max(size, 2 * buffer.shape[0]), fill, dtype=np.int64)
    grown[: buffer.shape[0]] = buffer
    return grown


class _KeyOutputs:
    """The cached outputs of one key, append-only: `tokens[:length]` is SEP out_0 SEP out_1 SEP
    ... with every token between separators, and `positions[t][:counts[t]]` the positions of
    token t, ascending. Forgetting the oldest output only moves `first_live` past it (a query
    ignores positions below); the dead front is cut off once it is half of the array.
    Learning costs numpy over the new output plus one append per distinct token in it."""

    def __init__(self) -> None:
        self.tokens = np.full(256, _SEPARATOR, dtype=np.int64)
        self.length = 1  # the leading separator
        self.first_live = 1
        self.output_starts: deque[int] = deque()
        self.positions: dict[int, np.ndarray] = {}
        self.counts: dict[int, int] = {}

    def append(self, output: np.ndarray) -> None:
        start, end = self.length, self.length + output.shape[0]
        self.tokens = _grown(self.tokens, end + 1, _SEPARATOR)
        self.tokens[start:end] = output
        self.tokens[end] = _SEPARATOR
        self.length = end + 1
        self.output_starts.append(start)
        # Group the new positions by token: a stable sort keeps each group ascending.
        order = np.argsort(output, kind="stable")  # [m]
        sorted_tokens = output[order]
        bounds = np.flatnonzero(np.diff(sorted_tokens)) + 1
        for group in np.split(order + start, bounds):
            token = int(self.tokens[group[0]])
            count = self.counts.get(token, 0)
            buffer = _grown(self.positions.get(token, np.empty(0, np.int64)), count + group.size, 0)
            buffer[count : count + group.size] = group
            self.positions[token], self.counts[token] = buffer, count + group.size

    def pop_oldest(self) -> None:
        self.output_starts.popleft()
        self.first_live = self.output_starts[0] if self.output_starts else self.length
        if self.first_live - 1 > self.length // 2:
            self._compact()

    def _compact(self) -> None:
        """Drops the forgotten front: every position moves down by `shift`."""
        shift = self.first_live - 1  # keep the live outputs' leading separator
        positions, counts = {}, {}
        for token in self.positions:
            kept = self.occurrences(token) - shift
            if kept.size:
                positions[token], counts[token] = kept, kept.size
        self.positions, self.counts = positions, counts
        self.tokens = self.tokens[shift:].copy()
        self.length -= shift
        self.first_live -= shift
        self.output_starts = deque(start - shift for start in self.output_starts)

    def occurrences(self, token: int) -> np.ndarray:
        """Live positions of `token`, ascending."""
        count = self.counts.get(token, 0)
        if count == 0:
            return np.empty(0, dtype=np.int64)
        found = self.positions[token][:count]
        return found[np.searchsorted(found, self.first_live) :]


def _match_lengths(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """For each end position e, how many of `tokens[e], tokens[e - 1], ...` equal
    `pattern[0], pattern[1], ...` (at most `pattern.size`; before position 0 nothing does)."""
    index = ends[:, None] - np.arange(pattern.size)  # [C, W]
    window = np.where(index >= 0, tokens[np.maximum(index, 0)], _SEPARATOR)  # [C, W]
    equal = window == pattern  # [C, W]
    return np.where(equal.all(axis=1), pattern.size, equal.argmin(axis=1))  # [C]


class SuffixProposer:
    """Drafts from the request's own tokens and the completed outputs of its `cache_key`."""

    method = "suffix"

    def __init__(self, config: SpeculativeConfig, tokenizer=None) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_requests = config.suffix_cache_max_requests
        self._tokens = TokenArrays()
        self._text = TextLookup(tokenizer) if tokenizer is not None else None
        self._outputs: dict[Hashable, _KeyOutputs] = {}
        self._history: deque[Hashable] = deque()  # the key of every cached output, oldest first

    @property
    def num_cached_outputs(self) -> int:
        return len(self._history)

    def propose(self, contexts: list[DraftContext], max_tokens: list[int]) -> list[list[int]]:
        return [self._propose_one(c, n) for c, n in zip(contexts, max_tokens, strict=True)]

    def _propose_one(self, context: DraftContext, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        if self._text is None:
            return self._walk(context, max_tokens)[2]
        return self._text.propose_with(context, max_tokens, lambda: self._walk(context, max_tokens))

    def _walk(self, context: DraftContext, max_tokens: int) -> tuple[int, bool, list[int]]:
        """Steps 1 and 2 above: the match length in tokens, whether the match is in the
        prompt only (the output copies it: a structured output's value then ends where the
        text lookup sees it end), and the draft (0, False, [] without a match of at least
        `prompt_lookup_min`)."""
        length = context.num_tokens
        if length == 0 or length < self.min_n:
            return 0, False, []
        own = self._tokens.get(context)
        last = own[length - 1]
        # 1. Occurrences of the last token, by end position: in the request (strictly before
        # its end) and in the cached outputs (followed by a token, not the separator).
        own_ends = np.flatnonzero(own[: length - 1] == last)
        cached = self._outputs.get(context.cache_key) if context.cache_key is not None else None
        if cached is not None:
            tokens = cached.tokens
            cached_ends = cached.occurrences(int(last))
            cached_ends = cached_ends[tokens[cached_ends + 1] != _SEPARATOR]
        else:
            tokens = np.full(1, _SEPARATOR, dtype=np.int64)
            cached_ends = np.empty(0, dtype=np.int64)
        if own_ends.size == 0 and cached_ends.size == 0:
            return 0, False, []
        # Keep the occurrences of the longest match.
        pattern = own[length - min(MAX_MATCH_TOKENS, length) :][::-1]  # the request, backwards
        own_lengths = _match_lengths(own, own_ends, pattern)
        cached_lengths = _match_lengths(tokens, cached_ends, pattern)
        n = max(own_lengths.max(initial=0), cached_lengths.max(initial=0))
        if n < self.min_n:
            return 0, False, []
        own_ends, cached_ends = own_ends[own_lengths == n], cached_ends[cached_lengths == n]
        copied = cached_ends.size == 0 and bool(own_ends[-1] < context.num_prompt_tokens)

        # 2. Extend by the most frequent continuation while any occurrence goes on. Every
        # cached position read is in range: a token is always followed by one more entry.
        own_next, cached_next = own_ends + 1, cached_ends + 1
        draft: list[int] = []
        while len(draft) < max_tokens:
            own_next = own_next[own_next < length]
            candidates = np.concatenate([own[own_next], tokens[cached_next]])
            candidates = candidates[candidates != _SEPARATOR]
            if candidates.size == 0:
                break
            values, counts = np.unique(candidates, return_counts=True)
            token = values[np.argmax(counts)]
            draft.append(int(token))
            own_next = own_next[own[own_next] == token] + 1
            cached_next = cached_next[tokens[cached_next] == token] + 1
        return int(n), copied, draft

    def request_finished(self, context: DraftContext, completed: bool) -> None:
        """Forgets the request's own tokens; keeps its output for its key when it completed."""
        self._tokens.drop(context.req_id)
        if self._text is not None:
            self._text.drop(context.req_id)
        if not completed or context.cache_key is None:
            return
        output = np.asarray(context.token_ids[context.num_prompt_tokens :], dtype=np.int64)
        if output.size == 0:
            return
        self._outputs.setdefault(context.cache_key, _KeyOutputs()).append(output)
        self._history.append(context.cache_key)
        while len(self._history) > self.max_requests:
            key = self._history.popleft()
            outputs = self._outputs[key]
            outputs.pop_oldest()  # a key's outputs are in history order too
            if not outputs.output_starts:
                del self._outputs[key]
