"""EngineCore: schedule -> run the model (and fill the grammar bitmask) -> sample -> update,
one step at a time."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from agentrt.engine.records import (
    EngineCoreOutput,
    EngineCoreRequest,
    GrammarBitmask,
    SampledToken,
    SamplerStepOutput,
    SchedulerOutput,
)
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from agentrt.engine.scheduler import Scheduler
from agentrt.engine.structured_output import StructuredOutputManager
from agentrt.kernels import apply_token_bitmask


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        vocab_size: int,
        structured: StructuredOutputManager,
        *,
        overlap_grammar: bool = False,
    ) -> None:
        """`overlap_grammar`: fill the grammar bitmask on a worker thread while the model
        runs. Worth it when the model runs on a GPU (the CPU is otherwise idle while the GPU
        computes); on the CPU both would compete for the same cores."""
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler()
        self.vocab_size = vocab_size
        self.structured = structured
        self._grammar_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="agentrt-bitmask") if overlap_grammar else None
        )

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a validated request; with a grammar it first waits for compilation."""
        request = Request.from_core_request(core_request)
        if core_request.grammar is not None:
            self.structured.start(request, core_request.grammar)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @torch.inference_mode()
    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        errored = self.scheduler.take_errored()
        if scheduler_output.is_empty:
            if not errored and self.scheduler.has_unfinished_requests():
                time.sleep(0.001)  # only grammars compiling: let them run
            return errored
        requests = [self.scheduler.requests[c.req_id] for c in scheduler_output.chunks if c.sample]
        logits, grammar = self._execute(scheduler_output, requests)
        sampled = self._sample(requests, logits, grammar)
        return errored + self.scheduler.update_from_output(scheduler_output, sampled)

    def _execute(
        self, so: SchedulerOutput, requests: list[Request]
    ) -> tuple[torch.Tensor, GrammarBitmask | None]:
        """The logits of the sampled rows and their grammar bitmask. The bitmask depends only
        on tokens accepted in earlier steps, so it can be filled while the model runs: on the
        worker thread, nothing else touches the matchers until `result()` returns."""
        if self._grammar_thread is None or all(r.structured is None for r in requests):
            return self.runner.execute(so), self.structured.bitmask(requests)
        pending = self._grammar_thread.submit(self.structured.bitmask, requests)
        logits = self.runner.execute(so)  # on a GPU: returns once the kernels are queued
        return logits, pending.result()

    def _sample(
        self, requests: list[Request], logits: torch.Tensor, grammar: GrammarBitmask | None
    ) -> SamplerStepOutput:
        if not requests:
            return SamplerStepOutput({})
        dead: frozenset[str] = frozenset()
        if grammar is not None:
            dead = grammar.dead_end_req_ids
            if len(grammar.rows):
                device = logits.device  # the bitmask is filled on the CPU
                apply_token_bitmask(
                    logits,
                    grammar.bitmask.to(device, non_blocking=True),
                    grammar.rows.to(device, non_blocking=True),
                )
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            blocked_token_ids=[r.blocked_token_ids() for r in requests],
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        tokens = _to_tokens(requests, self.sampler(logits, metadata))
        for req_id in dead:  # no token is allowed: the scheduler fails these requests
            del tokens[req_id]
        return SamplerStepOutput(tokens, dead)


def _to_tokens(requests: list[Request], out: SamplerOutput) -> dict[str, SampledToken]:
    token_ids = out.sampled_token_ids.tolist()
    if out.logprobs is None:
        return {r.req_id: SampledToken(t) for r, t in zip(requests, token_ids, strict=True)}
    top_ids = out.logprobs.token_ids.tolist()
    top_logprobs = out.logprobs.logprobs.tolist()
    ranks = out.logprobs.ranks.tolist()
    tokens = {}
    for row, request in enumerate(requests):
        num = request.sampling_params.logprobs
        if num is None:
            tokens[request.req_id] = SampledToken(token_ids[row])
            continue
        top = dict(zip(top_ids[row][1 : 1 + num], top_logprobs[row][1 : 1 + num], strict=True))
        tokens[request.req_id] = SampledToken(token_ids[row], top_logprobs[row][0], ranks[row], top)
    return tokens
