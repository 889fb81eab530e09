"""What users get back: RequestOutput / CompletionOutput (vLLM's names and fields), and the
OutputProcessor that builds them from engine-core deltas: incremental detokenization, stop
strings (the engine is told to abort the request), logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from agentrt.engine.client.detokenizer import IncrementalDetokenizer
from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import EngineCoreOutput, SpecDecodeStats
from agentrt.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # One dict per generated token: the sampled token and the top-N alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # Structured outputs: problems with the finished text (empty = valid; None = no grammar).
    structured_errors: list[str] | None = None
    # Structured outputs: how many final tokens the grammar steered to close the output
    # before max_tokens. Nonzero means valid but cut short (e.g. a string or list ended early).
    num_steered_tokens: int = 0


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one request, as seen by the output processor."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    # Speculative decoding (set when it is on, once finished): tokens drafted and accepted.
    spec_decode: SpecDecodeStats | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None until finished, or for
        fewer than two tokens)."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when finish_reason is "error": the kind of failure and its message.
    error_code: ErrorCode | None = None
    error: str | None = None
    # Disaggregated prefill/decode: what a decode instance needs to fetch this request's KV
    # (set on a p2p producer's finished output when the request asked for it).
    kv_transfer_params: dict | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one engine step added to one request: the unit a stream delivers."""

    request_id: str
    text: str  # new text; never retracted (a possible stop-string prefix is held back)
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    num_cached_tokens: int
    output: RequestOutput | None = None  # the complete output, set once finished

    @property
    def finished(self) -> bool:
        return self.output is not None


@dataclass(slots=True)
class _RequestState:
    output: RequestOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(
        self, req_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        completion = CompletionOutput(index=0, text="", token_ids=[])
        if params.logprobs is not None:
            completion.logprobs = []
            completion.cumulative_logprob = 0.0
        output = RequestOutput(
            request_id=req_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=[completion],
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
        self.states[req_id] = _RequestState(output, params, detokenizer)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestDelta], list[str]]:
        """Apply one step's deltas. Returns what changed per request (finished requests carry
        their complete `RequestOutput`) and the ids the engine core must abort because a
        stop string ended them."""
        deltas: list[RequestDelta] = []
        to_abort: list[str] = []
        for core in core_outputs:
            state = self.states.get(core.req_id)
            if state is None:
                continue
            out = state.output
            completion = out.outputs[0]
            if out.metrics.first_token_time is None and core.new_token_ids:
                out.metrics.first_token_time = time.monotonic()
            num_before = len(state.detokenizer.token_ids)
            stop_str = state.detokenizer.append(core.new_token_ids)
            new_token_ids = state.detokenizer.token_ids[num_before:]  # cut after a stop string
            completion.token_ids.extend(new_token_ids)
            num_logprobs = len(completion.logprobs) if completion.logprobs is not None else 0
            if core.new_logprobs is not None and completion.logprobs is not None:
                self._add_logprobs(completion, core)
            finish_reason, stop_reason = core.finish_reason, core.stop_reason
            if stop_str is not None:
                finish_reason, stop_reason = "stop", stop_str
                if not core.finished:
                    to_abort.append(core.req_id)
            out.num_cached_tokens = core.num_cached_tokens
            # The final call releases held-back text (and a trailing partial character).
            text = state.detokenizer.get_delta(streaming=finish_reason is None)
            completion.text = state.detokenizer.output_text
            delta = RequestDelta(
                core.req_id,
                text,
                new_token_ids,
                completion.logprobs[num_logprobs:] if completion.logprobs is not None else None,
                core.num_cached_tokens,
            )
            if finish_reason is not None:
                completion.finish_reason = finish_reason
                completion.stop_reason = stop_reason
                completion.structured_errors = core.structured_errors
                completion.num_steered_tokens = core.num_steered_tokens
                out.error_code = core.error_code
                out.error = core.error
                out.finished = True
                out.metrics.finished_time = time.monotonic()
                out.metrics.num_output_tokens = len(completion.token_ids)
                out.metrics.spec_decode = core.spec_decode
                out.kv_transfer_params = core.kv_transfer_params
                delta.output = out
                del self.states[core.req_id]
            if delta.text or delta.token_ids or delta.finished:
                deltas.append(delta)
        return deltas, to_abort

    def abort(self, req_ids: list[str]) -> list[RequestDelta]:
        """Finish requests as aborted; returns a final delta for each one still tracked."""
        deltas = []
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is None:
                continue
            out = state.output
            out.outputs[0].finish_reason = "abort"
            out.finished = True
            out.metrics.finished_time = time.monotonic()
            out.metrics.num_output_tokens = len(out.outputs[0].token_ids)
            deltas.append(RequestDelta(req_id, "", [], None, out.num_cached_tokens, out))
        return deltas

    def _add_logprobs(self, completion: CompletionOutput, core: EngineCoreOutput) -> None:
        for sampled in core.new_logprobs:
            entry = {sampled.token_id: Logprob(sampled.logprob, sampled.rank)}
            for rank, (token_id, logprob) in enumerate((sampled.top_logprobs or {}).items(), 1):
                entry.setdefault(token_id, Logprob(logprob, rank))
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([token_id])
            completion.logprobs.append(entry)
            completion.cumulative_logprob += sampled.logprob
