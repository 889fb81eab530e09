"""Scheduler and KV cache manager with tiny pools and no model: token budget, continuous
batching, chunked prefill, preemption, abort in every state, invariants after every step."""

from __future__ import annotations

import random

import pytest

from agentrt.engine.args import EngineArgs
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.core.scheduler import Scheduler
from agentrt.engine.records import SampledToken, SamplerStepOutput
from agentrt.engine.sampling_params import SamplingParams

EOS = 0


def make_request(req_id: str, num_prompt: int, max_tokens: int, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [100 + i for i in range(num_prompt)]
    return Request(
        req_id, prompt, params, max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), **kw
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size)
    args = EngineArgs(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, scheduling_policy=policy
    )
    return Scheduler(args.create_engine_config().scheduler, kv, max_model_len=1024)


def run_step(scheduler: Scheduler, token: int = 7):
    """One engine step with a fake model that always samples `token`."""
    out = scheduler.schedule()
    for chunk in out.chunks:
        # The chunk's tokens must have a slot in its block table.
        end = chunk.start_pos + len(chunk.token_ids)
        assert len(chunk.block_ids) * scheduler.kv.block_size >= end
    sampled = {c.req_id: [SampledToken(token)] for c in out.chunks if c.sample}
    results = scheduler.update_from_output(out, SamplerStepOutput(sampled))
    scheduler.kv.check_invariants()
    return out, results


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        _, results = run_step(scheduler)
        for r in results:
            if r.finished:
                finished[r.req_id] = r.finish_reason
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(budget=10)
    s.add_request(make_request("a", 25, 3))
    out, _ = run_step(s)
    assert [(c.req_id, len(c.token_ids), c.start_pos, c.sample) for c in out.chunks] == [
        ("a", 10, 0, False)
    ]
    out, _ = run_step(s)
    assert [(len(c.token_ids), c.start_pos) for c in out.chunks] == [(10, 10)]
    out, results = run_step(s)
    assert [(len(c.token_ids), c.start_pos, c.sample) for c in out.chunks] == [(5, 20, True)]
    assert results[0].new_token_ids == [7]


def test_decodes_and_new_prefill_share_a_step():
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 4, 10))
    run_step(s)  # prefill a
    s.add_request(make_request("b", 20, 10))
    out, _ = run_step(s)
    # a decodes one token; b gets the rest of the budget as a prefill chunk.
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("b", 7)]
    assert out.num_batched_tokens == 8


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 3, 4))
    out, _ = run_step(s)
    assert len(out.chunks) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    assert set(run_to_completion(s)) == {"r2", "r3", "r4", "r0", "r1"} - set()


def test_preemption_by_recompute_frees_blocks_and_resumes():
    # 6 blocks of 4 tokens; two requests of 8 prompt + 8 output need 4 blocks each.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    s.add_request(make_request("early", 8, 8))
    s.add_request(make_request("late", 8, 8))
    finished = run_to_completion(s)
    assert finished == {"early": "length", "late": "length"}
    assert s.num_preemptions >= 1
    assert s.kv.pool.num_free_blocks == 6


def test_latest_arrival_is_preempted_first_and_goes_to_front_of_waiting():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, max_num_seqs=2)
    s.add_request(make_request("early", 8, 8))
    s.add_request(make_request("late", 8, 8))
    s.add_request(make_request("queued", 2, 2))  # waits: max_num_seqs=2
    preempted = []
    while not preempted:
        out, _ = run_step(s)
        preempted = out.preempted_req_ids
    assert preempted == ["late"]
    assert s.requests["late"].status == RequestStatus.PREEMPTED
    assert s.requests["late"].num_computed_tokens == 0
    assert s.waiting[0].req_id == "late"  # ahead of "queued", which arrived after it


