"""Suffix cache: exact drafts on hand-made requests, learning across requests (completed
ones only, within a key), the eviction bound, and a brute-force reference."""

from __future__ import annotations

import random
from collections.abc import Hashable

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.spec_decode.suffix import MAX_MATCH_TOKENS, SuffixProposer

PROMPT = [100, 101]  # a prompt head no output repeats


def proposer(min_n: int = 1, max_requests: int = 1024) -> SuffixProposer:
    config = SpeculativeConfig(
        method="suffix", prompt_lookup_min=min_n, suffix_cache_max_requests=max_requests
    )
    return SuffixProposer(config)


def context(output: list[int], key: Hashable | None = "k", req_id: str = "r") -> DraftContext:
    return DraftContext(req_id, PROMPT + output, num_prompt_tokens=len(PROMPT), cache_key=key)


def learn(p: SuffixProposer, *outputs: list[int], key: Hashable | None = "k") -> None:
    for i, output in enumerate(outputs):
        p.request_finished(context(output, key, f"done-{i}"), completed=True)


def propose(p: SuffixProposer, output: list[int], max_tokens: int = 8, key="k") -> list[int]:
    return p.propose([context(output, key)], [max_tokens])[0]


def test_own_tokens_alone_work_like_prompt_lookup():
    p = proposer()
    assert propose(p, [1, 2, 3, 9, 1, 2], key=None) == [3, 9, 1, 2]  # stops at the end
    assert propose(p, [1, 2, 3, 4], key=None) == []


def test_learns_a_completed_output_for_its_key():
    p = proposer()
    learn(p, [10, 11, 12, 13])
    assert propose(p, [7, 10, 11]) == [12, 13]  # stops where the cached output ended
    assert propose(p, [7, 10, 11], max_tokens=1) == [12]
    assert propose(p, [7, 10, 11], key="other") == []
    assert propose(p, [7, 10, 11], key=None) == []


def test_learns_only_from_completed_requests_with_a_key():
    p = proposer()
    p.request_finished(context([10, 11, 12], req_id="aborted"), completed=False)
    p.request_finished(context([10, 11, 12], key=None, req_id="keyless"), completed=True)
    assert p.num_cached_outputs == 0
    assert propose(p, [10, 11]) == []
    # The prompt is not learnt, only what follows it.
    learn(p, [10, 11])
    assert p.num_cached_outputs == 1
    other_prompt = DraftContext("q", [7, 100], num_prompt_tokens=2, cache_key="k")
    assert p.propose([other_prompt], [4]) == [[]]


def test_prefers_the_most_frequent_continuation():
    p = proposer()
    learn(p, [5, 6, 7], [5, 6, 8], [5, 6, 7])
    assert propose(p, [1, 5, 6]) == [7]


def test_prefers_the_longest_match_over_frequency():
    p = proposer()
    learn(p, [1, 5, 6, 2], [9, 5, 6, 3], [4, 5, 6, 3])
    assert propose(p, [1, 5, 6]) == [2]  # [1, 5, 6] matches once
    assert propose(p, [7, 5, 6]) == [3]  # only [5, 6] matches: 3 twice, 2 once


def test_greedy_extension_follows_the_occurrences_that_agree():
    p = proposer()
    learn(p, [1, 2, 3, 7, 8], [1, 2, 3, 4, 5], [1, 2, 3, 7, 9, 9])
    # After 3: 7 (twice) over 4; after 3 7: 8 and 9 tie, the lower id wins; then one
    # occurrence is left and its output ends.
    assert propose(p, [0, 1, 2]) == [3, 7, 8]
    assert propose(p, [0, 1, 2], max_tokens=2) == [3, 7]


def test_own_tokens_and_cached_outputs_count_together():
    p = proposer()
    learn(p, [4, 6])
    # 4 -> 5 twice in the request itself, 4 -> 6 once in the cache.
    assert propose(p, [4, 5, 4, 5, 4], max_tokens=1) == [5]


def test_min_match_length():
    p = proposer(min_n=2)
    learn(p, [3, 20, 21])
    assert propose(p, [9, 3]) == []  # a 1-token match
    assert propose(p, [3, 20]) == [21]


def test_eviction_keeps_the_newest_outputs_over_all_keys():
    p = proposer(max_requests=2)
    learn(p, [10, 11, 12], key="a")
    learn(p, [20, 21, 22], key="b")
    learn(p, [30, 31, 32], key="a")
    assert p.num_cached_outputs == 2
    assert propose(p, [10, 11], key="a") == []  # the oldest, forgotten
    assert propose(p, [20, 21], key="b") == [22]
    assert propose(p, [30, 31], key="a") == [32]
    learn(p, [40, 41], key="c")
    learn(p, [50, 51], key="c")
    assert propose(p, [20, 21], key="b") == [] and propose(p, [30, 31], key="a") == []
    assert p._outputs.keys() == {"c"}  # emptied keys are dropped


def test_request_finished_forgets_the_request_tokens():
    p = proposer()
    ctx = context([1, 2, 1])
    p.propose([ctx], [2])
    p.request_finished(ctx, completed=False)
    assert p._tokens._arrays == {}


def reference(own: list[int], cached: list[list[int]], max_tokens: int, min_n: int) -> list[int]:
    """The rule, spelled out on lists: occurrences are (document, index of the next token)."""
    length = len(own)
    docs = [*cached, own]
    for n in range(min(MAX_MATCH_TOKENS, length), min_n - 1, -1):
        suffix = own[length - n :]
        occurrences = [
            (d, start + n)
            for d, doc in enumerate(docs)
            for start in range(len(doc) - n)
            if doc[start : start + n] == suffix and (d < len(cached) or start + n < length)
        ]
        if occurrences:
            break
    else:
        return []
    draft: list[int] = []
    while len(draft) < max_tokens:
        following = [docs[d][i] for d, i in occurrences if i < len(docs[d])]
        if not following:
            break
        token = min(set(following), key=lambda t: (-following.count(t), t))
        draft.append(token)
        occurrences = [
            (d, i + 1) for d, i in occurrences if i < len(docs[d]) and docs[d][i] == token
        ]
    return draft


def test_matches_the_reference_on_random_requests():
    # Up to 10 outputs through a cache of 3: forgetting, and cutting off the forgotten front
    # of the key's array, happen along the way.
    rng = random.Random(0)
    for trial in range(150):
        min_n = rng.choice([1, 2])
        p = proposer(min_n=min_n, max_requests=3)
        cached = [[rng.randrange(5) for _ in range(rng.randrange(1, 15))] for _ in range(10)]
        for learnt in range(1, rng.randrange(2, 11)):
            learn(p, cached[learnt - 1])
        output = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        own = PROMPT + output
        max_tokens = rng.randrange(1, 7)
        expected = reference(own, cached[max(0, learnt - 3) : learnt], max_tokens, min_n)
        assert propose(p, output, max_tokens) == expected, (trial, own, cached[:learnt])
