"""EngineCore: schedule -> run the model (and fill the grammar bitmask) -> sample -> advance
the grammars -> update the requests -> validate finished outputs -> draft -> KV transfers,
one step at a time. Each part is its own object; this one only calls them in order."""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from agentrt.engine.core.request import Request, RequestStatus
from agentrt.engine.core.scheduler import Scheduler, SchedulerStats
from agentrt.engine.core.structured_output import StructuredOutputManager
from agentrt.engine.kv_transfer import KVConnectorScheduler
from agentrt.engine.records import (
    EngineCoreOutput,
    EngineCoreRequest,
    GrammarBitmask,
    SampledToken,
    SamplerStepOutput,
    SchedulerOutput,
)
from agentrt.engine.spec_decode.manager import SpecDecodeManager
from agentrt.engine.spec_decode.rejection_sampler import rejection_sample
from agentrt.engine.worker.grammar_mask import apply_grammar_bitmask
from agentrt.engine.worker.sampler import Sampler, SamplerOutput
from agentrt.engine.worker.sampling_metadata import SamplingMetadata


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        vocab_size: int,
        structured: StructuredOutputManager,
        *,
        overlap_grammar: bool = False,
        spec: SpecDecodeManager | None = None,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        """`overlap_grammar`: fill the grammar bitmask on a worker thread while the model
        runs. Worth it when the model runs on a GPU (the CPU is otherwise idle while the GPU
        computes); on the CPU both would compete for the same cores.
        `spec`: speculative decoding (drafts proposed after each step, verified in the next).
        `kv_connector`: a KV connector's scheduler side (the scheduler's too); its worker side
        runs in the runner, on every rank."""
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler()
        self.vocab_size = vocab_size
        self.structured = structured
        self.spec = spec
        self.kv_connector = kv_connector
        self._grammar_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="agentrt-bitmask") if overlap_grammar else None
        )

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a validated request; with a grammar it first waits for compilation."""
        request = Request.from_core_request(core_request)
        if core_request.grammar is not None:
            self.structured.start(request, core_request.grammar)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._transfer_kv()  # holds sent since the last step give their room back first
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        requests = [self.scheduler.requests[i] for i in req_ids if i in self.scheduler.requests]
        aborted = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        if self.spec is not None:
            for request in requests:
                if request.req_id in aborted:
                    self.spec.request_finished(request, completed=False)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or loads of aborted requests still to end (their blocks)."""
        loading = self.kv_connector is not None and bool(self.kv_connector.loading)
        return self.scheduler.has_unfinished_requests() or loading

    @torch.inference_mode()
    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        errored = self.scheduler.take_errored()
        if scheduler_output.is_empty:
            self._transfer_kv(scheduler_output.kv_connector_metadata)
            if not errored and self.has_unfinished_requests():
                time.sleep(0.001)  # only grammars compiling or KV loading: let them run
            return errored
        sampled_chunks = [c for c in scheduler_output.chunks if c.sample]
        requests = [self.scheduler.requests[c.req_id] for c in sampled_chunks]
        drafts = [c.token_ids[len(c.token_ids) - c.num_draft_tokens :] for c in sampled_chunks]
        logits, grammar = self._execute(scheduler_output, requests, drafts)
        sampled = self._sample(requests, drafts, logits, grammar)
        accepted = self.structured.accept(requests, sampled, self.scheduler.max_model_len)
        outputs = self.scheduler.update_from_output(scheduler_output, accepted)
        outputs = self.structured.finish(requests, outputs)
        if self.spec is not None:
            num_running = len(self.scheduler.running)
            outputs = self.spec.update_from_output(requests, drafts, sampled, outputs, num_running)
        self._transfer_kv()
        return errored + outputs

    def _transfer_kv(self, metadata: object | None = None) -> None:
        """The KV connector between steps: its worker sides get `metadata` (the loads of a
        step with nothing to compute) or what is pending (holds of requests that just
        finished, before their outputs leave), and its scheduler side what they finished
        (loaded requests may run, sent blocks go back)."""
        if self.kv_connector is None:
            return
        if metadata is None:
            metadata = self.kv_connector.take_pending_meta()
        self.kv_connector.update_from_output(self.runner.transfer_kv(metadata))

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.spec is not None:
            stats = dataclasses.replace(
                stats,
                spec_decode_method=self.spec.config.method,
                spec_decode=dataclasses.replace(self.spec.stats),
            )
        if self.kv_connector is not None:
            # Blocks saved are counted where they are written: rank 0's worker side.
            num_saved = self.runner.connector.num_saved_blocks
            stats = dataclasses.replace(
                stats,
                kv_connector=self.kv_connector.config.connector,
                kv_transfer=dataclasses.replace(
                    self.kv_connector.stats, num_saved_blocks=num_saved
                ),
            )
        return stats

    def _execute(
        self, so: SchedulerOutput, requests: list[Request], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, GrammarBitmask | None]:
        """The logits of the sampled rows and their grammar bitmask. The bitmask depends only
        on tokens accepted in earlier steps, so it can be filled while the model runs: on the
        worker thread, nothing else touches the matchers until `result()` returns."""
        if self._grammar_thread is None or all(r.structured is None for r in requests):
            return self.runner.execute(so), self.structured.bitmask(requests, drafts)
        pending = self._grammar_thread.submit(self.structured.bitmask, requests, drafts)
        logits = self.runner.execute(so)  # on a GPU: returns once the kernels are queued
        return logits, pending.result()

    def _sample(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        logits: torch.Tensor,
        grammar: GrammarBitmask | None,
    ) -> SamplerStepOutput:
        """One token per request, or, for a request with drafts, its accepted drafts and one
        more (logits and bitmask then have 1 + len(draft) rows for it)."""
        if not requests:
            return SamplerStepOutput({})
        dead: frozenset[str] = frozenset()
        if grammar is not None:
            dead = grammar.dead_end_req_ids
            if len(grammar.rows):
                device = logits.device  # the bitmask is filled on the CPU
                apply_grammar_bitmask(
                    logits,
                    grammar.bitmask.to(device, non_blocking=True),
                    grammar.rows.to(device, non_blocking=True),
                )
        if any(drafts):
            tokens = self._sample_with_drafts(requests, drafts, logits)
        else:
            tokens = _to_tokens(requests, self.sampler(logits, self._metadata(requests, logits)))
        for req_id in dead:  # no token is allowed: these requests fail
            del tokens[req_id]
        return SamplerStepOutput(tokens, dead)

    def _metadata(
        self, requests: list[Request], logits: torch.Tensor, drafts: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """Sampling metadata with one row per logits row: with drafts, row j of a request
        is processed as if its first j drafts were already output (penalties count them,
        min_tokens blocks by them)."""
        if drafts is None:
            drafts = [[] for _ in requests]
        rows = [(r, d, j) for r, d in zip(requests, drafts, strict=True) for j in range(1 + len(d))]
        return SamplingMetadata.build(
            params=[r.sampling_params for r, _, _ in rows],
            prompt_token_ids=[r.prompt_token_ids for r, _, _ in rows],
            output_token_ids=[
                r.output_token_ids + d[:j] if j else r.output_token_ids for r, d, j in rows
            ],
            generators=[r.generator for r, _, _ in rows],
            blocked_token_ids=[r.blocked_token_ids(j) for r, _, j in rows],
            vocab_size=self.vocab_size,
            device=logits.device,
        )

    def _sample_with_drafts(
        self, requests: list[Request], drafts: list[list[int]], logits: torch.Tensor
    ) -> dict[str, list[SampledToken]]:
        """Requests without drafts sample their one row as usual (logprobs included); those
        with drafts go through rejection sampling."""
        starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        plain = [i for i, d in enumerate(drafts) if not d]
        drafting = [i for i, d in enumerate(drafts) if d]
        tokens: dict[str, list[SampledToken]] = {}
        if plain:
            batch = [requests[i] for i in plain]
            rows = logits[[starts[i] for i in plain]]  # (P, V)
            tokens.update(_to_tokens(batch, self.sampler(rows, self._metadata(batch, rows))))
        batch = [requests[i] for i in drafting]
        rows = logits[[r for i in drafting for r in range(starts[i], starts[i + 1])]]  # (D, V)
        tokens.update(self._verify(batch, [drafts[i] for i in drafting], rows))
        return tokens

    def _verify(
        self, requests: list[Request], drafts: list[list[int]], logits: torch.Tensor
    ) -> dict[str, list[SampledToken]]:
        """Rejection sampling: each request's accepted drafts and one more token. Requests
        that ask for logprobs never draft (SpecDecodeManager), so none is computed here."""
        probs, argmax = self.sampler.distributions(logits, self._metadata(requests, logits, drafts))
        emitted = rejection_sample(
            probs,
            argmax,
            drafts,
            greedy=[r.sampling_params.greedy for r in requests],
            draft_probs=[None] * len(requests),
            generators=[r.generator for r in requests],
            forced=[r.spec_forced for r in requests],
        )
        return {
            r.req_id: [SampledToken(t) for t in ids]
            for r, ids in zip(requests, emitted, strict=True)
        }


def _to_tokens(requests: list[Request], out: SamplerOutput) -> dict[str, SampledToken]:
    token_ids = out.sampled_token_ids.tolist()
    if out.logprobs is None:
        return {r.req_id: [SampledToken(t)] for r, t in zip(requests, token_ids, strict=True)}
    top_ids = out.logprobs.token_ids.tolist()
    top_logprobs = out.logprobs.logprobs.tolist()
    ranks = out.logprobs.ranks.tolist()
    tokens = {}
    for row, request in enumerate(requests):
        num = request.sampling_params.logprobs
        if num is None:
            tokens[request.req_id] = [SampledToken(token_ids[row])]
            continue
        top = dict(zip(top_ids[row][1 : 1 + num], top_logprobs[row][1 : 1 + num], strict=True))
        tokens[request.req_id] = [
            SampledToken(token_ids[row], top_logprobs[row][0], ranks[row], top)
        ]
    return tokens
