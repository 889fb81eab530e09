"""KVCacheManager: which blocks each request holds, allocation for the next step, and
prefix caching by chained block hashes (block_hash.py: SHA-256). A hit is served only when
the indexed block holds the request's tokens after the request's parent hash: a collision
of the hash could share no KV."""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.engine.core.block_hash import BlockHash, extend_block_hashes
from agentrt.engine.core.block_pool import BlockPool, KVCacheBlock
from agentrt.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queried_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # of those, found in the cache
    num_collisions: int = 0  # lookups that found another prefix under a hash (never served)


class KVCacheManager:
    """Maps requests to block tables. Does not touch tensors: the model runner writes KV
    into the blocks whose ids the scheduler passes it."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already indexed
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full block of the request's known tokens (extended lazily)."""
        hashes = self.req_to_hashes.setdefault(request.req_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, self.block_size)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(request.all_token_ids[index * bs : (index + 1) * bs])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that has no blocks yet, in whole blocks,
        and its length in tokens. At least the last token is left to compute so the step
        produces logits. Does not take references (`allocate_slots` does)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        parent = None
        for i, block_hash in enumerate(self._block_hashes(request)[:max_blocks]):
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            if block.parent_hash != parent or block.token_ids != self._block_tokens(request, i):
                self.stats.num_collisions += 1  # another prefix under the same hash
                break
            hits.append(block)
            parent = block_hash
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        cache_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`,
        first reusing `computed_blocks` (prefix-cache hits of a new request, which the
        caller then counts as computed), and for `num_lookahead_tokens` after those (slots
        a draft model writes its KV into). New tokens may include drafts: only blocks full
        of the request's known tokens are ever indexed for prefix caching. With
        `cache_blocks=False` none of the new blocks is indexed (a KV connector still has to
        fill them: `cache_computed_blocks` indexes them once it has).

        Returns the newly allocated blocks (possibly empty), or None when the pool has too
        few free blocks; then nothing changes and the caller decides whether to preempt.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(computed_blocks))
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if not blocks and self.enable_prefix_caching:  # admission: count the lookup once
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += len(computed_blocks) * self.block_size
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks = blocks + computed_blocks + new_blocks
        self.req_to_blocks[request.req_id] = blocks
        if cache_blocks:
            self.cache_computed_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def has_blocks(self, request: Request) -> bool:
        return request.req_id in self.req_to_blocks

    def cache_computed_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's blocks that are full once its first `num_tokens` tokens (at
        most its known ones) are in the cache."""
        if self.enable_prefix_caching:
            num_known = min(num_tokens, request.num_tokens)
            self._cache_full_blocks(request, self.req_to_blocks[request.req_id], num_known)

    def free_excess_blocks(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens (slots of rejected drafts).
        None of them is indexed: only blocks full of known tokens are."""
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return
        num_needed = cdiv(request.num_tokens, self.block_size)
        if len(blocks) > num_needed:
            self.pool.free_blocks(list(reversed(blocks[num_needed:])))
            del blocks[num_needed:]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int):
        """Index the blocks that are full once this step's tokens are written. Their KV is
        written before any attention reads it in the same forward pass, so another request
        may hit them in the same step."""
        start = self.num_cached_blocks.get(request.req_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, end):
            self.pool.cache_block(
                blocks[i],
                hashes[i],
                parent_hash=hashes[i - 1] if i else None,
                token_ids=self._block_tokens(request, i),
            )
        self.num_cached_blocks[request.req_id] = end

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first so that a prompt's shared head is
        evicted last. A no-op for unknown requests. Cached blocks stay findable."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        if request.status.finished:  # a preempted request keeps its hashes for later
            self.req_to_hashes.pop(request.req_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def usage(self) -> float:
        return self.pool.usage()

    def check_invariants(self) -> None:
        """Every block is free xor referenced; ref counts equal the number of block tables
        holding the block; the free queue is a consistent list; every indexed hash maps to
        a block carrying that hash. Raises AssertionError."""
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                refs[block.block_id] += 1
        queued = set()
        prev = None
        for block in self.pool.free_queue:
            assert block.prev_free is not None and (prev is None or block.prev_free is prev)
            assert block.block_id not in queued, f"{block} queued twice"
            queued.add(block.block_id)
            prev = block
        assert len(queued) == self.pool.num_free_blocks, "free count out of sync"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but held by {refs[block.block_id]} tables"
            )
            assert (block.ref_cnt == 0) == (block.block_id in queued), f"{block} free xor used"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block} indexed under a stale hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                f"{block} indexed without its tokens"
            )
