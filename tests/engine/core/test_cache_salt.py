"""`cache_salt` (vLLM's): prefix-cache hits, and the cached_tokens that report them, only
between requests with the same salt."""

from __future__ import annotations

import pytest

from agentrt.engine.core.block_hash import SaltedTokenIds, extend_block_hashes
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request
from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams

BS = 4


def request(req_id: str, prompt: list[int], salt: str | None) -> Request:
    params = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt)
    return Request(req_id, prompt, params, max_tokens=2, eos_token_ids=frozenset())


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return num_cached


def test_a_salt_changes_every_block_hash_and_unsalted_hashes_stay_as_they_were() -> None:
    tokens = list(range(12))
    plain = extend_block_hashes([], tokens, BS)
    assert extend_block_hashes([], SaltedTokenIds(tokens, None), BS) == plain
    a = extend_block_hashes([], SaltedTokenIds(tokens, "tenant-a"), BS)
    b = extend_block_hashes([], SaltedTokenIds(tokens, "tenant-b"), BS)
    assert len(a) == len(b) == 3
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert extend_block_hashes([], SaltedTokenIds(tokens, "tenant-a"), BS) == a


def test_prefix_hits_only_within_one_salt() -> None:
    kv = KVCacheManager(32, BS)
    prompt = list(range(13))  # 3 full blocks
    assert admit(kv, request("a1", prompt, "a")) == 0
    assert admit(kv, request("b1", prompt, "b")) == 0  # another tenant: no hit
    assert admit(kv, request("n1", prompt, None)) == 0  # unsalted: no hit either
    assert admit(kv, request("a2", prompt, "a")) == 12  # the same tenant: a hit
    assert admit(kv, request("n2", prompt, None)) == 12
    # Tokens appended after admission keep the salt (the list the request grows).
    salted = request("a3", prompt, "a")
    salted.append_output_token(99)
    assert salted.all_token_ids.cache_salt == "a"


@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_a_cache_salt_is_a_short_non_empty_string(salt) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
