"""KV cache groups (core/kv_cache_groups.py) in the KV cache manager: a sliding-window group
gives back the blocks that fall wholly out of its window, its prefix-cache hit needs only
the window before the first token to compute, and the hit is what every group serves. Then
the engine on a tiny Gemma 3: greedy output equal to HF's with the sliding groups' blocks
bounded by the window, through prefix reuse, preemption, drafts and tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.core.kv_cache_groups import (
    check_kv_cache_layout,
    kv_cache_layout,
    max_request_tokens,
)
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy_batch
from tests.engine.core.test_kv_cache import admit, finish, request
from tests.engine.gguf_files import Q
from tests.engine.hf_gguf import write_family_gguf
from tests.engine.test_model_families import _hf_reference

BS = 4
WINDOW = 6  # the next query sees the last 5 positions: 2 blocks before it, at most


def sliding_manager(num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, sliding_windows=(None, WINDOW))


def held(kv: KVCacheManager, req_id: str, group: int) -> list[int]:
    """Indices of the blocks the request's table in `group` still references."""
    blocks = kv.req_to_blocks[req_id][group]
    return [i for i, block in enumerate(blocks) if block is not kv.null_block]


def decode(kv: KVCacheManager, req, num_steps: int) -> None:
    """`num_steps` decode steps: one new token each, computed."""
    for step in range(num_steps):
        req.append_output_token(1000 + step)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.check_invariants()


def test_sliding_group_frees_the_blocks_behind_its_window_and_keeps_every_full_block():
    kv = sliding_manager()
    a = request("a", list(range(22)), max_tokens=20)
    admit(kv, a)  # a prefill holds every block it writes: its queries span it
    assert held(kv, "a", 1) == list(range(6))
    decode(kv, a, 20)  # 42 tokens: 11 blocks
    assert held(kv, "a", 0) == list(range(11))
    # The last query (position 41) saw keys 36..41; the next one (42) sees 37..42.
    assert held(kv, "a", 1) == [9, 10]
    assert kv.num_held_blocks("a") == 13
    assert kv.pool.num_free_blocks == 64 - 13
    finish(kv, a)
    assert kv.pool.num_free_blocks == 64


