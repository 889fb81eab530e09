"""KVCacheManager: which blocks each request holds, allocation for the next step, and
prefix caching by chained block hashes (block_hash.py: SHA-256). A hit is served only when
the indexed block holds the request's tokens after the request's parent hash: a collision
of the hash could share no KV.

A request holds one block table per KV cache group (kv_cache_groups.py; one group for a
model of full-attention layers only). The table of a sliding-window group gives back the
blocks that lie wholly before its window as the window moves (vLLM's SlidingWindowManager):
their entries become the manager's `null_block`, whose id (0) only fills the table;
attention never reads a position before its window (worker/windowed_attention.py), so the
null block is never read. Its prefix-cache hit needs only the blocks of the window before
the first token to compute, and the hit is the longest prefix every group can serve."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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


# Per group: a request's block table, or its prefix-cache hits.
GroupBlocks = list[list[KVCacheBlock]]


class KVCacheManager:
    """Maps requests to block tables. Does not touch tensors: the model runner writes KV
    into the blocks whose ids the scheduler passes it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ):
        """`sliding_windows`: per KV cache group its window (None: full attention), as
        `KVCacheLayout.sliding_windows`; the default is one full-attention group."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows = tuple(sliding_windows)
        self.has_sliding_groups = any(w is not None for w in self.sliding_windows)
        self.pool = BlockPool(num_blocks)
        # What a table holds in place of a block given back behind a window: never in the
        # pool, never referenced, never read.
        self.null_block = KVCacheBlock(0)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already indexed
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full block of the request's known tokens (extended lazily)."""
        hashes = self.req_to_hashes.setdefault(request.req_id, [])
        return extend_block_hashes(hashes, request.all_token_ids, self.block_size)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(request.all_token_ids[index * bs : (index + 1) * bs])

    def _cache_key(self, group: int, block_hash: BlockHash) -> Hashable:
        """A block's key in the pool's index: its hash in group 0, (group, hash) in the
        others (the same tokens' KV of other layers)."""
        return block_hash if group == 0 else (group, block_hash)

    def _window_blocks(self, group: int) -> int | None:
        """Blocks before a position that its window reaches back into (None: every one)."""
        window = self.sliding_windows[group]
        return None if window is None else cdiv(window - 1, self.block_size)

    def _num_skipped_blocks(self, group: int, num_computed: int) -> int:
        """Leading blocks the group no longer needs once `num_computed` tokens are in the
        cache: the next query, at position num_computed, sees keys from
        num_computed - window + 1 on."""
        window = self.sliding_windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request that has no blocks yet, in whole blocks,
        per group (a sliding group's blocks before its window are the null block), and its
        length in tokens. At least the last token is left to compute so the step produces
        logits. Does not take references (`allocate_slots` does)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request)[:max_blocks]
        found = [self._cached_blocks(request, g, hashes) for g in range(self.num_groups)]
        num_hits = len(hashes)
        while True:  # the longest prefix every group serves (each hit only shrinks it)
            before = num_hits
            for g, blocks in enumerate(found):
                num_hits = self._longest_hit(g, blocks, num_hits)
            if num_hits == before:
                break
        if num_hits == 0:
            return [], 0
        hits = []
        for g, blocks in enumerate(found):
            first = self._num_skipped_blocks(g, num_hits * self.block_size)
            hits.append([self.null_block] * first + blocks[first:num_hits])
        return hits, num_hits * self.block_size

    def next_block_hash(self, request: Request, num_cached: int) -> BlockHash | None:
        """The hash of the block a request that has `num_cached` tokens from the cache (as
        `get_computed_blocks` gives them) computes first, when that block is full and not
        the last token's (which is always computed); else None. Does not change the cache."""
        index = num_cached // self.block_size
        if not self.enable_prefix_caching or index >= (request.num_tokens - 1) // self.block_size:
            return None
        return self._block_hashes(request)[index]

    def in_flight_block_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks of known tokens not indexed yet: those it
        computes in the steps to come (a running prompt's rest; `allocate_slots` indexes a
        step's blocks as it schedules them). Empty without prefix caching. Does not change
        the cache."""
        if not self.enable_prefix_caching or request.req_id not in self.req_to_blocks:
            return []
        start = self.num_cached_blocks.get(request.req_id, 0)
        return self._block_hashes(request)[start:]

    def _cached_blocks(
        self, request: Request, group: int, hashes: list[BlockHash]
    ) -> list[KVCacheBlock | None]:
        """The group's indexed block of each of `hashes` holding the request's tokens, None
        where there is none (a full group stops at its first miss: its hit is a prefix)."""
        found: list[KVCacheBlock | None] = []
        for i, block_hash in enumerate(hashes):
            block = self.pool.cached.get(self._cache_key(group, block_hash))
            parent = hashes[i - 1] if i else None
            if block is not None and (
                block.parent_hash != parent or block.token_ids != self._block_tokens(request, i)
            ):
                self.stats.num_collisions += 1  # another prefix under the same hash
                block = None
            found.append(block)
            if block is None and self.sliding_windows[group] is None:
                break
        return found

    def _longest_hit(self, group: int, found: list[KVCacheBlock | None], limit: int) -> int:
        """The most blocks, at most `limit`, after which the group holds what the next
        query needs: every block before (full attention), or the window's last blocks."""
        need = self._window_blocks(group)
        if need is None:
            num = 0
            while num < min(limit, len(found)) and found[num] is not None:
                num += 1
            return num
        run = 0
        for i in range(min(limit, len(found)) - 1, -1, -1):  # from the end, as vLLM
            run = run + 1 if found[i] is not None else 0
            if run >= need:
                return i + need
        return run  # a run from block 0 on: the whole prefix is there

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        *,
        cache_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`,
        first reusing `computed_blocks` (prefix-cache hits of a new request, per group, as
        `get_computed_blocks` gives them; the caller then counts them as computed), and for
        `num_lookahead_tokens` after those (slots a draft model writes its KV into). New
        tokens may include drafts: only blocks full of the request's known tokens are ever
        indexed for prefix caching. With `cache_blocks=False` none of the new blocks is
        indexed (a KV connector still has to fill them: `cache_computed_blocks` indexes them
        once it has). A sliding group first gives back its blocks wholly before the window
        of the first new token (they are never read again).

        Returns the newly allocated blocks (possibly empty; every group's), or None when the
        pool has too few free blocks; then nothing else changes and the caller decides
        whether to preempt.
        """
        computed_blocks = computed_blocks or [[] for _ in self.sliding_windows]
        tables = self.req_to_blocks.get(request.req_id)
        num_hits = len(computed_blocks[0]) * self.block_size
        num_computed = request.num_computed_tokens + num_hits
        if tables is not None and self.has_sliding_groups:
            for g, blocks in enumerate(tables):
                self._free_skipped_blocks(blocks, self._num_skipped_blocks(g, num_computed))
        # Every group's table has the same length (a sliding group's starts with null blocks).
        num_held = len(tables[0]) if tables else 0
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - num_held - len(computed_blocks[0]))
        # Hits sitting in the free queue stop being free once touched.
        hits = [b for group in computed_blocks for b in group if b is not self.null_block]
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks * self.num_groups + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if tables is None and self.enable_prefix_caching:  # admission: count the lookup once
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += num_hits
        self.pool.touch(hits)
        if tables is None:
            tables = self.req_to_blocks[request.req_id] = [[] for _ in self.sliding_windows]
        new_blocks = []
        for blocks, group_hits in zip(tables, computed_blocks, strict=True):
            blocks += group_hits
            if num_new_blocks:
                group_new = self.pool.get_new_blocks(num_new_blocks)
                blocks += group_new
                new_blocks += group_new
        if cache_blocks:
            self.cache_computed_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _free_skipped_blocks(self, blocks: list[KVCacheBlock], num_skipped: int) -> None:
        """Give back a sliding group's blocks before `num_skipped` (latest first, as `free`
        gives back a table), leaving the null block in their places."""
        num_skipped = min(num_skipped, len(blocks))
        if not num_skipped or blocks[num_skipped - 1] is self.null_block:
            return  # nothing more fell out of the window
        freed = []
        for i in range(num_skipped - 1, -1, -1):
            if blocks[i] is self.null_block:
                break  # those before were given back already
            freed.append(blocks[i])
            blocks[i] = self.null_block
        self.pool.free_blocks(freed)

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
        tables = self.req_to_blocks.get(request.req_id)
        if not tables:
            return
        num_needed = cdiv(request.num_tokens, self.block_size)
        for blocks in tables:
            if len(blocks) > num_needed:
                self.pool.free_blocks(list(reversed(blocks[num_needed:])))
                del blocks[num_needed:]

    def _cache_full_blocks(self, request: Request, tables: GroupBlocks, num_tokens: int):
        """Index the blocks that are full once this step's tokens are written. Their KV is
        written before any attention reads it in the same forward pass, so another request
        may hit them in the same step. (A null block is skipped: what it replaced was
        indexed when it filled, or came from the cache.)"""
        start = self.num_cached_blocks.get(request.req_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, end):
            parent = hashes[i - 1] if i else None
            token_ids = self._block_tokens(request, i)
            for g, blocks in enumerate(tables):
                if blocks[i] is not self.null_block:
                    key = self._cache_key(g, hashes[i])
                    self.pool.cache_block(blocks[i], key, parent_hash=parent, token_ids=token_ids)
        self.num_cached_blocks[request.req_id] = end

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first so that a prompt's shared head is
        evicted last. A no-op for unknown requests. Cached blocks stay findable."""
        tables = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        if request.status.finished:  # a preempted request keeps its hashes for later
            self.req_to_hashes.pop(request.req_id, None)
        for blocks in tables or ():
            self.pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block])

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """The request's block table in `group` (group 0: the one of a model of
        full-attention layers, and a KV connector's)."""
        tables = self.req_to_blocks.get(req_id)
        return [block.block_id for block in tables[group]] if tables else []

    def group_block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block tables of the groups after the first (none for one group)."""
        return [self.block_ids(req_id, g) for g in range(1, self.num_groups)]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks the request references now, over every group."""
        tables = self.req_to_blocks.get(req_id, ())
        return sum(1 for blocks in tables for b in blocks if b is not self.null_block)

    def usage(self) -> float:
        return self.pool.usage()

    def check_invariants(self) -> None:
        """Every block is free xor referenced; ref counts equal the number of block tables
        holding the block; the free queue is a consistent list; every indexed hash maps to
        a block carrying that hash; a sliding group's table holds null blocks only at its
        head, and a full group's none. Raises AssertionError."""
        refs = [0] * self.pool.num_blocks
        for tables in self.req_to_blocks.values():
            assert len({len(blocks) for blocks in tables}) == 1, "groups' tables differ in length"
            for g, blocks in enumerate(tables):
                nulls = [b is self.null_block for b in blocks]
                assert nulls == sorted(nulls, reverse=True), (
                    f"group {g}: a null block after a block"
                )
                assert self.sliding_windows[g] is not None or not any(nulls), f"group {g} is full"
                for block in blocks:
                    if block is not self.null_block:
                        refs[block.block_id] += 1
        num_created = self.pool.num_created
        assert not any(refs[num_created:]), "a table holds a block the pool never handed out"
        queued = set()  # the queue after its never-used head (ids from num_created on)
        prev = None
        for block in self.pool.free_queue:
            assert block.prev_free is not None and (prev is None or block.prev_free is prev)
            assert block.block_id not in queued, f"{block} queued twice"
            assert block.block_id < num_created, f"{block} queued but never created"
            queued.add(block.block_id)
            prev = block
        num_free = len(queued) + self.pool.num_blocks - num_created
        assert num_free == self.pool.num_free_blocks, "free count out of sync"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but held by {refs[block.block_id]} tables"
            )
            assert (block.ref_cnt == 0) == (block.block_id in queued), f"{block} free xor used"
        for key, block in self.pool.cached.items():
            assert block.block_hash == key, f"{block} indexed under a stale hash"
            assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
                f"{block} indexed without its tokens"
            )
