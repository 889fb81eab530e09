"""Finishing within a token budget: when few tokens are left, steer the output to a valid end.

A model that repeats itself inside a long value is cut at max_tokens, and the cut output is
not valid. Given the number of tokens left, `BudgetSteer.steer_row` looks for a short
completion from the matcher's state (`completion`: greedily, closing quotes and brackets
first, then the shortest allowed token, ending with a stop token) and narrows the mask row:

  - when the completion needs nearly every token left, only its first token is allowed
    (the next step finds the same completion, one token shorter, so the output ends
    within the budget);
  - somewhat earlier, tokens that open something new (`{`, `[`, `,`) are refused while any
    other token is allowed, so that one sampled token cannot make the completion much
    longer than the tokens left.

Nothing is narrowed while the output may end where it is (free text, a finished value):
being cut there leaves it valid. The grammar and the EOS gate still apply to every token:
the output is valid, only shorter than the model would have made it. The matcher counts
the rows it narrowed (`num_steered`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .matcher import GrammarMatcher

# Completions are searched only this close to the budget's end (the search costs one mask
# per token of the completion).
STEER_WINDOW = 256
# Force the completion once the tokens left are at most its length plus this.
FORCE_SLACK = 4
# Refuse opening tokens once the tokens left are at most twice its length plus this.
OPEN_SLACK = 16
# Far from both, search again only after this many tokens (or once that close).
RECHECK_STEPS = 8
_CLOSERS = frozenset(b'"]}')
_OPENERS = frozenset(b"{[,")


def finish_tables(
    token_bytes: tuple[bytes, ...], stop_ids: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(rank, opener_words) for a vocabulary.

    rank: int32 token ids in the order a completion prefers them: tokens made only of
    quotes and closing brackets, first those that start with a quote (inside a string only
    they close it: `]]` there is content), shortest first (at a value's start `"` opens an
    empty string, not one holding `]]`); then the other such tokens, longest first (they
    close several levels at once); then every other non-empty token, shortest first. Stop
    tokens are excluded (a completion ends with one when it can).
    opener_words: uint32 [ceil(V/32)], bit set for tokens holding `{`, `[` or `,`.
    """
    stops = set(stop_ids)
    closers, others = [], []
    openers = np.zeros(((len(token_bytes) + 31) // 32) * 32, dtype=bool)
    for i, data in enumerate(token_bytes):
        if not data or i in stops:
            continue
        if set(data) <= _CLOSERS:
            quote = data[:1] == b'"'
            closers.append((not quote, len(data) if quote else -len(data), i))
        else:
            others.append((len(data), i))
        openers[i] = not _OPENERS.isdisjoint(data)
    order = [key[-1] for key in sorted(closers)] + [i for _, i in sorted(others)]
    rank = np.array(order, dtype=np.int32)
    words = np.packbits(openers.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32)
    return rank, words.reshape(-1)


def completion(matcher: GrammarMatcher, limit: int, scratch: np.ndarray) -> list[int] | None:
    """A short way to finish from the matcher's state: token ids ending with a stop token,
    or None when the greedy search finds none within `limit` tokens. State is unchanged;
    `scratch` is a one-row bitmask to work in."""
    tok = matcher.grammar.tok
    path: list[int] = []
    try:
        while len(path) < limit:
            if matcher.can_terminate():
                return [*path, tok.stop_token_ids[0]]
            matcher.fill_bitmask(scratch, 0)
            candidates = _first_allowed(tok.finish_rank, scratch[0].view(np.uint32))
            if not candidates.size:
                return None
            pick = int(candidates[0])
            if not set(tok.token_bytes[pick]) <= _CLOSERS:
                # Not closing anything yet (e.g. inside a pattern): avoid going round in
                # circles on one token, so `[a-z.-]+/` reaches its `/`.
                pick = next((int(c) for c in candidates[:8] if int(c) not in path[-2:]), pick)
            if not matcher.accept_token(pick):
                return None
            path.append(pick)
        return None
    finally:
        matcher.rollback(len(path))


def _first_allowed(rank: np.ndarray, words: np.ndarray, want: int = 8) -> np.ndarray:
    """Up to `want` allowed ids, in `rank` order. Reads the rank in growing slices: the
    closers and the shortest tokens come first, so the whole vocabulary is rarely read."""
    start, size = 0, 64
    while start < rank.size:
        ids = rank[start : start + size]
        allowed = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
        found = ids[allowed.astype(bool)]
        if found.size:
            return found[:want]
        start, size = start + size, size * 16
    return rank[:0]


class BudgetSteer:
    """One matcher's steering state: a scratch bitmask row, the last completion found (a
    greedy completion is a function of the state, so after its first token is accepted the
    rest is still the completion) and how many rows were narrowed."""

    def __init__(self, words: int) -> None:
        self.scratch = np.zeros((1, words), dtype=np.int32)
        self.num_steered = 0
        self._cached: tuple[int, list[int] | None] | None = None  # (num_tokens, completion)
        self._quiet_above = STEER_WINDOW  # no search while more tokens than this are left

    def forget(self) -> None:
        """The state moved other than by accepting one token (rollback, reset)."""
        self._cached = None
        self._quiet_above = STEER_WINDOW

    def completion(self, matcher: GrammarMatcher, limit: int) -> list[int] | None:
        n = matcher.num_tokens
        if self._cached is not None:
            at, path = self._cached
            if at == n and (path is None or len(path) <= limit):
                return path
            if at == n - 1 and path and matcher.last_token_id == path[0]:
                self._cached = (n, path[1:])
                return path[1:]
        path = completion(matcher, limit, self.scratch)
        self._cached = (n, path)
        return path

    def steer_row(
        self, matcher: GrammarMatcher, bitmask: np.ndarray, row: int, tokens_left: int
    ) -> None:
        """Narrow `bitmask[row]` (already filled) so the output can end within
        `tokens_left` tokens, the stop token included."""
        if tokens_left > min(STEER_WINDOW, self._quiet_above):
            return
        path = self.completion(matcher, tokens_left)
        # Until the next search: RECHECK_STEPS tokens, or less if that would come close to
        # the zone where opening tokens are refused.
        near = 2 * len(path) + OPEN_SLACK + RECHECK_STEPS if path else 0
        self._quiet_above = max(near, tokens_left - RECHECK_STEPS)
        if path is None:
            return  # nothing fits (or a dead end): leave the model's choice alone
        if len(path) == 1:
            return  # the output may end here: nothing to close (free text stays free)
        words = bitmask[row].view(np.uint32)
        if len(path) + FORCE_SLACK >= tokens_left:
            words[:] = 0
            words[path[0] >> 5] = np.uint32(1 << (path[0] & 31))
            self.num_steered += 1
        elif 2 * len(path) + OPEN_SLACK >= tokens_left:
            openers = matcher.grammar.tok.opener_words
            narrowed = words[: openers.size] & ~openers
            if narrowed.any():
                words[: openers.size] = narrowed
                self.num_steered += 1
