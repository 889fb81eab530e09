"""Typed records that cross component boundaries. The scheduler never touches tensors;
the model runner never mutates a `Request`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentrt.engine.errors import ErrorCode
from agentrt.engine.sampling_params import SamplingParams
from agentrt.grammar import GrammarSpec


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """A validated request as the engine core takes it (the Processor's output). Plain data,
    so a core in another process can receive it as one message: the output constraint
    travels in its canonical form, `grammar`, and `sampling_params.structured_outputs` (which
    may hold a Python type) is None."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: what the request may generate within the context
    eos_token_ids: frozenset[int]
    grammar: GrammarSpec | None
    priority: int
    arrival_time: float  # time.monotonic() when the front end accepted it


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a step: compute `token_ids` at positions
    `start_pos .. start_pos + len(token_ids) - 1`, whose KV goes into `block_ids`."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    # Speculative decoding: the last `num_draft_tokens` of `token_ids` are drafts to verify.
    # A sampling chunk then has 1 + num_draft_tokens logits rows (one per draft position and
    # one after the last draft); drafts are not part of the request's tokens until accepted.
    num_draft_tokens: int = 0
    # The block tables of the KV cache groups after the first (core/kv_cache_groups.py: a
    # model with sliding-window layers); empty when every layer is full attention.
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    # The KV connector's transfers for this step (its own record type), None without one.
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class ModelInput:
    """A flat varlen batch. Shapes: T = total tokens, R = requests, S = sampled rows."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # (R + 1,) int32, cumulative query lengths
    seq_lens: torch.Tensor  # (R,) int32: context length including this step's tokens
    block_tables: torch.Tensor  # (R, max_blocks) int32, padded with 0
    logits_indices: torch.Tensor  # (S,) int64: flat rows whose logits are sampled
    query_lens: list[int]  # host copies, used to pick the attention path
    context_lens: list[int]  # tokens already in the cache before this step, per request
    max_seq_len: int
    # The KV cache groups after the first (a model with sliding-window layers), as the two
    # above are group 0's: each one's slot mapping (T,) and block tables (R, max_blocks).
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    group_block_tables: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode requests of similar context length, attended to in one batched call."""

    token_index: torch.Tensor  # (B,) flat token row of each request's query
    block_tables: torch.Tensor  # (B, num_blocks) int64, trimmed to the group's longest
    mask: torch.Tensor  # (B, 1, 1, num_blocks * block_size) bool: position < seq_len


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by every layer: the model runner builds it, the
    attention backends (worker/attention.py) and the models read it. R = requests,
    T = tokens."""

    slot_mapping: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (R + 1,) int32
    seq_lens: torch.Tensor  # (R,) int32
    block_tables: torch.Tensor  # (R, max_blocks) int32
    max_seq_len: int
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    # Derived once per step: by the torch and cpu backends (key_cache_rows, for write_kv)...
    key_rows: torch.Tensor | None = None  # (T,) row of each new K in the flat cache view
    # ... by the torch backend (worker/attention.prepare_torch): host values, so no layer
    # reads the device...
    decode_groups: list[DecodeGroup] | None = None
    prefill_rows: list[int] | None = None
    query_starts: list[int] | None = None  # (R + 1,) query_start_loc on the host
    prefill_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # ... by sliding-window layers (windowed_attention), any backend: (row, window) -> its
    # (first key position, additive mask), reused by every layer of that window...
    window_masks: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(default_factory=dict)
    # ... and by the triton backend.
    max_query_len: int | None = None
    # The attention output, allocated by the first layer of the step and reused by the
    # others (output_like): a layer's output is consumed (o_proj) before the next one runs.
    out: torch.Tensor | None = None

    def output_like(self, query: torch.Tensor) -> torch.Tensor:
        """This step's attention output buffer, shaped like `query` (T, H, D)."""
        out = self.out
        if out is None or out.shape != query.shape or out.dtype != query.dtype:
            out = self.out = torch.empty_like(query)
        return out

    def causal_mask(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask (Tq, L) of a prefill chunk after cached context: 0 where query
        i may see key j (j <= context + i), -inf elsewhere. Built once per step, reused by
        every layer (SDPA would otherwise convert a boolean mask in each call)."""
        if row not in self.prefill_masks:
            context, seq_len = self.context_lens[row], self.context_lens[row] + self.query_lens[row]
            device = self.seq_lens.device
            keys, queries = (
                torch.arange(seq_len, device=device),
                torch.arange(context, seq_len, device=device),
            )
            hidden = keys[None, :] > queries[:, None]
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
            mask.masked_fill_(hidden, float("-inf"))
            self.prefill_masks[row] = mask
        return self.prefill_masks[row]

    def key_cache_rows(self) -> torch.Tensor:
        """Each new K's row in the cache viewed as (NB * 2 * BS, KVH, D); its V is one
        block_size further."""
        blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        return blocks * 2 * self.block_size + self.slot_mapping.remainder(self.block_size)


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """The grammar's part of one step: what the sampler may pick for each sampled request.
    Rows follow the order of the step's sampled requests; S = sampled requests, V = vocab."""

    bitmask: torch.Tensor  # (S, ceil(V / 32)) int32: bit i % 32 of word i // 32 = token i
    rows: torch.Tensor  # (L,) int64: the rows to apply (constrained, with an allowed token)
    # Constrained requests whose grammar allows no token at all (their rows are not applied:
    # an all -inf row must not reach the sampler). Nothing may follow; these requests fail.
    dead_end_req_ids: frozenset[str]


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding counts, of one request or summed over an engine's requests."""

    num_drafts: int = 0  # verification steps that had drafts
    num_draft_tokens: int = 0  # tokens drafted (and verified)
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting step produced on average: accepted drafts plus the one the model
        adds after them (vLLM's "mean acceptance length"; 1.0 = drafting gained nothing)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


@dataclass(slots=True)
class KVTransferStats:
    """A KV connector's counts since the engine started."""

    num_loads: int = 0  # requests that loaded (part of) their prefix through the connector
    num_loaded_tokens: int = 0  # tokens whose KV came from it instead of a prefill
    # Requests that computed their prefill themselves because a transfer failed (a dead or
    # unreachable peer, a timeout, a corrupt or truncated block, another model's blocks).
    num_load_failures: int = 0
    num_saved_blocks: int = 0  # blocks written to storage, or sent to a peer
    num_holds_refused: int = 0  # p2p prefills not held: the producer held its share already


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's state and counts (`EngineCore.stats`): what `/metrics`, the SDK and
    the engine clients read."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks referenced by requests
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    # Speculative decoding (None when it is off; EngineCore.stats): its method, and the
    # drafted and accepted tokens of all requests so far.
    spec_decode_method: str | None = None
    spec_decode: SpecDecodeStats | None = None
    # KV transfer (None without a connector; EngineCore.stats): its name and counts.
    kv_connector: str | None = None
    kv_transfer: KVTransferStats | None = None


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token and, when requested, its logprob and the top alternatives."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(frozen=True, slots=True)
class SamplerStepOutput:
    """What sampling produced for the requests of one step whose chunk samples."""

    # req_id -> its tokens, for each request that continues: one sampled token, after the
    # drafts the model accepted when the request had drafts to verify.
    tokens: dict[str, list[SampledToken]]
    # Requests whose grammar allowed no token (`GrammarBitmask.dead_end_req_ids`: no entry
    # in `tokens`), or refused one after accepted drafts (`tokens` cut before it): they
    # finish with an error.
    grammar_dead_end_req_ids: frozenset[str] = frozenset()
    # Jump-forward: req_id -> the tokens its grammar forces after `tokens`, appended
    # unsampled (StructuredOutputManager.accept; the next chunk computes them).
    forced_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step produced for one request (a delta, not the full history)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Structured outputs: what the finished output violates (empty list = valid).
    structured_errors: list[str] | None = None
    # Structured outputs: tokens the grammar steered to close the output before max_tokens
    # (the content was cut short to stay valid; 0 = the model ended on its own).
    num_steered_tokens: int = 0
    # Why a request finished with "error": what kind of failure, and the message.
    error_code: ErrorCode | None = None
    error: str | None = None
    # Speculative decoding counts of the request, set when it finishes.
    spec_decode: SpecDecodeStats | None = None
    # KV transfer: what another instance needs to fetch this finished prefill (p2p producer).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
