"""EngineCore: schedule -> run the model -> sample -> update, one step at a time."""

from __future__ import annotations

import torch

from agentrt.engine.records import EngineCoreOutput, SampledToken, SchedulerOutput
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from agentrt.engine.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler()
        self.vocab_size = vocab_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @torch.inference_mode()
    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        logits = self.runner.execute(scheduler_output)
        sampled = self._sample(scheduler_output, logits)
        return self.scheduler.update_from_output(scheduler_output, sampled)

    def _sample(self, so: SchedulerOutput, logits: torch.Tensor) -> dict[str, SampledToken]:
        requests = [self.scheduler.requests[c.req_id] for c in so.chunks if c.sample]
        if not requests:
            return {}
        metadata = SamplingMetadata.build(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[r.generator for r in requests],
            blocked_token_ids=[r.blocked_token_ids() for r in requests],
            vocab_size=self.vocab_size,
            device=logits.device,
        )
        return _to_tokens(requests, self.sampler(logits, metadata))


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
