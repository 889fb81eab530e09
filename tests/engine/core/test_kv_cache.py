"""Prefix caching in the KV cache manager: chained hashes over full blocks, shared blocks
with ref counts, lazy LRU eviction, touch on hit, reset; and through the scheduler."""

from __future__ import annotations

import hashlib
import random
import struct

from agentrt.engine.core import block_hash
from agentrt.engine.core.block_hash import ROOT_HASH, extend_block_hashes
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import make_scheduler, run_step, run_to_completion

BS = 4


def request(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        eos_token_ids=frozenset(),
    )


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does for a waiting request; returns the cached token count."""
    hits, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.check_invariants()
    return num_cached


def finish(kv: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    kv.check_invariants()


def test_shared_prefix_blocks_are_reused_and_ref_counted():
    kv = KVCacheManager(16, BS)
    a = request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    b = request("b", list(range(8)) + [50, 51, 52])  # shares the 2 full blocks
    assert admit(kv, b) == 8
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert kv.block_ids("a")[2] != kv.block_ids("b")[2]  # partial blocks are never shared
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("b")] == [2, 2, 1]
    finish(kv, a)
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("b")] == [1, 1, 1]
    assert kv.stats.num_hit_tokens == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, BS)
    admit(kv, request("a", list(range(8))))
    assert admit(kv, request("b", list(range(8)))) == 4  # not 8: one token left to run
    assert admit(kv, request("c", list(range(9)))) == 8


def test_freed_blocks_stay_cached_until_evicted_in_lru_order():
    kv = KVCacheManager(4, BS)
    a = request("a", list(range(8)) + [99])  # 3 blocks: two full (cached), one partial
    admit(kv, a)
    finish(kv, a)
    assert len(kv.pool.cached) == 2 and kv.pool.num_free_blocks == 4
    # Freed tail first: the free queue ends with a's first block (evicted last).
    order = kv.pool.free_block_ids()
    assert order == [3, 2, 1, 0]  # the never-used block, then a's blocks tail first
    assert order[-1] == kv.pool.cached[next(iter(kv.pool.cached))].block_id
    # A hit touches cached blocks out of the free queue.
    assert admit(kv, request("b", list(range(8)) + [7])) == 8
    assert kv.pool.num_free_blocks == 1
    # Pressure: a new prompt needing 3 blocks cannot fit without b's blocks.
    assert kv.allocate_slots(request("c", list(range(100, 112))), 12) is None
    kv.check_invariants()


def test_eviction_removes_hash_and_new_data_is_not_found():
    kv = KVCacheManager(3, BS)
    a = request("a", list(range(8)) + [1])
    admit(kv, a)
    finish(kv, a)
    c = request("c", list(range(200, 212)))  # takes all 3 blocks, evicting a's
    assert admit(kv, c) == 0
    hits, num_cached = kv.get_computed_blocks(request("e", list(range(8)) + [1]))
    assert hits == [] and num_cached == 0
    kv.check_invariants()


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    a = request("a", list(range(9)))
    admit(kv, a)
    finish(kv, a)
    kv.reset_prefix_cache()
    assert not kv.pool.cached
    assert kv.get_computed_blocks(request("b", list(range(9)))) == ([], 0)
    kv.check_invariants()


def test_extra_tokens_change_the_hash_chain():
    kv = KVCacheManager(8, BS)
    admit(kv, request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: nothing may be reused.
    assert admit(kv, request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_preempted_request_resumes_from_its_cached_prefix():
    s = make_scheduler(num_blocks=7, block_size=4, budget=64, max_num_seqs=4)
    s.add_request(request("early", list(range(12)), max_tokens=8))
    s.add_request(request("late", list(range(100, 112)), max_tokens=8))
    while s.num_preemptions == 0:
        run_step(s)
    hits_before = s.kv.stats.num_hit_tokens
    run_to_completion(s)
    assert s.kv.stats.num_hit_tokens > hits_before  # "late" found its blocks again


def test_randomized_stress_with_shared_prefixes():
    rng = random.Random(7)
    s = make_scheduler(num_blocks=20, block_size=4, budget=20, max_num_seqs=5)
    prefixes = [[rng.randint(1, 50) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    for step in range(300):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randint(1, 50) for _ in range(rng.randint(0, 8))]
            s.add_request(request(f"r{step}", prompt, max_tokens=rng.randint(1, 12)))
        if s.requests and rng.random() < 0.05:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        run_step(s)
    run_to_completion(s)
    assert s.kv.stats.num_hit_tokens > 0
    assert s.kv.pool.num_free_blocks == 20 and not s.kv.req_to_blocks
    s.kv.check_invariants()


def test_prefix_stats_count_each_admission_once():
    kv = KVCacheManager(3, BS)
    a = request("a", list(range(9)))
    admit(kv, a)  # 3 blocks: the pool is full
    b = request("b", list(range(9)))
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits) is None  # needs one more block: retried later
    assert kv.stats.num_queried_tokens == 9 and kv.stats.num_hit_tokens == 0
    finish(kv, a)
    assert admit(kv, b) == 8
    assert kv.stats.num_queried_tokens == 18 and kv.stats.num_hit_tokens == 8


# -- the block hash ---------------------------------------------------------------------------


def test_one_sha256_chain_names_blocks_for_the_cache_the_router_and_the_connectors():
    from agentrt.engine.client.dp_router import DPRouter
    from agentrt.engine.kv_transfer.base import content_key

    tokens = list(range(1000, 1013))  # three full blocks of 4 and one token
    req = request("a", tokens)
    kv = KVCacheManager(8, BS)
    hashes = kv._block_hashes(req)
    assert len(hashes) == 3 and all(len(h) == 32 for h in hashes)
    # SHA-256 over the parent hash and the tokens, as documented (block_hash.py).
    first = hashlib.sha256(ROOT_HASH + struct.pack("<4q", *tokens[:4])).digest()
    assert hashes[0] == first
    assert hashes[1] == hashlib.sha256(first + struct.pack("<4q", *tokens[4:8])).digest()
    assert DPRouter(2, BS)._block_hashes(tokens) == hashes
    assert content_key(tokens[:12], BS) == hashes[2].hex()
    assert extend_block_hashes([], tokens, BS, extra_keys=("lora",)) != hashes


def collide_every_block(monkeypatch) -> None:
    """Every block of every prompt hashes alike: what a broken hash would allow."""
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, token_ids, extra=(): b"=" * 32)


def test_a_hash_collision_is_never_served(monkeypatch):
    collide_every_block(monkeypatch)
    kv = KVCacheManager(16, BS)
    admit(kv, request("a", list(range(9))))
    # Other tokens under the same hash: no hit.
    assert admit(kv, request("b", list(range(50, 59)))) == 0
    # The same first block hits; the second one's hash names a block with another parent.
    assert admit(kv, request("c", list(range(9)))) == BS
    assert kv.stats.num_collisions == 2
    assert kv.stats.num_hit_tokens == BS


def test_colliding_prompts_keep_their_own_kv(monkeypatch, tiny_checkpoint):
    from agentrt.engine.client.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[rng_token(i, j) for j in range(40)] for i in range(2)]
    alone = LLM(
        str(tiny_checkpoint("llama")),
        dtype="float32",
        num_kv_blocks=32,
        enable_prefix_caching=False,
    )
    expected = [out.outputs[0].token_ids for out in alone.generate(prompts, params)]
    collide_every_block(monkeypatch)
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=32)
    got = [llm.generate([p], params)[0] for p in prompts]  # one after the other: cached
    assert [out.outputs[0].token_ids for out in got] == expected
    assert got[1].num_cached_tokens == 0
    assert llm.engine.kv_manager.stats.num_collisions >= 1
    llm.engine.kv_manager.check_invariants()


def rng_token(i: int, j: int) -> int:
    return random.Random(i * 1000 + j).randrange(100, 40_000)