def test_decode_holds_at_most_the_window_and_the_block_being_written():
    kv = sliding_manager()
    a = request("a", list(range(5)), max_tokens=60)
    admit(kv, a)
    for _ in range(60):
        decode(kv, a, 1)
        assert len(held(kv, "a", 1)) <= -(-(WINDOW - 1) // BS) + 1
    assert len(held(kv, "a", 0)) == -(-a.num_tokens // BS)


def test_prefix_hit_takes_the_window_blocks_and_reuses_the_full_prefix():
    kv = sliding_manager()
    prompt = list(range(40))
    a = request("a", prompt)
    admit(kv, a)
    finish(kv, a)
    b = request("b", prompt + [7, 8])
    hits, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 40  # every full block, in both groups
    # Position 40 sees keys 35..40: blocks 8 and 9 of the sliding group, the null block before.
    assert [blk is kv.null_block for blk in hits[1]] == [True] * 8 + [False] * 2
    assert kv.allocate_slots(b, b.num_tokens - num_cached, hits) is not None
    kv.check_invariants()
    assert held(kv, "b", 1) == [8, 9, 10]
    assert kv.stats.num_hit_tokens == 40


def test_prefix_hit_shrinks_to_where_the_sliding_group_still_holds_its_window():
    kv = sliding_manager(num_blocks=24)
    prompt = list(range(40))
    a = request("a", prompt)
    admit(kv, a)
    finish(kv, a)
    # Evict the sliding group's blocks 8 and 9 (taken for new data), not the full group's.
    evicted = [kv.pool.cached[(1, h)] for h in kv._block_hashes(a)[8:10]]
    for block in evicted:
        kv.pool.touch([block])
        kv.pool._evict(block)
        kv.pool.free_blocks([block])
    b = request("b", prompt + [7])
    hits, num_cached = kv.get_computed_blocks(b)
    # The last 2 blocks of the window before position 32 (blocks 6, 7) are still cached.
    assert num_cached == 32
    assert len(hits[0]) == len(hits[1]) == 8
    assert kv.allocate_slots(b, b.num_tokens - num_cached, hits) is not None
    kv.check_invariants()


def test_a_sliding_hit_never_serves_another_prefix():
    kv = sliding_manager()
    admit(kv, request("a", list(range(40))))
    other = request("c", [9] + list(range(1, 40)))  # block 0 differs: no hash is shared
    assert kv.get_computed_blocks(other) == ([], 0)


def test_preempted_request_gives_back_every_group_and_recomputes():
    kv = sliding_manager(num_blocks=32)
    a = request("a", list(range(30)), max_tokens=10)
    admit(kv, a)
    decode(kv, a, 6)
    kv.free(a)  # preemption by recompute: the request keeps its hashes
    a.num_computed_tokens = 0
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 32
    hits, num_cached = kv.get_computed_blocks(a)
    assert num_cached == 32  # its own blocks, still cached
    assert kv.allocate_slots(a, a.num_tokens - num_cached, hits) is not None
    kv.check_invariants()


def test_full_attention_manager_is_one_table_as_before():
    kv = KVCacheManager(16, BS)
    a = request("a", list(range(30)), max_tokens=4)
    admit(kv, a)
    decode(kv, a, 4)
    assert kv.num_groups == 1 and kv.group_block_ids("a") == []
    assert len(kv.block_ids("a")) == 9 == kv.num_held_blocks("a")


def _gemma3_1b_shape() -> ModelArchConfig:
    """Gemma 3 1B's layer pattern (26 layers, a global one every 6th), window 512."""
    types = tuple(FULL_ATTENTION if i % 6 == 5 else SLIDING_ATTENTION for i in range(26))
    base = ModelArchConfig(
        "Gemma3ForCausalLM", 262144, 1152, 6912, 26, 4, 1, 256, 1e-6, 1e6, None, 32768,
        True, False, True, (1,),
    )  # fmt: skip
    return dataclasses.replace(base, layer_types=types, sliding_window=512)


def test_layout_groups_full_and_sliding_layers_in_groups_of_one_size():
    arch = _gemma3_1b_shape()
    layout = kv_cache_layout(arch)
    assert layout.group_size == 4
    assert layout.groups[0].layers == (5, 11, 17, 23)
    assert layout.sliding_windows == (None,) + (512,) * 6
    assert [len(g.layers) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]
    places = layout.layer_places(arch.num_layers)
    assert len(set(places)) == 26 and {slot for _, slot in places} == {0, 1, 2, 3}
    plain = kv_cache_layout(dataclasses.replace(arch, layer_types=()))
    assert plain.sliding_windows == (None,) and plain.group_size == 26


def test_request_limit_counts_a_sliding_groups_window_and_the_pool_holds_it():
    layout = kv_cache_layout(_gemma3_1b_shape())
    limit = max_request_tokens(layout, 1000, 16, max_chunk_tokens=512)
    assert limit > 1000 * 16 // len(layout.groups)  # more than every group keeping it all
    kv = KVCacheManager(1000, 16, sliding_windows=layout.sliding_windows)
    req = request("a", list(range(limit - 1)), max_tokens=1)
    while req.num_computed_tokens < req.num_tokens:  # alone, in chunks of 512: it fits
        num_new = min(512, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, num_new) is not None
        req.num_computed_tokens += num_new
    decode(kv, req, 1)
    plain = kv_cache_layout(dataclasses.replace(_gemma3_1b_shape(), layer_types=()))
    assert max_request_tokens(plain, 1000, 16, max_chunk_tokens=512) == 16000


def test_what_cannot_run_with_sliding_groups_is_refused():
    gemma = _gemma3_1b_shape()
    plain = dataclasses.replace(gemma, layer_types=())
    with pytest.raises(ConfigError, match="kv_connector='p2p'"):
        check_kv_cache_layout(gemma, kv_connector="p2p", draft_arch=None)
    with pytest.raises(ConfigError, match="draft"):
        check_kv_cache_layout(plain, kv_connector=None, draft_arch=gemma)
    check_kv_cache_layout(gemma, kv_connector=None, draft_arch=plain)  # group 0 keeps all
    check_kv_cache_layout(plain, kv_connector="storage", draft_arch=plain)


# -- the engine on a tiny Gemma 3 (five sliding layers of window 8, then a global one) --------

NUM_TOKENS = 12
ENGINE = {"kv_cache_memory_gb": 0.02, "block_size": 8, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(GGUF path, transformers' model on the same weights) of the tiny Gemma 3."""
    path, config = write_family_gguf(
        "gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", qtype=Q.F32
    )
    return path, _hf_reference(path, config)


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = NUM_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params)


def test_engine_frees_local_blocks_and_matches_hf(gemma3, monkeypatch):
    path, hf = gemma3
    llm = LLM(str(path), dtype="float32", **ENGINE)
    kv = llm.kv_manager
    assert kv.sliding_windows == (None,) + (8,) * 5
    most = {}  # req_id -> the most blocks one sliding group held in a decode step
    allocate = kv.allocate_slots

    def recording(request, num_new_tokens, *args, **kwargs):
        blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if blocks is not None and num_new_tokens == 1:
            tables = kv.req_to_blocks[request.req_id][1:]
            held = max(sum(b is not kv.null_block for b in t) for t in tables)
            most[request.req_id] = max(most.get(request.req_id, 0), held)
        return blocks

    monkeypatch.setattr(kv, "allocate_slots", recording)
    prompts = _prompts((5, 13, 30, 70))
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    assert got == hf_greedy_batch(hf, prompts, NUM_TOKENS)
    # A decode's window (8) spans at most 2 blocks of 8: the sliding groups hold no more,
    # where every layer kept 11 blocks of the 82-token request before.
    assert len(most) == 4 and max(most.values()) == 2
    kv.check_invariants()
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_prefix_cache_reuse_across_requests_stays_exact(gemma3):
    path, hf = gemma3
    llm = LLM(str(path), dtype="float32", **ENGINE)
    shared = _prompts((45,), seed=1)[0]
    first, second = shared + [11, 12, 13], shared + [21, 22]
    outputs = _generate(llm, [first]) + _generate(llm, [second])
    assert outputs[1].num_cached_tokens == 40  # 5 whole blocks in every group
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == hf_greedy_batch(hf, [first, second], NUM_TOKENS)
    llm.kv_manager.check_invariants()


def test_preemption_and_recompute_stay_exact(gemma3):
    path, hf = gemma3
    # Three short prompts fit at once (6 blocks each), but decoding 24 tokens each holds
    # 4 full blocks and 5 x 2 sliding ones: 42 > 30 blocks, so some are recomputed.
    llm = LLM(str(path), dtype="float32", block_size=8, num_kv_blocks=30)
    prompts = _prompts((5, 6, 7), seed=2)
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts, max_tokens=24)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_greedy_batch(hf, prompts, 24)
    llm.kv_manager.check_invariants()


def test_ngram_drafts_verified_across_the_window_stay_exact(gemma3):
    path, hf = gemma3
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **ENGINE)
    pattern = _prompts((10,), seed=3)[0]
    prompts = [pattern * 3, pattern * 2 + pattern[:5]]  # repeats: prompt lookup drafts
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    assert llm.stats().spec_decode.num_draft_tokens > 0
    assert got == hf_greedy_batch(hf, prompts, NUM_TOKENS)
    llm.kv_manager.check_invariants()
    assert llm.kv_manager.pool.num_free_blocks == llm.kv_manager.num_blocks


def test_a_full_attention_draft_model_keeps_the_output_exact(gemma3, tmp_path):
    path, hf = gemma3
    draft, _ = write_family_gguf("llama", tmp_path / "draft.gguf", qtype=Q.F32)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **ENGINE)
    prompts = _prompts((13, 30), seed=5)
    got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    assert llm.stats().spec_decode.num_draft_tokens > 0
    assert got == hf_greedy_batch(hf, prompts, NUM_TOKENS)
    llm.kv_manager.check_invariants()


def test_tensor_parallel_ranks_get_every_groups_tables(gemma3):
    path, hf = gemma3
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, **ENGINE)
    try:
        prompts = _prompts((13, 30), seed=4)
        got = [o.outputs[0].token_ids for o in _generate(llm, prompts)]
    finally:
        llm.shutdown()
    assert got == hf_greedy_batch(hf, prompts, NUM_TOKENS)


def test_a_kv_connector_with_sliding_layers_is_refused_at_start(gemma3, tmp_path):
    path, _ = gemma3
    with pytest.raises(ConfigError, match="sliding-window layers"):
        LLM(str(path), dtype="float32", kv_connector="storage", kv_storage_path=str(tmp_path))
