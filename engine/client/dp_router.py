"""DPRouter: which data-parallel replica (engine-core process) takes a new request.

Two signals, as in vLLM's `DPLBAsyncMPClient` plus a prefix-cache affinity:
- load: `4 * waiting + running`, from the queue lengths each core reports with every step's
  outputs, plus the requests sent to it since its last report (counted as waiting);
- affinity: the prefix cache's chained hashes (block_hash.py) of full KV blocks of every sequence a replica served (its
  prompts, and its finished sequences with their outputs) map to that replica. A session's
  next turn starts with the previous turn's prompt and reply, so its longest known prefix
  names the replica whose prefix cache holds the history.

A request goes to the replica holding its longest known prefix when that prefix is at least
half the prompt (a conversation going on, not just a shared system prompt) and the replica is
not much more loaded than the least loaded one; otherwise to the least loaded replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from agentrt.engine.core.block_hash import BlockHash, extend_block_hashes

_WAITING_WEIGHT = 4  # vLLM's: a waiting request costs four running ones
_MIN_AFFINITY_FRACTION = 0.5
_MAX_PREFIXES = 1 << 16  # block hashes remembered (least recently used ones are forgotten)


def much_more_loaded(load: int, min_load: int) -> bool:
    """Past this, a replica's cached prefix is not worth the wait (two requests waiting
    beyond twice the least load)."""
    return load > 2 * min_load + 2 * _WAITING_WEIGHT


class DPRouter:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.owners: dict[str, int] = {}  # req_id -> replica, while the request is unfinished
        self._num_owned = [0] * num_replicas
        self._reported = [(0, 0)] * num_replicas  # (waiting, running) at the last report
        self._unreported = [0] * num_replicas  # requests sent since the last report
        self._prefixes: OrderedDict[BlockHash, int] = OrderedDict()  # block hash -> replica
        self._next_tie = 0

    def load(self, replica: int) -> int:
        if self._num_owned[replica] == 0:  # whatever it last reported, it is idle
            return 0
        waiting, running = self._reported[replica]
        return _WAITING_WEIGHT * (waiting + self._unreported[replica]) + running

    def route(self, req_id: str, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a new request, recorded as its owner until `finished`."""
        loads = [self.load(r) for r in range(self.num_replicas)]
        min_load = min(loads)
        hashes = self._block_hashes(prompt_token_ids)
        holder, num_matched = self._longest_known_prefix(hashes)
        if (
            holder is not None
            and num_matched * self.block_size >= _MIN_AFFINITY_FRACTION * len(prompt_token_ids)
            and not much_more_loaded(loads[holder], min_load)
        ):
            replica = holder
        else:
            least = [r for r in range(self.num_replicas) if loads[r] == min_load]
            if holder in least:
                replica = holder
            else:  # rotate among equals, so simultaneous arrivals spread
                replica = least[self._next_tie % len(least)]
                self._next_tie += 1
        self.owners[req_id] = replica
        self._num_owned[replica] += 1
        self._unreported[replica] += 1
        self._remember(hashes, replica)
        return replica

    def report(self, replica: int, num_waiting: int, num_running: int) -> None:
        """A core's queue lengths after its latest step."""
        self._reported[replica] = (num_waiting, num_running)
        self._unreported[replica] = 0

    def finished(self, req_id: str, token_ids: Sequence[int] | None = None) -> None:
        """The request ended; `token_ids` (prompt + output) are now cached on its replica."""
        replica = self.owners.pop(req_id, None)
        if replica is None:
            return
        self._num_owned[replica] -= 1
        if token_ids is not None:
            self._remember(self._block_hashes(token_ids), replica)

    def _block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The prefix cache's chained hashes (block_hash.py) of the full blocks."""
        return extend_block_hashes([], token_ids, self.block_size)

    def _longest_known_prefix(self, hashes: list[BlockHash]) -> tuple[int | None, int]:
        """(replica, blocks) of the longest prefix some replica served; (None, 0) if none."""
        for num_blocks in range(len(hashes), 0, -1):
            replica = self._prefixes.get(hashes[num_blocks - 1])
            if replica is not None:
                return replica, num_blocks
        return None, 0

    def _remember(self, hashes: list[BlockHash], replica: int) -> None:
        for block_hash in hashes:
            self._prefixes[block_hash] = replica
            self._prefixes.move_to_end(block_hash)
        while len(self._prefixes) > _MAX_PREFIXES:
            self._prefixes.popitem(last=False)
