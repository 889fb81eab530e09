"""SpecDecodeManager's drafting budget: how many tokens each request may draft, adaptive or
not, alone or in a batch, and the caps no draft may cross."""

from __future__ import annotations

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.spec_decode.manager import (
    ACCEPTANCE_WEIGHT,
    BATCH_MAX_DRAFTS,
    PAUSE_STEPS,
    SpecDecodeManager,
)
from agentrt.engine.spec_decode.ngram import NgramProposer

# A prompt that repeats itself: prompt lookup always drafts from it (up to 10 tokens).
PROMPT = list(range(1, 11)) * 3 + [1]


def make_request(req_id: str, max_tokens: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(req_id, PROMPT, params, max_tokens=max_tokens, eos_token_ids=frozenset({0}))
    request.status = RequestStatus.RUNNING
    return request


def make_manager(costly_rows: bool = False, **options) -> SpecDecodeManager:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=8, **options)
    kv = KVCacheManager(64, 16)
    return SpecDecodeManager(
        config, NgramProposer(config), kv, max_model_len=1024, costly_rows=costly_rows
    )


def drafts(manager: SpecDecodeManager, requests: list[Request], num_running: int) -> list[int]:
    for request in requests:
        request.spec_token_ids = []  # the scheduler took the last step's drafts
    manager.propose(requests, num_running)
    return [len(r.spec_token_ids) for r in requests]


def reject_all(manager: SpecDecodeManager, request: Request, times: int = 1) -> None:
    for _ in range(times):
        manager.verified(request, 8, 0)


def acceptance(*rates: float) -> float:
    """The documented rule: a moving average from 1.0 with ACCEPTANCE_WEIGHT on the newest
    step's accepted / drafted."""
    value = 1.0
    for rate in rates:
        value = (1 - ACCEPTANCE_WEIGHT) * value + ACCEPTANCE_WEIGHT * rate
    return value


def test_in_a_batch_low_acceptance_shortens_drafts_and_a_cap_applies():
    """A row costs compute in a batch; a request alone keeps its length (a step's cost
    hardly depends on its rows there) until its acceptance is low enough to pause it."""
    manager = make_manager()
    alone, batched = make_request("alone"), make_request("batched")
    assert drafts(manager, [alone], 1) == [8]
    assert drafts(manager, [batched], 2) == [BATCH_MAX_DRAFTS]
    history = [0.0]
    counts = []
    for _ in range(3):  # each rejection shortens the batched drafts, never the lone ones
        reject_all(manager, alone)
        reject_all(manager, batched)
        assert drafts(manager, [alone], 1) == [8]
        (num,) = drafts(manager, [batched], 2)
        assert num == max(1, round(BATCH_MAX_DRAFTS * acceptance(*history)))
        counts.append(num)
        history.append(0.0)
    assert counts == sorted(counts, reverse=True) and counts[-1] < BATCH_MAX_DRAFTS, counts
    history.pop()
    manager.verified(batched, 2, 2)  # acceptance recovers
    (recovered,) = drafts(manager, [batched], 2)
    assert recovered == max(1, round(BATCH_MAX_DRAFTS * acceptance(*history, 1.0)))
    assert recovered > counts[-1]


def test_where_rows_are_costly_low_acceptance_shortens_drafts_alone_too():
    manager = make_manager(costly_rows=True)
    alone = make_request("alone")
    assert drafts(manager, [alone], 1) == [8]
    reject_all(manager, alone, 2)
    (num,) = drafts(manager, [alone], 1)
    assert num == round(8 * acceptance(0.0, 0.0)) and num < 8


def test_acceptance_below_the_minimum_pauses_drafting_then_retries():
    minimum = 0.1
    manager = make_manager(adaptive_min_acceptance=minimum)
    request, batched = make_request("r"), make_request("batched")
    # The fewest rejections that take the average below the minimum.
    times = next(n for n in range(1, 100) if acceptance(*[0.0] * n) < minimum)
    reject_all(manager, request, times - 1)
    reject_all(manager, batched, times - 1)
    assert drafts(manager, [request], 1) == [8]  # one step short: still drafting
    assert drafts(manager, [batched], 2)[0] > 0
    reject_all(manager, request)
    reject_all(manager, batched)
    for _ in range(PAUSE_STEPS):
        assert drafts(manager, [request], 1) == [0]
        assert drafts(manager, [batched], 2) == [0]
    assert drafts(manager, [request], 1) == [8]  # retried
    # Retried at twice the minimum acceptance.
    assert drafts(manager, [batched], 2) == [max(1, round(BATCH_MAX_DRAFTS * 2 * minimum))]


def test_without_adaptive_drafts_keep_their_length():
    manager = make_manager(adaptive=False)
    request = make_request("r")
    reject_all(manager, request, 20)
    assert drafts(manager, [request], 4) == [8]  # no cap in a batch either


def test_nobody_drafts_in_a_batch_larger_than_disable_by_batch_size():
    manager = make_manager(disable_by_batch_size=4)
    requests = [make_request(f"r{i}") for i in range(2)]
    assert drafts(manager, requests, 5) == [0, 0]
    assert drafts(manager, requests, 4) == [BATCH_MAX_DRAFTS] * 2


def test_drafts_and_the_token_after_them_fit_in_max_tokens():
    manager = make_manager()
    request = make_request("r", max_tokens=4)
    assert drafts(manager, [request], 1) == [3]
