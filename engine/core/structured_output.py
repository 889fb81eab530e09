"""Structured outputs in the engine: each request's grammar compiles off the engine thread
(the request waits in WAITING_FOR_GRAMMAR without blocking others), the batch bitmask is
filled on the CPU for the sampled rows, matchers advance with every accepted token (and,
with jump-forward, take the tokens the grammar forces next), and a finished output is
validated against everything the token grammar did not enforce."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import torch

from agentrt.engine.core.request import Request
from agentrt.engine.errors import ErrorCode
from agentrt.engine.records import EngineCoreOutput, GrammarBitmask, SamplerStepOutput
from agentrt.grammar import (
    GenerationBounds,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
)

DEFAULT_BOUNDS = GenerationBounds()


class StructuredRequest:
    """One request's grammar: a compile future, then a matcher (or the compile error)."""

    __slots__ = ("future", "matcher", "error")

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None

    def poll(self) -> bool:
        """True once compilation finished, successfully (`matcher`) or not (`error`)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result().matcher()
        except GrammarError as exc:  # the request fails with ErrorCode.INVALID_SCHEMA
            self.error = str(exc)
        return True


class StructuredOutputManager:
    """Owns the grammar compiler and every request's matcher.

    A constrained output ends valid rather than cut by max_tokens: `bounds` caps what a
    schema leaves unbounded (`GenerationBounds`, listed in each grammar's report as
    "bounded"; None generates each schema's exact language), and with `steer_to_budget`
    the last tokens of the budget are steered to close what is open (matcher.fill_bitmask
    with tokens_left; the matcher's `num_steered` counts the steered steps).
    With `jump_forward`, the tokens a grammar forces after a sampled one are appended
    without sampling them (not for requests that ask for logprobs).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float,
        bounds: GenerationBounds | None = DEFAULT_BOUNDS,
        steer_to_budget: bool = True,
        jump_forward: bool = False,
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._timeout_s = timeout_s
        self.bounds = bounds
        self.steer_to_budget = steer_to_budget
        self.jump_forward = jump_forward
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use: plain-text workloads never pay for tokenizer analysis."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self._tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids,
                timeout_s=self._timeout_s,
                bounds=self.bounds,
            )
        return self._compiler

    def start(self, request: Request, spec: GrammarSpec) -> None:
        request.structured = StructuredRequest(self.compiler.compile_async(spec))

    def bitmask(
        self, requests: list[Request], drafts: list[list[int]] | None = None
    ) -> GrammarBitmask | None:
        """The bitmask of one step's sampled rows, or None when no request is constrained.
        Request i has 1 + len(drafts[i]) consecutive rows (no drafts: one row): row j holds
        what may follow its tokens and its first j drafts (`fill_draft_bitmasks`: the
        matcher and its steering end where they started).

        A dead end happens when the token grammar accepted an output that the final check
        rejects (a keyword it does not enforce): nothing may follow, and the request must
        fail rather than sample an arbitrary token. Only a request's first row can be one;
        an empty later row (after a stop token drafted, say) is left unapplied: its token
        counts only if every draft before it is accepted, and the matcher checks it then.
        So are the rows after a draft the grammar refuses (drafts are cut before that)."""
        drafts = drafts or [[] for _ in requests]
        if all(r.structured is None for r in requests):
            return None
        mask = allocate_bitmask(sum(1 + len(d) for d in drafts), self.vocab_size)
        live, dead = [], set()
        row = 0
        for request, draft in zip(requests, drafts, strict=True):
            if request.structured is None:
                row += 1 + len(draft)
                continue
            left = _tokens_left(request) if self.steer_to_budget else None
            matcher = request.structured.matcher
            num_rows = matcher.fill_draft_bitmasks(mask, row, draft, tokens_left=left)
            if not mask[row].any():
                dead.add(request.req_id)
            live.extend(r for r in range(row, row + num_rows) if mask[r].any())
            row += 1 + len(draft)
        return GrammarBitmask(
            torch.from_numpy(mask), torch.tensor(live, dtype=torch.int64), frozenset(dead)
        )

    def accept(
        self, requests: list[Request], sampled: SamplerStepOutput, max_model_len: int
    ) -> SamplerStepOutput:
        """Advance each constrained request's matcher by its sampled tokens (accepted drafts,
        then one more), up to the one that finishes the request; then, with jump-forward,
        by the tokens its grammar forces next (`forced_token_ids`, up to where the request
        would finish). A token the grammar refuses (only possible after an accepted draft,
        whose row was not masked) cuts the tokens before it and makes the request a dead
        end. Returns what the scheduler appends; unconstrained requests pass unchanged."""
        if all(r.structured is None for r in requests):
            return sampled
        tokens = dict(sampled.tokens)
        dead = set(sampled.grammar_dead_end_req_ids)
        forced: dict[str, list[int]] = {}
        for request in requests:
            if request.structured is None or request.req_id not in tokens:
                continue
            matcher = request.structured.matcher
            token_ids = [t.token_id for t in tokens[request.req_id]]
            stop = request.stop_index(token_ids, max_model_len)
            if stop is not None:
                del token_ids[stop + 1 :]
            num_accepted = _accept(matcher, token_ids)
            tokens[request.req_id] = tokens[request.req_id][:num_accepted]
            if num_accepted < len(token_ids):
                dead.add(request.req_id)
            elif stop is None and self._jumps_forward(request):
                more = matcher.forced_tokens()
                stop = request.stop_index(token_ids + more, max_model_len)
                if stop is not None:
                    del more[stop + 1 - len(token_ids) :]
                forced[request.req_id] = more[: _accept(matcher, more)]
        return SamplerStepOutput(tokens, frozenset(dead), forced)

    def _jumps_forward(self, request: Request) -> bool:
        return self.jump_forward and request.sampling_params.logprobs is None

    def finish(
        self, requests: list[Request], outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """Outputs of finished constrained requests with the final check of what the token
        grammar did not enforce (`structured_errors`, empty when valid) and the tokens
        steered to close the output before max_tokens; a dead end's error says why the
        output cannot be completed."""
        constrained = {r.req_id: r.structured for r in requests if r.structured is not None}
        if not constrained:
            return outputs
        finished = []
        for output in outputs:
            structured = constrained.get(output.req_id)
            if structured is not None and output.finished:
                problems = structured.matcher.validate_final()
                output = dataclasses.replace(
                    output,
                    structured_errors=problems,
                    num_steered_tokens=structured.matcher.num_steered,
                )
                if output.error_code == ErrorCode.STRUCTURED_OUTPUT_FAILED:
                    why = "the output cannot be completed into a valid instance: "
                    output = dataclasses.replace(output, error=why + "; ".join(problems))
            finished.append(output)
        return finished


def _accept(matcher: GrammarMatcher, token_ids: list[int]) -> int:
    """Advance the matcher by the tokens until one is refused; returns how many it took."""
    for i, token_id in enumerate(token_ids):
        if not matcher.accept_token(token_id):
            return i
    return len(token_ids)


def _tokens_left(request: Request) -> int | None:
    """Tokens the output may still have, the stop token included; None when a stop token
    could not end it now (ignore_eos, or min_tokens not reached)."""
    params = request.sampling_params
    if params.ignore_eos or request.num_output_tokens < params.min_tokens:
        return None
    return request.max_tokens - request.num_output_tokens
