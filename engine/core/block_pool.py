"""BlockPool: owns every KV-cache block, its ref count, the free-block queue and the
prefix-cache index.

The free queue is a doubly linked list threaded through the blocks themselves, so taking a
block out of the middle (a prefix-cache hit) is O(1). Its order is the eviction order:
the head is taken first. A freed block keeps its hash and stays findable until it is
taken for new data (lazy eviction).

A block is created when it is first handed out: the free queue starts as every id in order,
and the ids never handed out always form its head, in id order, ahead of every freed block
(a freed block joins the tail; only a block that held data can be hit, and so pulled out of
the middle). So the queue is `range(num_created, num_blocks)` followed by the linked list,
and taking the head creates the next block. A tiny model's default 2 GiB pool is 262,144
blocks: creating and linking them all cost ~0.3-0.7 s of CPU per engine.

An indexed block also keeps its parent's hash and its own token ids, so a lookup can check
that a hit holds the tokens asked for (KVCacheManager never serves one that does not).
"""

from __future__ import annotations

from collections.abc import Hashable


class KVCacheBlock:
    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "parent_hash",
        "token_ids",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and indexed: its hash, and what the hash names.
        self.block_hash: Hashable | None = None
        self.parent_hash: Hashable | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free


class BlockPool:
    """A block is free exactly when its ref count is 0; `blocks` holds the blocks created so
    far, ids 0 to `num_created - 1` (ids from `num_created` on are free and never used)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks: list[KVCacheBlock] = []
        self.free_queue = FreeBlockQueue([])  # the free queue after its never-used head
        self.cached: dict[Hashable, KVCacheBlock] = {}  # block hash -> the block holding it

    @property
    def num_created(self) -> int:
        return len(self.blocks)

    def free_block_ids(self) -> list[int]:
        """The free queue's block ids, head (taken first) to tail."""
        unused = range(self.num_created, self.num_blocks)
        return [*unused, *(block.block_id for block in self.free_queue)]

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_created + self.free_queue.num_free

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue. Raises if there are fewer:
        callers check `num_free_blocks` first."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            if self.num_created < self.num_blocks:  # the head: the next never-used id
                block = KVCacheBlock(self.num_created)
                self.blocks.append(block)
            else:
                block = self.free_queue.popleft()
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: Hashable,
        *,
        parent_hash: Hashable | None = None,
        token_ids: tuple[int, ...] | None = None,
    ) -> None:
        """Index a full block under its chained hash (first writer wins), with what the hash
        names: the parent block's hash and the block's token ids."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            block.parent_hash = parent_hash
            block.token_ids = token_ids
            self.cached[block_hash] = block

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = block.parent_hash = block.token_ids = None
        self.cached.clear()

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue's tail
        in the given order (so pass a request's blocks tail-first to evict those first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks
