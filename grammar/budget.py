"""Finishing within a token budget: when few tokens are left, steer the output to a valid end.

A model that repeats itself inside a long value is cut at max_tokens, and the cut output is
not valid. Given the number of tokens left, `BudgetSteer.steer_row` looks for a short
completion from the matcher's state (`completion`: greedily, closing quotes and brackets
first, then the shortest allowed token, ending with a stop token) and narrows the mask row:

  - when the completion needs nearly every token left, only its first token is allowed
    (the next step finds the same completion, one token shorter, so the output ends
    within the budget);
  - somewhat earlier (at most OPEN_SLACK tokens before that), tokens that open something
    new (`{`, `[`, `,`) are refused while any other token is allowed, so that one sampled
    token cannot make the completion longer than the tokens left.

Lengths are counted in the tokenizer's own tokens (the completion is a path through its
vocabulary), and nothing is narrowed while the tokens left can close the output with room
to spare: a short reply far from max_tokens is never steered (its rows are the grammar's),
so `num_steered` is nonzero only where the budget really bound.

Nothing is narrowed while the output may end where it is (free text, a finished value):
being cut there leaves it valid. The grammar and the EOS gate still apply to every token:
the output is valid, only shorter than the model would have made it. The matcher counts
the rows it narrowed (`num_steered`).

Dependencies run one way: `GrammarMatcher` owns a `BudgetSteer` and calls it with its
`GrammarState`; the search walks that state (accept, fill, roll back), which has no way
back to the steering, so its rollbacks cannot reset the steering mid-search.
"""

from __future__ import annotations

import numpy as np

from .backend import TokenizerData
from .bitmask import allocate_bitmask, pack_bits
from .state import GrammarState

# Completions are searched only this close to the budget's end (the search costs one mask
# per token of the completion).
STEER_WINDOW = 256
# Force the completion once the tokens left are at most its length plus this.
FORCE_SLACK = 4
# Refuse opening tokens once the tokens left are at most its length plus FORCE_SLACK plus
# this: room for what one opener adds (a `,` and a short member, a `[` and its `]`) before
# the completion is forced. (Was twice its length plus 16: a 13-token reply with 40 tokens
# left had its openers refused, and counted as steered, while it wrote a name.)
OPEN_SLACK = 16
# Searches are at least this many tokens apart until openers are refused.
RECHECK_STEPS = 8
# Tokens of the completion read to find the openers that follow it (`",` then ` "key`).
PATH_PEEK = 3
_CLOSERS = frozenset(b'"]}')
_OPENERS = frozenset(b"{[,")


def finish_tables(
    token_bytes: tuple[bytes, ...], stop_ids: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, dict[bytes, int]]:
    """(rank, opener_words, closing_openers) for a vocabulary.

    rank: int32 token ids in the order a completion prefers them: tokens made only of
    quotes and closing brackets, first those that start with a quote (inside a string only
    they close it: `]]` there is content), shortest first (at a value's start `"` opens an
    empty string, not one holding `]]`); then the other such tokens, longest first (they
    close several levels at once); then every other non-empty token, shortest first. Stop
    tokens are excluded (a completion ends with one when it can).
    opener_words: uint32 [ceil(V/32)], bit set for tokens holding `{`, `[` or `,`.
    closing_openers: bytes -> id of the opener tokens that start by closing (`",`, `"},`):
    the ones a model writes to end a value and go on to the next member.
    """
    stops = set(stop_ids)
    closers, others = [], []
    closing_openers: dict[bytes, int] = {}
    openers = np.zeros(len(token_bytes), dtype=bool)
    for i, data in enumerate(token_bytes):
        if not data or i in stops:
            continue
        if set(data) <= _CLOSERS:
            quote = data[:1] == b'"'
            closers.append((not quote, len(data) if quote else -len(data), i))
        else:
            others.append((len(data), i))
        openers[i] = not _OPENERS.isdisjoint(data)
        if openers[i] and data[0] in _CLOSERS:
            closing_openers.setdefault(data, i)
    order = [key[-1] for key in sorted(closers)] + [i for _, i in sorted(others)]
    return np.array(order, dtype=np.int32), pack_bits(openers), closing_openers


def completion(state: GrammarState, limit: int, scratch: np.ndarray) -> list[int] | None:
    """A short way to finish from `state`: token ids ending with a stop token, or None when
    the greedy search finds none within `limit` tokens. `state` is walked and rolled back to
    where it was; `scratch` is a one-row bitmask to work in."""
    path, finished = _greedy_path(state, limit, scratch)
    return path if finished else None


def _greedy_path(state: GrammarState, limit: int, scratch: np.ndarray) -> tuple[list[int], bool]:
    """The greedy completion's first tokens (at most `limit`), and whether they end it (the
    last one is then a stop token). `state` is left where it was."""
    tok = state.tok
    path: list[int] = []
    previous: list[int] = []  # the candidates of the step before
    last_use: dict[int, int] = {}  # since the candidates last changed
    try:
        while len(path) < limit:
            if state.can_terminate():
                return [*path, tok.stop_token_ids[0]], True
            state.fill_row(scratch, 0)
            candidates = _allowed_in_rank(tok.finish_rank, scratch[0].view(np.uint32))
            if not candidates:
                return path, False
            pick = candidates[0]
            if candidates != previous:
                last_use.clear()
            elif not set(tok.token_bytes[pick]) <= _CLOSERS:
                # The same choices again and nothing to close (a `[a-z0-9.]+` run, say):
                # the least recently used one, so the run reaches the `@` that ends it.
                pick = min(candidates, key=lambda t: last_use.get(t, -1))
            if not state.accept_token(pick):
                return path, False
            last_use[pick] = len(path)
            previous = candidates
            path.append(pick)
        return path, False
    finally:
        state.rollback(len(path))


