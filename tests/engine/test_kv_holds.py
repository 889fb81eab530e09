"""A p2p producer's hold accounting (kv_transfer/p2p.py): the cap counts physical blocks."""

from __future__ import annotations

import secrets

import torch

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request
from agentrt.engine.kv_transfer.base import KVLayout
from agentrt.engine.kv_transfer.p2p import P2PScheduler
from agentrt.engine.sampling_params import SamplingParams

BS = 4


def scheduler(kv: KVCacheManager, fraction: float) -> P2PScheduler:
    config = KVTransferConfig(
        connector="p2p",
        role="producer",
        storage_path="/nonexistent",
        host="127.0.0.1",
        port=0,
        timeout_s=1.0,
        hold_timeout_s=60.0,
        max_held_fraction=fraction,
        secret=secrets.token_hex(16),
        allowed_producers=(),
        storage_max_gb=None,
    )
    layout = KVLayout("engine", BS, 1, 1, 8, torch.float32)
    return P2PScheduler(config, layout, kv, port=1)


def admitted(kv: KVCacheManager, req_id: str, prompt: list[int]) -> Request:
    params = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    request = Request(req_id, prompt, params, max_tokens=1, eos_token_ids=frozenset())
    hits, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request, request.num_tokens)
    return request


def test_held_blocks_shared_through_the_prefix_cache_count_once() -> None:
    kv = KVCacheManager(40, BS)
    p2p = scheduler(kv, fraction=0.5)  # 20 blocks may be held
    shared = list(range(100, 132))  # 8 full blocks every request shares
    for i in range(4):
        request = admitted(kv, f"r{i}", shared + [i, i + 1])
        p2p.held[request.req_id] = request
    # 4 requests of 9 blocks each, 8 of them the same physical blocks: 12 blocks, not 36.
    assert sum(len(kv.block_ids(f"r{i}")) for i in range(4)) == 36
    assert p2p._num_held() == 12
    assert p2p._num_held(kv.block_ids("r0")) == 12
