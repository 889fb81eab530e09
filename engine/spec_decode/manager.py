"""SpecDecodeManager: after each step, drafts for the requests that go on.

It decides how many tokens each request may draft (adaptive: none for a while when its
drafts are mostly rejected; in a batch, at most BATCH_MAX_DRAFTS and fewer while its drafts
are rejected; none while the batch is large; never past `max_tokens`, the context, or into
a row the budget steering would look at near the end of a structured output's budget), asks
the proposer, and cuts each draft where the request's grammar refuses a token and after a
stop token. With jump-forward, the tokens the grammar forces join a draft, which goes on
after them.
The drafts wait in `Request.spec_token_ids` for the scheduler, which verifies them with the
request's next chunk; the counts of drafted and accepted tokens are kept here, per request
(`Request.spec_stats`, reported with its final output) and for the engine (`stats`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agentrt.engine.config import SpeculativeConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.records import EngineCoreOutput, SamplerStepOutput, SpecDecodeStats
from agentrt.engine.spec_decode.base import DraftContext, Proposer

# The prompt head that, with the schema, groups requests in the suffix cache: a chat's
# system prompt and tool list start a prompt (ChatML) and fit in its first tokens.
CACHE_KEY_PROMPT_TOKENS = 64
# Adaptive drafting: a request's acceptance is a moving average with this weight on the
# newest step; below `adaptive_min_acceptance` it pauses drafting for PAUSE_STEPS steps. Alone,
# a request drafts its full length until then where a step's cost hardly depends on its rows
# (dense bf16 on 2 cores: ~40 ms for one, ~1 ms per row more; a GPU): drafts tend to hold in
# full or fail at their first token (a copied value's start), so shortening them loses the
# runs that hold (benchmarks/spec_decode.py, single extraction, suffix: 126 vs 109 steps).
# Not where rows are costly (`costly_rows`: int4 on the CPU, ~2.7 ms a row on a ~12 ms step;
# always drafting 8 made free text with failing drafts slower, 30 vs 47 tokens/s).
ACCEPTANCE_WEIGHT = 0.3
PAUSE_STEPS = 16
# Adaptive drafting in a batch: drafts per request at most (benchmarks/spec_decode.py, batches
# of 8, suffix: extraction 1.19x / tool calls 1.34x over drafting off with 4, 1.06x / 1.09x
# with 8).
BATCH_MAX_DRAFTS = 4


@dataclass(slots=True)
class _Adaptive:
    acceptance: float = 1.0  # moving average of accepted / drafted
    paused_steps: int = 0


class SpecDecodeManager:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer | None,
        kv: KVCacheManager,
        max_model_len: int,
        *,
        steer_to_budget: bool = True,
        proposer_has_kv: bool = False,
        jump_forward: bool = False,
        costly_rows: bool = False,
    ) -> None:
        """`proposer`: None for the 'grammar' method (drafts are the grammar's forced
        tokens). `proposer_has_kv`: the proposer (the draft model) writes KV into the
        request's blocks for its draft positions; their slots are allocated here first.
        `jump_forward`: the scheduler appends the tokens a grammar forces unsampled, so
        they join a draft where it reaches them (accepted with the drafts before them, as
        jump-forward would append them). `costly_rows`: a row costs real time even in a
        step of one request (the CPU's GGML block kernels), so a request alone drafts fewer
        tokens while its drafts are rejected, as in a batch."""
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.steer_to_budget = steer_to_budget
        self.proposer_has_kv = proposer_has_kv
        self.jump_forward = jump_forward
        self.costly_rows = costly_rows
        self.stats = SpecDecodeStats()  # drafted and accepted tokens of all requests so far
        self._adaptive: dict[str, _Adaptive] = {}

    def update_from_output(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        sampled: SamplerStepOutput,
        outputs: list[EngineCoreOutput],
        num_running: int,
    ) -> list[EngineCoreOutput]:
        """Between steps: count and learn from this step's verifications, let finished
        requests go (their outputs get the request's counts), and draft for the ones that
        continue."""
        finished = {o.req_id: o.finish_reason for o in outputs if o.finished}
        for request, draft in zip(requests, drafts, strict=True):
            if draft and request.req_id in sampled.tokens:
                self.verified(request, len(draft), len(sampled.tokens[request.req_id]) - 1)
            if request.req_id in finished:
                self.request_finished(request, finished[request.req_id] in ("stop", "length"))
        self.propose(requests, num_running)
        by_id = {r.req_id: r for r in requests}
        return [
            dataclasses.replace(o, spec_decode=by_id[o.req_id].spec_stats) if o.finished else o
            for o in outputs
        ]

    def propose(self, requests: list[Request], num_running: int) -> None:
        """Set `spec_token_ids` of each running request in `requests` (those that sampled
        this step). Does not change any request's tokens or grammar state."""
        if self.config.disable_by_batch_size and num_running > self.config.disable_by_batch_size:
            return
        contexts, max_tokens, targets = [], [], []
        for request in requests:
            if request.status != RequestStatus.RUNNING:
                continue
            num = self._max_drafts(request, num_running)
            if num <= 0:
                continue
            if self.proposer is None:  # grammar drafts
                self._set_drafts(request, request.structured.matcher.forced_tokens(), num)
                continue
            if self.proposer_has_kv and not self._reserve(request, num):
                continue
            contexts.append(self._context(request))
            max_tokens.append(num)
            targets.append(request)
        if contexts:
            drafts = self.proposer.propose(contexts, max_tokens)
            for request, draft, num in zip(targets, drafts, max_tokens, strict=True):
                self._set_drafts(request, draft, num)

    def _max_drafts(self, request: Request, num_running: int) -> int:
        params = request.sampling_params
        if params.logprobs is not None:
            return 0  # logprobs are reported per sampled token; drafts would skip them
        if self.proposer is None and request.structured is None:
            return 0
        num = self.config.num_speculative_tokens
        if self.config.adaptive:
            state = self._adaptive.setdefault(request.req_id, _Adaptive())
            if state.paused_steps:
                state.paused_steps -= 1
                return 0
            if num_running > 1:  # in a batch every row costs compute
                num = min(num, BATCH_MAX_DRAFTS)
            if num_running > 1 or self.costly_rows:
                num = max(1, round(num * state.acceptance))
        # One more token follows the drafts: all of them must fit in max_tokens and the context.
        num = min(
            num,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if request.structured is not None and self.steer_to_budget and not params.ignore_eos:
            # Near the end of the budget the grammar may steer a row, and decides so one row
            # at a time (grammar/budget.py): drafts stop before any row it would look at.
            left = request.max_tokens - request.num_output_tokens
            num = min(num, request.structured.matcher.steering_free_tokens(left) - 1)
        return num

    def _reserve(self, request: Request, num_drafts: int) -> bool:
        """KV slots for the draft model's positions; False (no drafts) when the pool is
        short: drafting never preempts anyone."""
        # The draft model computes positions up to that of its next-to-last draft.
        num_slots = request.num_tokens + num_drafts - 1 - request.num_computed_tokens
        return self.kv.allocate_slots(request, 0, num_lookahead_tokens=num_slots) is not None

    def _context(self, request: Request, draft_ids: list[int] | None = None) -> DraftContext:
        structured = request.structured
        spec = structured.matcher.grammar.spec if structured is not None else None
        return DraftContext(
            req_id=request.req_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            cache_key=(spec, tuple(request.prompt_token_ids[:CACHE_KEY_PROMPT_TOKENS])),
            structured=structured is not None,
            block_ids=self.kv.block_ids(request.req_id),
            num_preemptions=request.num_preemptions,
            draft_ids=draft_ids or (),
        )

    def _set_drafts(self, request: Request, draft: list[int], max_tokens: int) -> None:
        """Keep the draft up to the first token the grammar refuses, and nothing after a
        stop token (EOS or a stop id: the output would end there). With jump-forward, the
        tokens the grammar forces after a draft token join the draft (flagged forced), and
        the proposer drafts again after them where its draft has nothing for what follows
        (not the draft model: its KV holds the positions of its own draft only)."""
        stops = request.eos_token_ids | set(request.sampling_params.stop_token_ids)

        def cut(tokens: list[int]) -> list[int]:
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            return list(tokens[:end])

        draft = cut(draft[:max_tokens])
        forced: list[bool] = []
        if request.structured is not None:
            matcher = request.structured.matcher
            if self.jump_forward:
                more = None
                if self.proposer is not None and not self.proposer_has_kv:

                    def more(drafted: list[int]) -> list[int]:
                        context = self._context(request, drafted)
                        return cut(self.proposer.propose([context], [max_tokens - len(drafted)])[0])

                draft, forced = matcher.draft_with_forced(draft, max_tokens, more)
            else:
                del draft[matcher.num_valid_prefix(draft) :]
        request.spec_token_ids, request.spec_forced = draft, forced

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """One verification step: counted, and adaptive drafting learns from it."""
        if not num_drafts:
            return
        request.spec_stats.add(num_drafts, num_accepted)
        self.stats.add(num_drafts, num_accepted)
        if not self.config.adaptive:
            return
        state = self._adaptive.setdefault(request.req_id, _Adaptive())
        rate = num_accepted / num_drafts
        state.acceptance += ACCEPTANCE_WEIGHT * (rate - state.acceptance)
        if state.acceptance < self.config.adaptive_min_acceptance:
            state.paused_steps = PAUSE_STEPS
            state.acceptance = 2 * self.config.adaptive_min_acceptance  # try again later

    def request_finished(self, request: Request, completed: bool) -> None:
        self._adaptive.pop(request.req_id, None)
        if self.proposer is not None:
            self.proposer.request_finished(self._context(request), completed)