def _allowed_in_rank(rank: np.ndarray, words: np.ndarray) -> list[int]:
    """Allowed ids in `rank` order: those among the first ~1,000 ranked (the closers and the
    shortest tokens), or else the first allowed one further down; the whole vocabulary is
    rarely read."""
    for start, stop in ((0, 1088), (1088, rank.size)):
        ids = rank[start:stop]
        found = ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]
        if found.size:
            return found[: 64 if start == 0 else 1].tolist()
    return []


class BudgetSteer:
    """One matcher's steering state: a scratch bitmask row, the last completion found (a
    greedy completion is a function of the state, so after its first token is accepted the
    rest is still the completion), whether opening tokens are being refused, when to search
    next, and how many rows were narrowed.

    Searches are spaced out: far from the end, after half the distance to where openers
    are refused (at least RECHECK_STEPS tokens); while refusing openers (the completion then
    grows by a token or two per step at most), after a third of the distance to where the
    completion must be forced; once forcing, every step, which costs nothing since the
    model follows the completion.
    """

    def __init__(self, tok: TokenizerData) -> None:
        self.scratch = allocate_bitmask(1, tok.vocab_size)
        self.num_steered = 0
        self._openers = tok.opener_words
        self._cached: tuple[int, list[int] | None] | None = None  # (num_tokens, completion)
        self._search_at = STEER_WINDOW  # search when at most this many tokens are left
        self._refusing = False  # opening tokens are refused until the next search

    def forget(self) -> None:
        """The state moved other than by accepting one token (the matcher's rollback)."""
        self._cached = None
        self._search_at = STEER_WINDOW
        self._refusing = False

    def num_untouched_rows(self, tokens_left: int) -> int:
        """How many rows from now, filled with `tokens_left`, `tokens_left - 1`, ..., this
        steering would leave alone without changing its own state (no search, no refusal)."""
        return 0 if self._refusing else max(0, tokens_left - self._search_at)

    def completion(self, state: GrammarState, limit: int) -> list[int] | None:
        n = state.num_tokens
        if self._cached is not None:
            at, path = self._cached
            if at == n and (path is None or len(path) <= limit):
                return path
            if at == n - 1 and path and state.last_token_id == path[0]:
                self._cached = (n, path[1:])
                return path[1:]
        path = completion(state, limit, self.scratch)
        self._cached = (n, path)
        return path

    def steer_row(
        self, state: GrammarState, bitmask: np.ndarray, row: int, tokens_left: int
    ) -> None:
        """Narrow `bitmask[row]` (already filled from `state`) so the output can end within
        `tokens_left` tokens, the stop token included. Changes this steering's state (the
        cached completion, the next search, openers refused, num_steered), never `state`'s."""
        if tokens_left > self._search_at:  # never above STEER_WINDOW
            if self._refusing:
                self._refuse_openers(state, bitmask, row)
            return
        path = self.completion(state, tokens_left)
        self._refusing = False
        self._search_at = tokens_left - RECHECK_STEPS
        if path is None or len(path) == 1:
            # Nothing fits (or a dead end): leave the model's choice alone. Or the output
            # may end here: nothing to close (and free text stays free).
            return
        if len(path) + FORCE_SLACK >= tokens_left:
            words = bitmask[row].view(np.uint32)
            words[:] = 0
            words[path[0] >> 5] = np.uint32(1 << (path[0] & 31))
            self.num_steered += 1
            self._search_at = tokens_left - 1
        elif len(path) + FORCE_SLACK + OPEN_SLACK >= tokens_left:
            self._refusing = True
            self._search_at = tokens_left - max(1, (tokens_left - len(path) - FORCE_SLACK) // 3)
            self._refuse_openers(state, bitmask, row)
        else:  # halve the distance to where openers are refused, at least RECHECK_STEPS
            zone = len(path) + FORCE_SLACK + OPEN_SLACK
            self._search_at = max(zone, tokens_left - max(RECHECK_STEPS, (tokens_left - zone) // 2))

    def _refuse_openers(self, state: GrammarState, bitmask: np.ndarray, row: int) -> None:
        """Refuse the tokens that open something new, except those that only follow the
        completion: `",` when the completion closes the string and goes on to a required
        member (a model ends a value with that token far more often than with `"` alone;
        refused, it keeps writing the value up to its length cap)."""
        openers = self._openers
        words = bitmask[row].view(np.uint32)
        narrowed = words[: openers.size] & ~openers
        if not narrowed.any() or np.array_equal(narrowed, words[: openers.size]):
            return
        for token_id in self._openers_on_path(state):
            word, bit = token_id >> 5, np.uint32(1 << (token_id & 31))
            narrowed[word] |= words[word] & bit
        words[: openers.size] = narrowed
        self.num_steered += 1

    def _openers_on_path(self, state: GrammarState) -> list[int]:
        """The closing opener tokens (`",`, `"},`) whose bytes begin the greedy completion."""
        tok = state.tok
        cached = self._cached
        if cached is not None and cached[0] == state.num_tokens and cached[1]:
            path = cached[1][:PATH_PEEK]  # just searched (or followed): no second search
        else:
            path, _ = _greedy_path(state, PATH_PEEK, self.scratch)
        text = b"".join(tok.token_bytes[t] for t in path if t not in tok.stop_token_ids)
        found = (tok.closing_openers.get(text[:n]) for n in range(2, len(text) + 1))
        return [t for t in found if t is not None]
