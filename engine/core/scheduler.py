"""Scheduler: continuous batching with one token-budget loop (vLLM V1).

Every step gives each request enough tokens to move `num_computed_tokens` toward
`num_tokens`, within `max_num_batched_tokens` and `max_num_seqs`. There is no separate
prefill or decode phase: a new prompt is a request far behind, a decode is a request one
token behind, and a long prompt is prefilled in budget-sized chunks across steps.
When the KV pool runs dry, the lowest-priority (or latest) running request is preempted
by recompute: its blocks are freed and it goes back to the front of the waiting queue.

A new request whose next prompt block a running request is still to compute (a burst of
requests on one system prompt) waits for it instead of computing it too (SGLang's in-batch
prefix check): the prefix is computed once and the others find it in the cache.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from agentrt.engine.config import SchedulerConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.errors import ErrorCode
from agentrt.engine.kv_transfer import KVConnectorScheduler
from agentrt.engine.records import (
    EngineCoreOutput,
    SamplerStepOutput,
    ScheduledChunk,
    SchedulerOutput,
    SchedulerStats,
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        *,
        connector: KVConnectorScheduler | None = None,
    ):
        """Requests may carry drafts (`Request.spec_token_ids`, set by the engine's
        SpecDecodeManager), verified with the request's next chunk.
        `connector`: a KV connector's scheduler side (kv_transfer/), which may load a new
        request's prefix (the request waits in WAITING_FOR_REMOTE_KVS until the connector
        says it is loaded) and frees finished requests' blocks, or holds them to send."""
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        # Both queues are kept in scheduling order: arrival for "fcfs", (priority, arrival)
        # for "priority". The preemption victim is always the last running request.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.errored: list[EngineCoreOutput] = []
        self.connector = connector

    def _order_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    # -- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request. The caller has checked that it fits in the pool. A
        request the KV connector cannot take now (a p2p producer's holds at their cap) fails
        at once (take_errored: `ErrorCode.OVERLOADED`, or INVALID_REQUEST for one that can
        never be taken), without entering the queue."""
        refusal = self.connector.admit(request) if self.connector is not None else None
        if refusal is not None:
            request.status = RequestStatus.FINISHED_ERROR
            self.errored.append(_error_output(request, *refusal))
            return
        self.requests[request.req_id] = request
        self._insert_waiting(request)

    def _insert_waiting(self, request: Request) -> None:
        if self.config.policy == "priority" or request.status == RequestStatus.PREEMPTED:
            keys = [self._order_key(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._order_key(request)), request)
        else:
            self.waiting.append(request)

    def _insert_running(self, request: Request) -> None:
        keys = [self._order_key(r) for r in self.running]
        self.running.insert(bisect.bisect_right(keys, self._order_key(request)), request)

    def has_unfinished_requests(self) -> bool:
        """Requests queued (loading too) or running, or failed with an output not yet taken
        (an aborted request whose load has not ended is the connector's)."""
        return bool(self.waiting or self.running or self.errored)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[str]:
        """Finish (e.g. abort) requests in any state and free their blocks at once.
        Unknown or already finished ids are ignored. Returns the ids actually finished."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            request.status = status
            if loading:  # a connector writes into its blocks: it frees them once it ends
                del self.requests[req_id]
            else:
                self._free(request)
            finished.append(req_id)
        return finished

    def _free(self, request: Request) -> dict | None:
        """Forget a finished request and free its blocks (the KV connector may hold them
        until it has sent them). Returns the connector's `kv_transfer_params` for its
        output (a connector may also say why it holds nothing: a p2p hold refused)."""
        del self.requests[request.req_id]
        if self.connector is not None:
            return self.connector.request_finished(request)
        self.kv.free(request)
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.clear_drafts()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(request)

    # -- the step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        # Running requests first, in order; victims are taken from the end of the list,
        # which holds requests not yet scheduled this step (or the current one).
        # One request's prefill is capped only while others could run (shared: every
        # request alone gets the whole budget; a request waiting for the blocks a running
        # one computes could not run).
        shared = self._is_shared()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget, shared)
            num_drafts = self._num_drafts(request, num_new, budget)
            num_new += num_drafts
            while self.kv.allocate_slots(request, num_new) is None:
                if num_drafts:  # drafts are guesses: drop them before preempting anyone
                    num_new -= num_drafts
                    num_drafts = 0
                    request.clear_drafts()
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself: everything after it is gone too
            chunks.append(self._chunk(request, num_new, num_drafts))
            budget -= num_new
            index += 1

        # Then admit waiting requests in order, unless this step already had to preempt.
        # Requests whose grammar is still compiling are passed over, not waited for, and so
        # are those whose next block a running request computes in a step to come (this
        # step's blocks are indexed as they are scheduled: a hit already). Such a request
        # waits only while that one runs: it leaves `in_flight` once it has computed the
        # block, or is preempted, aborted or finished; running requests never wait.
        in_flight = self._in_flight_hashes() if self.waiting else set()
        position = 0
        while (
            not preempted
            and position < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[position]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                position += 1
                continue
            if not self._grammar_ready(request):
                if request.status != RequestStatus.FINISHED_ERROR:
                    position += 1  # (a failed one left the queue: same position again)
                continue
            if self.kv.has_blocks(request):  # its prefix came through the KV connector
                hits, num_cached = [], request.num_computed_tokens
            else:
                hits, num_cached = self.kv.get_computed_blocks(request)
                if self.kv.next_block_hash(request, num_cached) in in_flight:
                    position += 1
                    continue
                num_external = self._start_load(request, hits, num_cached)
                if num_external is None:
                    break  # no room for the blocks to load into
                if num_external:
                    position += 1
                    continue
            num_new = self._num_new_tokens(request, num_cached, budget, shared)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            del self.waiting[position]
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self._insert_running(request)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            in_flight.update(self.kv.in_flight_block_hashes(request))

        output = SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_req_ids=preempted,
        )
        if self.connector is None:
            return output
        meta = self.connector.build_connector_meta(output, self.requests)
        return dataclasses.replace(output, kv_connector_metadata=meta)

    def _in_flight_hashes(self) -> set:
        """The hashes of the blocks running requests compute in the steps to come."""
        return {h for r in self.running for h in self.kv.in_flight_block_hashes(r)}

    def _waits_for_blocks(self, request: Request, in_flight: set) -> bool:
        """Whether a waiting request's next block is one a running request computes."""
        if not in_flight or self.kv.has_blocks(request):
            return False
        _, num_cached = self.kv.get_computed_blocks(request)
        return self.kv.next_block_hash(request, num_cached) in in_flight

    def _is_shared(self) -> bool:
        """Whether this step has more than one request that can run (the running requests'
        in-flight blocks are gathered only when a waiting request could make it so)."""
        num_runnable = len(self.running)
        if num_runnable > 1 or not self.waiting:
            return num_runnable > 1
        in_flight = self._in_flight_hashes()
        for request in self.waiting:
            if num_runnable > 1:
                break
            if _ready(request) and not self._waits_for_blocks(request, in_flight):
                num_runnable += 1
        return num_runnable > 1

    def _start_load(self, request: Request, hits: list, num_cached: int) -> int | None:
        """Ask the KV connector for the tokens after the local hits; when it has some, give
        the request its blocks and park it until they are loaded. Returns the tokens it
        loads (0: none, go on), or None when the pool has no room for them now."""
        if self.connector is None:
            return 0
        num_external = self.connector.get_num_new_matched_tokens(request, num_cached)
        if not num_external:
            return 0
        if self.kv.allocate_slots(request, num_external, hits, cache_blocks=False) is None:
            return None
        request.num_computed_tokens = num_cached
        self.connector.update_state_after_alloc(
            request, self.kv.block_ids(request.req_id), num_external
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return num_external

    def _grammar_ready(self, request: Request) -> bool:
        if request.status != RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        if not request.structured.poll():
            return False
        if request.structured.error is not None:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            structured = request.structured
            self.errored.append(_error_output(request, structured.error_code, structured.error))
            return False
        request.status = RequestStatus.WAITING
        return True

    def take_errored(self) -> list[EngineCoreOutput]:
        """Requests that failed on their own since the last call (e.g. bad grammar)."""
        errored, self.errored = self.errored, []
        return errored

    def _num_new_tokens(
        self, request: Request, num_computed: int, budget: int, shared: bool
    ) -> int:
        """Tokens to compute this step: all that are behind, within the step budget and,
        when the step is `shared` with other requests, the per-request prefill cap
        (`long_prefill_token_threshold`: one long prompt cannot make every step as long as
        its prefill while others wait for their next token; alone it runs at full speed)."""
        num_new = min(request.num_tokens - num_computed, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold and shared:
            num_new = min(num_new, threshold)
        return num_new

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts to verify this step: those that fit in the
        budget, and only when the chunk reaches the end of its known tokens (the drafts
        follow the last one). Drafts left out are dropped (they are only guesses)."""
        if request.num_computed_tokens + num_new < request.num_tokens:
            request.clear_drafts()
            return 0
        num_drafts = min(len(request.spec_token_ids), budget - num_new)
        del request.spec_token_ids[num_drafts:]
        del request.spec_forced[num_drafts:]
        return num_drafts

    def _chunk(self, request: Request, num_new: int, num_drafts: int = 0) -> ScheduledChunk:
        start = request.num_computed_tokens
        num_known = num_new - num_drafts
        return ScheduledChunk(
            req_id=request.req_id,
            token_ids=request.all_token_ids[start : start + num_known] + request.spec_token_ids,
            start_pos=start,
            block_ids=self.kv.block_ids(request.req_id),
            group_block_ids=self.kv.group_block_ids(request.req_id),
            sample=start + num_known == request.num_tokens,
            num_draft_tokens=num_drafts,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: SamplerStepOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed counts, append each sampled request's tokens (accepted drafts,
        one more, then those its grammar forces: `StructuredOutputManager.accept` has cut
        them where the grammar refuses), apply stop conditions and free the blocks of
        finished requests. Returns one delta per request that sampled."""
        outputs = []
        for chunk in scheduler_output.chunks:
            request = self.requests.get(chunk.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            # Drafts count as computed only once accepted: the KV of rejected ones is junk
            # in slots the next step overwrites.
            request.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            request.clear_drafts()
            if not chunk.sample:
                continue
            tokens = sampled.tokens.get(chunk.req_id, [])
            forced = sampled.forced_token_ids.get(chunk.req_id, [])
            new_token_ids = self._append_tokens(request, [t.token_id for t in tokens], forced)
            if chunk.req_id in sampled.grammar_dead_end_req_ids:
                self.running.remove(request)
                request.status = RequestStatus.FINISHED_ERROR
                self._free(request)
                code, why = ErrorCode.STRUCTURED_OUTPUT_FAILED, "its grammar allows no next token"
                if not request.num_output_tokens:
                    # No first token at all: the client's constraint cannot be met with this
                    # model's vocabulary (a regex of a byte it has no token for), a 400.
                    code = ErrorCode.INVALID_SCHEMA
                    why = "its constraint allows no first token in this model's vocabulary"
                outputs.append(_error_output(request, code, why, new_token_ids))
                continue
            kv_transfer_params = None
            if request.status.finished:
                self.running.remove(request)
                kv_transfer_params = self._free(request)
            elif chunk.num_draft_tokens:
                self.kv.free_excess_blocks(request)  # rejected drafts' slots go back
            outputs.append(
                EngineCoreOutput(
                    req_id=request.req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=tokens if tokens and tokens[0].logprob is not None else None,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_transfer_params=kv_transfer_params,
                )
            )
        return outputs

    def _append_tokens(self, request: Request, sampled: list[int], forced: list[int]) -> list[int]:
        """Append one step's tokens until the request stops: the accepted drafts (whose KV
        this step computed), the sampled one, then the forced ones. Returns those appended."""
        num_drafts = len(sampled) - 1
        token_ids = sampled + forced
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if i < num_drafts:
                request.num_computed_tokens += 1
            if request.check_stop(self.max_model_len):
                return token_ids[: i + 1]
        return token_ids

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queried_tokens=self.kv.stats.num_queried_tokens,
            prefix_cache_hit_tokens=self.kv.stats.num_hit_tokens,
        )


def _ready(request: Request) -> bool:
    """Whether a waiting request could be admitted (not waiting for its grammar or KV)."""
    return request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _error_output(
    request: Request, code: ErrorCode, message: str, new_token_ids: list[int] | None = None
) -> EngineCoreOutput:
    """The final output of a request that failed on its own (after `new_token_ids`)."""
    return EngineCoreOutput(
        request.req_id, new_token_ids or [], None, "error", error_code=code, error=message
    )
