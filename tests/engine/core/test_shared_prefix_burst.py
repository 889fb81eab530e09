"""A burst of requests on one shared prompt prefix: the prefix is computed once. Later
requests whose next block a running request is still to compute wait for it and then find
it in the cache; nobody starves and nothing deadlocks when the computing request is
aborted or preempted. Scheduler-only tests first, then the embedded model."""

from __future__ import annotations

import random

from agentrt.engine.args import EngineArgs
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.core.scheduler import Scheduler
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import EOS, run_step

PREFIX = [1000 + i for i in range(40)]  # 10 blocks of 4


def make_request(req_id: str, prompt: list[int], max_tokens: int = 3, priority=0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(
        req_id,
        prompt,
        params,
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        priority=priority,
    )


def shared_request(req_id: str, suffix: list[int], max_tokens: int = 3) -> Request:
    return make_request(req_id, PREFIX + suffix, max_tokens)


def make_scheduler(num_blocks=200, budget=64, cap=8, max_num_seqs=16, policy="fcfs"):
    kv = KVCacheManager(num_blocks, 4)
    args = EngineArgs(
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=cap,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
    )
    return Scheduler(args.create_engine_config().scheduler, kv, max_model_len=1024)


def run_counting(s: Scheduler, max_steps: int = 1000) -> tuple[dict[str, int], list]:
    """Steps until every request finished: the prompt tokens each request computed, and
    each step's chunks as (req_id, number of tokens)."""
    computed: dict[str, int] = {}
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return computed, steps
        requests = {r.req_id: len(r.prompt_token_ids) for r in s.running}
        out, _ = run_step(s)
        steps.append([(c.req_id, len(c.token_ids)) for c in out.chunks])
        for c in out.chunks:
            num_prompt = requests.get(c.req_id) or len(s.requests[c.req_id].prompt_token_ids)
            prompt_part = max(0, min(c.start_pos + len(c.token_ids), num_prompt) - c.start_pos)
            computed[c.req_id] = computed.get(c.req_id, 0) + prompt_part
    raise AssertionError("the scheduler did not finish")


def test_burst_on_a_shared_prefix_computes_it_once():
    """Six requests at once, one 40-token prefix and 3 tokens of their own each: the first
    computes the prefix (uncapped once the others wait for it), the others only their own
    tokens after the 10 cached blocks. Before, each was admitted on the blocks the ones
    before it had scheduled and recomputed the rest: 43, 35, 27, 19, 11 and 3 tokens."""
    s = make_scheduler()
    requests = [shared_request(f"r{i}", [i, i + 50, i + 90]) for i in range(6)]
    for request in requests:
        s.add_request(request)
    computed, steps = run_counting(s)
    assert computed == {"r0": 43, **{f"r{i}": 3 for i in range(1, 6)}}
    assert [r.num_cached_tokens for r in requests] == [0] + [40] * 5
    # r0 alone: its first chunk is capped (six could run), the rest of its prompt is not.
    assert steps[0] == [("r0", 8)] and steps[1][0] == ("r0", 35)
    assert s.kv.pool.num_free_blocks == 200


def test_a_request_on_another_prefix_goes_ahead_of_the_waiting_ones():
    """Waiting for a prefix does not hold up the queue: a later request with a prompt of
    its own is admitted while the earlier ones wait."""
    s = make_scheduler(budget=16)
    s.add_request(shared_request("a", [1]))
    s.add_request(shared_request("b", [2]))
    s.add_request(make_request("other", [7] * 9, max_tokens=2))
    run_step(s)
    out, _ = run_step(s)
    assert {c.req_id for c in out.chunks} == {"a", "other"}
    assert s.requests["b"].status == RequestStatus.WAITING
    computed, _ = run_counting(s)
    assert computed["b"] == 1 and s.requests == {}


def test_abort_of_the_computing_request_lets_a_waiting_one_take_over():
    s = make_scheduler(budget=16)
    requests = [shared_request(f"r{i}", [i]) for i in range(4)]
    for request in requests:
        s.add_request(request)
    run_step(s)
    run_step(s)  # r0 computed 8 + 16 of the 40 shared tokens; the others wait
    assert [r.req_id for r in s.running] == ["r0"]
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    computed, _ = run_counting(s)
    # r1 starts after r0's 6 cached blocks and computes the rest; r2 and r3 wait for it.
    assert computed == {"r1": 41 - 24, "r2": 1, "r3": 1}
    assert [r.num_cached_tokens for r in requests[1:]] == [24, 40, 40]
    s.kv.check_invariants()
    assert s.kv.pool.num_free_blocks == 200


def test_preemption_of_the_computing_request_does_not_deadlock():
    """A tight pool: a decode that arrived earlier preempts the prefix's computing request
    (the latest running one); it is readmitted first (it arrived before those that wait for
    it), resumes from its cached blocks, and everyone finishes."""
    s = make_scheduler(num_blocks=14, budget=64, cap=8)
    s.add_request(make_request("decode", [5, 6, 7], max_tokens=12))
    run_step(s)
    for i in range(3):
        s.add_request(shared_request(f"r{i}", [i], max_tokens=2))
    finished = set()
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        _, results = run_step(s)
        finished |= {r.req_id for r in results if r.finished}
    assert finished == {"decode", "r0", "r1", "r2"}
    assert s.num_preemptions >= 1
    assert s.kv.pool.num_free_blocks == 14


def test_randomized_bursts_on_few_prefixes_keep_invariants_and_finish():
    rng = random.Random(41)
    s = make_scheduler(num_blocks=40, budget=24, cap=6, max_num_seqs=6, policy="priority")
    prefixes = [[2000 + 100 * p + i for i in range(rng.randint(8, 60))] for p in range(3)]
    next_id = 0
    for _ in range(500):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(1, 60)] + [rng.randint(1, 9)]
            max_tokens = rng.randint(1, 12)
            if -(-(len(prompt) + max_tokens) // 4) <= 40:
                s.add_request(
                    make_request(f"r{next_id}", prompt, max_tokens, priority=rng.randint(0, 3))
                )
                next_id += 1
        if s.requests and rng.random() < 0.05:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
            s.kv.check_invariants()
        run_step(s)
    run_counting(s, max_steps=3000)
    assert s.kv.pool.num_free_blocks == 40 and not s.kv.req_to_blocks


def test_embedded_model_burst_computes_the_prefix_once_with_identical_outputs(
    smollm2_default_llm,
):
    """Four requests at once on one ~900-token system prompt (greedy, on the engine as users
    run it: a row's numbers do not depend on the rest of its step): the first computes it,
    the others report all its full blocks cached, and every output equals the same prompt's
    run one at a time."""
    llm = smollm2_default_llm
    tokenizer = llm.get_tokenizer()
    system = " ".join(f"Rule {i}: answer briefly and cite item {i * 7 % 13}." for i in range(70))
    prompts = [f"{system}\nQuestion {i}: what is {i} plus {i + 3}?" for i in range(4)]
    num_prefix = len(tokenizer.encode(system))
    assert 850 <= num_prefix <= 1000
    params = SamplingParams(temperature=0.0, max_tokens=6)
    block = llm.cache_config.block_size

    llm.reset_prefix_cache()
    burst = llm.generate(prompts, params)
    assert burst[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= num_prefix // block * block for o in burst[1:])
    llm.reset_prefix_cache()
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in burst] == [o.outputs[0].token_ids for o in alone]
    llm.kv_manager.check_invariants()
