"""EngineCore: schedule -> run the model -> sample -> update, one step at a time."""

from __future__ import annotations

import time

import torch

from agentrt.engine.records import (
    EngineCoreOutput,
    SampledToken,
    SamplerStepOutput,
    SchedulerOutput,
)
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from agentrt.engine.scheduler import Scheduler
from agentrt.engine.structured_output import StructuredOutputManager
from agentrt.grammar import GrammarSpec
from agentrt.kernels import apply_token_bitmask


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        vocab_size: int,
        structured: StructuredOutputManager,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler()
        self.vocab_size = vocab_size
        self.structured = structured

    def add_request(self, request: Request, spec: GrammarSpec | None = None) -> None:
        """Queue a validated request; with a grammar spec it first waits for compilation."""
        if spec is not None:
            self.structured.start(request, spec)
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
        logits = self.runner.execute(scheduler_output)
        sampled = self._sample(scheduler_output, logits)
        return errored + self.scheduler.update_from_output(scheduler_output, sampled)

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor) -> SamplerStepOutput:
        requests = [self.scheduler.requests[c.req_id] for c in so.chunks if c.sample]
        if not requests:
            return SamplerStepOutput({})
        grammar = self.structured.bitmask(requests)
        dead: frozenset[str] = frozenset()
        if grammar is not None:
            dead = grammar.dead_end_req_ids
            if len(grammar.rows):
                apply_token_bitmask(logits, grammar.bitmask, grammar.rows)
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
