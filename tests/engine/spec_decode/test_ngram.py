"""N-gram prompt lookup: exact drafts on hand-made contexts, and agreement with a brute-force
reference on random ones."""

from __future__ import annotations

import random

import pytest

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.ngram import NgramProposer


def proposer(min_n: int = 1, max_n: int = 4) -> NgramProposer:
    return NgramProposer(
        SpeculativeConfig(method="ngram", prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    )


def context(token_ids: list[int], req_id: str = "r") -> DraftContext:
    return DraftContext(req_id, token_ids, num_prompt_tokens=1, cache_key=None)


def propose(tokens: list[int], max_tokens: int = 4, min_n: int = 1, max_n: int = 4) -> list[int]:
    return proposer(min_n, max_n).propose([context(tokens)], [max_tokens])[0]


def reference(tokens: list[int], max_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The rule, spelled out: longest n first, most recent strictly earlier occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n :] if n <= length else None
        for start in range(length - n - 1, -1, -1):
            if suffix is not None and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + max_tokens]
    return []


def test_proposes_what_followed_the_suffix():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], max_tokens=3) == [4, 5, 1]


def test_prefers_the_longest_match_over_a_more_recent_shorter_one():
    tokens = [1, 2, 3, 10, 9, 3, 20, 1, 2, 3]
    assert propose(tokens, max_tokens=3, max_n=3) == [10, 9, 3]  # [1, 2, 3] at 0
    assert propose(tokens, max_tokens=3, max_n=1) == [20, 1, 2]  # [3] at 5, the latest


def test_takes_the_most_recent_of_equal_matches():
    assert propose([1, 5, 1, 6, 1], max_tokens=4) == [6, 1]


def test_min_window_refuses_shorter_matches():
    assert propose([5, 3, 9, 3], min_n=1) == [9, 3]
    assert propose([5, 3, 9, 3], min_n=2) == []


def test_no_proposal_without_a_match():
    assert propose([1, 2, 3, 4]) == []
    assert propose([7]) == []
    assert propose([]) == []


def test_never_past_the_end_and_never_the_suffix_itself():
    # [4, 4, 4] also occurs at 1 (the suffix itself), which does not count; the one at 0 is
    # followed only by the last token.
    assert propose([4, 4, 4, 4], max_tokens=8) == [4]
    assert propose([1, 2, 1], max_tokens=8) == [2, 1]


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 5])
def test_max_tokens_is_respected(max_tokens):
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert propose(tokens, max_tokens=max_tokens) == [3, 4, 5, 6, 7][:max_tokens]


def test_batch_of_requests():
    p = proposer()
    contexts = [context([1, 2, 1], "a"), context([3, 4], "b"), context([5, 6, 5, 6], "c")]
    assert p.propose(contexts, [2, 2, 1]) == [[2, 1], [], [5]]


def test_matches_the_reference_while_the_request_grows():
    # One proposer follows each request step by step (its numpy copy grown incrementally),
    # through a finished request whose req_id comes back with other tokens.
    rng = random.Random(0)
    p = proposer(min_n=2, max_n=4)
    for trial in range(60):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        ctx = context(tokens, "r")
        for _ in range(25):
            max_tokens = rng.randrange(0, 6)
            assert p.propose([ctx], [max_tokens])[0] == reference(tokens, max_tokens, 2, 4)
            tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
        if trial % 2:
            p.request_finished(ctx, completed=True)


def test_the_numpy_copy_grows_in_place_and_is_rebuilt_when_the_tokens_change():
    p = proposer()
    tokens = [1, 2, 3, 1, 2]
    ctx = context(tokens, "r")
    assert p.propose([ctx], [3]) == [[3, 1, 2]]
    buffer = p._tokens._arrays["r"][1]
    tokens += [3, 1]
    assert p.propose([ctx], [3]) == [[2, 3, 1]]
    assert p._tokens._arrays["r"][1] is buffer  # appended to, not converted again
    tokens[-1] = 2  # the last known token changed
    assert p.propose([ctx], [3]) == [[3, 2]]
    del tokens[3:]  # shorter: [1, 2, 3]
    assert p.propose([ctx], [3]) == [[]]
    # Another list under the same req_id, as long as the last one and with the same last token.
    assert p.propose([context([3, 1, 3], "r")], [3]) == [[1, 3]]


def test_request_finished_forgets_the_request():
    p = proposer()
    ctx = context([1, 2, 1], "a")
    p.propose([ctx], [2])
    p.request_finished(ctx, completed=False)
    assert p._tokens._arrays == {}