def test_priority_policy_orders_waiting_and_picks_victims():
    s = make_scheduler(num_blocks=5, block_size=4, budget=64, max_num_seqs=1, policy="priority")
    s.add_request(make_request("low", 4, 2, priority=5))
    s.add_request(make_request("high", 4, 2, priority=-1))
    s.add_request(make_request("mid", 4, 2, priority=0))
    order = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        for c in out.chunks:
            if not order or order[-1] != c.req_id:
                order.append(c.req_id)
    assert order == ["high", "mid", "low"]


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "finished", "unknown"])
def test_abort_in_every_state_frees_everything(state):
    s = make_scheduler(num_blocks=5, block_size=4, budget=64)
    s.add_request(make_request("a", 8, 8))
    s.add_request(make_request("b", 8, 8))
    target = {"waiting": "b", "running": "a", "preempted": "b", "finished": "a", "unknown": "zzz"}[
        state
    ]
    if state == "running":
        run_step(s)
    elif state == "preempted":
        while s.requests["b"].status != RequestStatus.PREEMPTED:
            run_step(s)
    elif state == "finished":
        while "a" in s.requests:
            run_step(s)
    aborted = s.finish_requests([target], RequestStatus.FINISHED_ABORTED)
    assert aborted == ([] if state in ("finished", "unknown") else [target])
    assert target not in s.requests
    assert s.finish_requests([target], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    s.kv.check_invariants()
    run_to_completion(s)
    assert s.kv.pool.num_free_blocks == 5


def test_long_prompt_does_not_starve_decodes():
    s = make_scheduler(num_blocks=200, block_size=4, budget=16, max_num_seqs=16)
    for i in range(6):
        s.add_request(make_request(f"d{i}", 2, 30))
    run_step(s)
    s.add_request(make_request("long", 300, 2))
    steps_with_decodes = 0
    while "long" in s.requests:
        out, _ = run_step(s)
        decodes = [c for c in out.chunks if c.req_id.startswith("d")]
        steps_with_decodes += bool(decodes)
        assert all(len(c.token_ids) == 1 for c in decodes)
    assert steps_with_decodes > 10
    run_to_completion(s)


def test_randomized_stress_keeps_invariants():
    rng = random.Random(1234)
    s = make_scheduler(num_blocks=24, block_size=4, budget=24, max_num_seqs=6, policy="priority")
    next_id = 0
    for _ in range(400):
        if rng.random() < 0.3:
            num_prompt, max_tokens = rng.randint(1, 40), rng.randint(1, 20)
            if -(-(num_prompt + max_tokens) // 4) <= 24:
                s.add_request(
                    make_request(f"r{next_id}", num_prompt, max_tokens, priority=rng.randint(0, 3))
                )
                next_id += 1
        if s.requests and rng.random() < 0.05:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
            s.kv.check_invariants()
        run_step(s)
    run_to_completion(s)
    assert s.kv.pool.num_free_blocks == 24 and not s.kv.req_to_blocks


def test_drafts_follow_only_a_chunk_that_reaches_the_known_end():
    """Drafts follow the request's last known token: while its known tokens (a sampled token
    and those jump-forward appended after it) take several chunks, they are dropped, not
    computed as if they were known tokens. (Another request runs beside it: the prefill cap
    applies only then.)"""
    kv = KVCacheManager(64, 4)
    args = EngineArgs(max_num_batched_tokens=32, long_prefill_token_threshold=2)
    scheduler = Scheduler(args.create_engine_config().scheduler, kv, 1024)
    scheduler.add_request(make_request("b", 1, 20))
    request = make_request("a", 6, 20)
    scheduler.add_request(request)
    run_step(scheduler)  # the prompt, 2 tokens per step
    run_step(scheduler)
    run_step(scheduler)
    request.append_output_token(8)  # as if jump-forward appended two forced tokens
    request.append_output_token(9)
    request.spec_token_ids = [10, 11]
    out = scheduler.schedule()
    chunk = next(c for c in out.chunks if c.req_id == "a")
    assert chunk.num_draft_tokens == 0 and not chunk.sample
    assert chunk.token_ids == request.all_token_ids[6:8] and request.spec_token_ids == []
    scheduler.update_from_output(out, SamplerStepOutput({}))
    request.spec_token_ids = [10, 11]
    # Now the chunk reaches the end: drafts follow.
    chunk = next(c for c in scheduler.schedule().chunks if c.req_id == "a")
    assert chunk.sample and chunk.num_draft_tokens == 2
    assert chunk.token_ids == [9, 10, 11] and chunk.start_pos == 8


def test_drafts_are_dropped_before_anyone_is_preempted():
    kv = KVCacheManager(3, 4)
    args = EngineArgs(max_num_batched_tokens=32)
    scheduler = Scheduler(args.create_engine_config().scheduler, kv, 1024)
    first, second = make_request("a", 3, 20), make_request("b", 3, 20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    run_step(scheduler)  # each holds one block; one is free
    first.spec_token_ids = [1, 2, 3, 4, 5, 6]  # would need two more blocks
    out = scheduler.schedule()
    assert not out.preempted_req_ids and [c.num_draft_tokens for c in out.chunks] == [0, 0]


def test_long_prefill_is_capped_only_while_others_run():
    """long_prefill_token_threshold (vLLM's): alone, a long prompt gets the whole budget;
    once a decode runs beside it, its chunks are capped and the decode gets a token every
    step, ahead of the prompt that arrived first; alone again, full chunks."""
    kv = KVCacheManager(200, 4)
    args = EngineArgs(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s = Scheduler(args.create_engine_config().scheduler, kv, max_model_len=1024)
    s.add_request(make_request("long", 300, 2))
    out, _ = run_step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 32)]
    s.add_request(make_request("short", 3, 6))
    out, _ = run_step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 8), ("short", 3)]
    for _ in range(5):  # the short request's 5 remaining tokens: one every step
        out, results = run_step(s)
        assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 8), ("short", 1)]
        assert [r.req_id for r in results] == ["short"]
    assert "short" not in s.requests and s.requests["long"].num_computed_tokens == 32 + 6 * 8
    out, _ = run_step(s)
    assert [(c.req_id, len(c.token_ids)) for c in out.chunks] == [("long", 32)]
    run_to_completion(s)


def test_default_prefill_cap_depends_on_the_device():
    assert EngineArgs().create_engine_config().scheduler.long_prefill_token_threshold == 64
    config = EngineArgs(long_prefill_token_threshold=0).create_engine_config()
    assert config.scheduler.long_prefill_token_threshold == 0
