"""BlockPool and its FreeBlockQueue: LRU order, O(1) removal from the middle, ref counts,
touch on prefix hits, lazy eviction, first writer wins, reset, errors, usage; and a
property test over random operation sequences that checks the pool's invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.engine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return pool.free_block_ids()


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def check_invariants(pool: BlockPool) -> None:
    """What must hold between any two operations."""
    queue = list(pool.free_queue)  # the free queue after its never-used ids
    free = [b for b in pool.blocks if b.ref_cnt == 0]
    # Blocks are created in id order; the ids not created yet are the queue's head.
    assert ids(pool.blocks) == list(range(pool.num_created))
    never_used = list(range(pool.num_created, pool.num_blocks))
    assert free_ids(pool) == never_used + ids(queue)
    # A block is free exactly when its ref count is 0, and then it is queued exactly once.
    assert pool.num_free_blocks == len(never_used) + len(free)
    assert len(free) == len(queue) and sorted(ids(queue)) == ids(free)
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    # The links agree in both directions.
    backwards = []
    block = pool.free_queue._tail.prev_free
    while block is not pool.free_queue._head:
        backwards.append(block)
        block = block.prev_free
    assert backwards[::-1] == queue
    for block in pool.blocks:
        if block.ref_cnt > 0:
            assert block.prev_free is None and block.next_free is None
    # The prefix index and the blocks' hashes describe each other.
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    hashed = {b.block_hash: b for b in pool.blocks if b.block_hash is not None}
    assert hashed == pool.cached
    assert pool.usage() == pytest.approx(1 - (len(never_used) + len(free)) / pool.num_blocks)


# --- FreeBlockQueue -------------------------------------------------------------------------


def test_queue_keeps_insertion_order_and_pops_from_the_head():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert ids(list(queue)) == [0, 1, 2, 3] and queue.num_free == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert ids(list(queue)) == [1, 2, 3, 0]
    assert blocks[0].next_free is not None and blocks[0].prev_free is blocks[3]


def test_queue_removes_from_the_middle_and_relinks_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(list(queue)) == [0, 1, 3, 4] and queue.num_free == 4
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert ids(list(queue)) == [1, 3] and queue.num_free == 2


def test_queue_empty_pop_raises_and_removing_an_unqueued_block_asserts():
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    queue.popleft()
    assert list(queue) == [] and queue.num_free == 0
    with pytest.raises(IndexError, match="no free blocks"):
        queue.popleft()
    with pytest.raises(AssertionError, match="not in the free queue"):
        queue.remove(block)


# --- BlockPool ------------------------------------------------------------------------------


def test_new_pool_has_every_block_free_in_id_order():
    pool = BlockPool(6)
    assert free_ids(pool) == list(range(6))
    assert pool.num_free_blocks == 6 and pool.usage() == 0.0
    assert pool.cached == {}
    check_invariants(pool)


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(6)
    taken = pool.get_new_blocks(2)
    assert ids(taken) == [0, 1] and [b.ref_cnt for b in taken] == [1, 1]
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.usage() == pytest.approx(2 / 6)
    assert pool.get_new_blocks(0) == []
    check_invariants(pool)


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0, 1, 2
    pool.free_blocks(a[::-1])  # a request's blocks tail first: its last block goes first
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]  # least recently freed first
    check_invariants(pool)


def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1 and free_ids(pool) == [3]
    check_invariants(pool)


def test_a_shared_block_is_freed_only_by_its_last_reference():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool)[-1] == block.block_id
    check_invariants(pool)


def test_double_free_asserts():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2
    check_invariants(pool)


def test_a_freed_block_keeps_its_hash_and_a_hit_pulls_it_out_of_the_queue():
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)
    pool.cache_block(a[0], 111)
    pool.cache_block(a[1], 222)
    pool.free_blocks(a[::-1])
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    # Lazy eviction: still findable while free.
    assert pool.cached == {111: a[0], 222: a[1]}
    assert a[0].block_hash == 111 and a[0].ref_cnt == 0
    # A prefix hit on both: out of the queue (from its middle and tail), one reference each.
    pool.touch([pool.cached[111], pool.cached[222]])
    assert free_ids(pool) == [3, 4, 2]
    assert [a[0].ref_cnt, a[1].ref_cnt] == [1, 1]
    assert pool.cached == {111: a[0], 222: a[1]}  # a hit keeps the hash
    check_invariants(pool)


def test_taking_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(2)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], 111)
    pool.cache_block(a[1], 222)
    pool.free_blocks(a)
    (taken,) = pool.get_new_blocks(1)
    assert taken is a[0]
    assert taken.block_hash is None and pool.cached == {222: a[1]}
    check_invariants(pool)


def test_first_writer_wins():
    pool = BlockPool(3)
    first, second, other = pool.get_new_blocks(3)
    pool.cache_block(first, 7)
    pool.cache_block(second, 7)  # the same content computed again: the first copy stays
    assert pool.cached == {7: first} and second.block_hash is None
    pool.cache_block(first, 8)  # a block is indexed once, under its first hash
    assert pool.cached == {7: first} and first.block_hash == 7
    pool.cache_block(other, 9)
    assert pool.cached == {7: first, 9: other}
    check_invariants(pool)


def test_a_hash_evicted_with_its_block_can_be_cached_again_by_another():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 7)
    pool.free_blocks([a])
    (reused,) = pool.get_new_blocks(1)  # takes a: hash 7 evicted
    assert reused is a and pool.cached == {}
    pool.cache_block(b, 7)
    assert pool.cached == {7: b}
    check_invariants(pool)


def test_reset_prefix_cache_forgets_every_hash_but_keeps_references():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    for i, block in enumerate(a):
        pool.cache_block(block, 100 + i)
    pool.free_blocks([a[2]])  # one cached block is free, two are in use
    pool.reset_prefix_cache()
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    assert [b.ref_cnt for b in a] == [1, 1, 0] and free_ids(pool) == [3, 2]
    # The in-use blocks can be indexed again once recomputed.
    pool.cache_block(a[0], 100)
    assert pool.cached == {100: a[0]}
    check_invariants(pool)


def test_usage_tracks_blocks_in_use():
    pool = BlockPool(8)
    a = pool.get_new_blocks(6)
    assert pool.usage() == pytest.approx(0.75)
    pool.free_blocks(a[:2])
    assert pool.usage() == pytest.approx(0.5)
    pool.get_new_blocks(4)
    assert pool.usage() == 1.0


# --- property test --------------------------------------------------------------------------

NUM_BLOCKS = 6
# (kind, a, b): kinds weighted so that sequences often cache, free and then hit a block.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "new", "free", "free", "cache", "cache", "hit", "hit", "reset"]),
        st.integers(0, NUM_BLOCKS + 1),
        st.integers(0, 3),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_random_operations_keep_the_pool_consistent(ops):
    """Requests hold references (a list per request, as the KV cache manager does); after
    each op the pool is checked against a plain model: which blocks are taken, which hashes
    are findable and the exact free-queue order (LRU), plus `check_invariants`."""
    pool = BlockPool(NUM_BLOCKS)
    held: list[list[KVCacheBlock]] = []  # one list of references per "request"
    order = list(range(NUM_BLOCKS))  # expected free queue, head first
    for kind, a, b in ops:
        if kind == "new":
            if a > len(order):
                with pytest.raises(ValueError):
                    pool.get_new_blocks(a)
            else:
                blocks = pool.get_new_blocks(a)
                assert ids(blocks) == order[:a]
                assert all(x.block_hash is None and x.ref_cnt == 1 for x in blocks)
                order = order[a:]
                held.append(blocks)
        elif kind == "free" and held:
            blocks = held.pop(a % len(held))
            last_refs = [x.block_id for x in blocks[::-1] if x.ref_cnt == 1]
            pool.free_blocks(blocks[::-1])
            order += last_refs
        elif kind == "cache" and held and held[a % len(held)]:
            blocks = held[a % len(held)]
            block = blocks[b % len(blocks)]
            # Indexed once, under its first hash; a hash already indexed keeps its block.
            unchanged = block.block_hash is not None or b in pool.cached
            expected = dict(pool.cached) if unchanged else pool.cached | {b: block}
            pool.cache_block(block, b)
            assert pool.cached == expected
        elif kind == "hit" and pool.cached:
            # Free cached blocks first: most hits come out of the free queue's middle.
            candidates = sorted(pool.cached.values(), key=lambda x: x.ref_cnt)
            block = candidates[a % len(candidates)]
            if block.ref_cnt == 0:
                order.remove(block.block_id)
            pool.touch([block])
            held.append([block])
        elif kind == "reset":
            pool.reset_prefix_cache()
            assert pool.cached == {}
        assert free_ids(pool) == order
        check_invariants(pool)
    # Every reference still held can be dropped exactly once.
    for blocks in held:
        pool.free_blocks(blocks)
    assert pool.num_free_blocks == NUM_BLOCKS
    check_invariants(pool)
