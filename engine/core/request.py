"""Request: the scheduler's mutable view of one generation, and its status."""

from __future__ import annotations

import enum
import time

import torch

from agentrt.engine.core.block_hash import SaltedTokenIds
from agentrt.engine.records import EngineCoreRequest, SpecDecodeStats
from agentrt.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = enum.auto()  # its grammar is compiling; others go ahead
    WAITING_FOR_REMOTE_KVS = enum.auto()  # a KV connector loads its prefix; others go ahead
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or the context length
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed alone (e.g. its grammar did not compile)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Owned by the scheduler; other components read it through typed records only.

    Invariant: `num_computed_tokens <= num_tokens`; the KV cache holds exactly the first
    `num_computed_tokens` tokens of `all_token_ids`. The last sampled token is not yet
    computed, so a decoding request has `num_tokens - num_computed_tokens == 1`, or more
    when jump-forward appended the tokens its grammar forces after it.
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "max_tokens",
        "eos_token_ids",
        "priority",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_preemptions",
        "stop_reason",
        "generator",
        "num_cached_tokens",
        "structured",
        "spec_token_ids",
        "spec_forced",
        "spec_stats",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Carries the cache salt into every block hash of the request (core/block_hash.py).
        self.all_token_ids = SaltedTokenIds(prompt_token_ids, sampling_params.cache_salt)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.structured = None  # StructuredRequest when the output is grammar-constrained
        # Speculative decoding: drafts to verify in the next step (never part of the tokens
        # above until accepted), and this request's counts (SpecDecodeStats).
        self.spec_token_ids: list[int] = []
        # Per draft: True where it is a token the grammar forces after the ones before it
        # (with jump-forward on: accepted once every draft before it is, unsampled).
        self.spec_forced: list[bool] = []
        self.spec_stats = SpecDecodeStats()
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @classmethod
    def from_core_request(cls, core: EngineCoreRequest) -> Request:
        return cls(
            core.req_id,
            core.prompt_token_ids,
            core.sampling_params,
            max_tokens=core.max_tokens,
            eos_token_ids=core.eos_token_ids,
            priority=core.priority,
            arrival_time=core.arrival_time,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_forced = [], []

    def blocked_token_ids(self, num_ahead: int = 0) -> tuple[int, ...]:
        """Tokens the sampler must not pick now (or `num_ahead` tokens later, for a draft
        position): EOS and stop ids until `min_tokens`."""
        params = self.sampling_params
        if self.num_output_tokens + num_ahead >= params.min_tokens:
            return ()
        blocked = set(params.stop_token_ids)
        if not params.ignore_eos:
            blocked |= self.eos_token_ids
        return tuple(sorted(blocked))

    def check_stop(self, max_model_len: int) -> bool:
        """Update `status` after a token was appended; return True if the request finished."""
        stop = self._stop(self.output_token_ids[-1], self.num_output_tokens, max_model_len)
        if stop is None:
            return False
        self.status, self.stop_reason = stop
        return True

    def stop_index(self, token_ids: list[int], max_model_len: int) -> int | None:
        """The index of the first of `token_ids` that would finish the request were they
        appended in order (`check_stop`), or None. Changes nothing."""
        for i, token_id in enumerate(token_ids):
            if self._stop(token_id, self.num_output_tokens + i + 1, max_model_len) is not None:
                return i
        return None

    def _stop(
        self, token_id: int, num_output: int, max_model_len: int
    ) -> tuple[RequestStatus, int | None] | None:
        """The status and stop reason once `token_id` is output token number `num_output`."""
        params = self.sampling_params
        if num_output >= params.min_tokens:
            # A grammar allows EOS only once its output is complete, and nothing after it: a
            # constrained output ends there even under ignore_eos (else its next step would
            # have no allowed token, a dead end).
            ends = not params.ignore_eos or self.structured is not None
            if ends and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        num_tokens = self.num_prompt_tokens + num_output
        if num_output >= self.max_tokens or num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None
