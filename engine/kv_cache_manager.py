"""KVCacheManager: which blocks each request holds, and allocation for the next step."""

from __future__ import annotations

from agentrt.engine.block_pool import BlockPool, KVCacheBlock
from agentrt.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to block tables. Does not touch tensors: the model runner writes KV
    into the blocks whose ids the scheduler passes it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def max_tokens_in_pool(self) -> int:
        return self.pool.num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more computed tokens of `request`.

        Returns the newly allocated blocks (possibly empty), or None when the pool has too
        few free blocks; then nothing changes and the caller decides whether to preempt.
        """
        blocks = self.req_to_blocks.get(request.req_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[request.req_id] = blocks + new_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of `request` (tail first). A no-op for unknown requests."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def usage(self) -> float:
        return self.pool.usage()

    def check_invariants(self) -> None:
        """Every block is free xor referenced; ref counts equal the number of block tables
        holding the block; the free queue is a consistent list. Raises AssertionError."""
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
