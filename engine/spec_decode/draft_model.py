"""DraftModelProposer: a smaller model of the same tokenizer drafts greedily.

The draft model runs in its own `ModelRunner` whose KV tensors have the target's block size
and block count, so they are indexed by the very block ids of the target's block tables: one
block allocation holds a position's KV for both models, and the engine sizes the pool with
the sum of both models' bytes per block (`resolve_draft_model` gives the draft's shapes,
in the engine config, before the pool exists).

Drafting is greedy (argmax), so the draft distribution q is one-hot and the rejection sampler
treats it exactly. One `propose` call, for requests of context length L and k drafts:

    pass 0:      the context tokens whose draft KV is missing, at their positions  -> d0
    pass j >= 1: d(j-1) at position L + j - 1                                    -> dj

every pass batching all requests still drafting as one varlen batch. The proposer tracks by
itself which draft KV is still valid: what it fed a request (context and own drafts) against
the request's tokens now; see `_num_valid`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from agentrt.engine.config import CacheConfig, ModelConfig, SpeculativeConfig
from agentrt.engine.errors import ConfigError
from agentrt.engine.loader.checkpoint import load_hf_config, resolve_model
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.spec_decode.base import DraftContext
from agentrt.engine.worker.model_runner import kv_block_bytes
from agentrt.engine.worker.worker import build_runner


def resolve_draft_model(config: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model of `config`, resolved once as the target is (part of the engine
    config): its checkpoint, config.json and architecture, read without its weights so the
    engine can size the KV pool before building the proposer; dense, in the target's dtype,
    device and context length. Raises `ConfigError` when the draft's vocabulary is not the
    target's, `ModelLoadError` when the model cannot be found."""
    assert config.model is not None, "SpeculativeConfig requires a model for draft_model"
    path = resolve_model(config.model)
    hf_config = load_hf_config(path)
    arch = ModelArchConfig.from_hf_dict(hf_config)
    if arch.vocab_size != target.arch.vocab_size:
        raise ConfigError(
            f"speculative_config.model={config.model!r} has vocab_size {arch.vocab_size}, but "
            f"the target model's is {target.arch.vocab_size}. A draft model must share the "
            "target's tokenizer: use a smaller model of the same family (same vocabulary)."
        )
    return dataclasses.replace(
        target, model=config.model, path=path, hf_config=hf_config, arch=arch, quantization="none"
    )


@dataclass(slots=True)
class DraftKVState:
    """What the draft model fed one request: its first `num_context` tokens, then
    `fed_drafts` (its own drafts) at the positions that follow. Their KV sits in the
    request's blocks until the request is preempted (`num_preemptions` then changes)."""

    num_preemptions: int
    num_context: int
    fed_drafts: list[int]


class DraftModelProposer:
    """Greedy drafts from a draft model with its own paged KV in the target's block pool.

    The pool (`cache`: block size and count) is the target's: the draft KV is indexed by the
    target's block tables. The context length is the engine's; the proposer keeps it below
    the draft's own `max_position_embeddings` and never drafts past it. Not thread-safe.
    """

    method = "draft_model"

    def __init__(self, draft: ModelConfig, cache: CacheConfig, device: torch.device) -> None:
        """`draft`: the engine config's resolved draft model; `cache`: the target's pool."""
        self.arch = draft.arch
        self.block_size = cache.block_size
        self.dtype = draft.dtype
        self.max_model_len = min(draft.max_model_len, self.arch.max_position_embeddings)
        # Loaded as the target is (its weight loader, `get_loader`), in the draft's own
        # context length and the target's pool.
        self.runner = build_runner(
            dataclasses.replace(draft, max_model_len=self.max_model_len), cache, device, None
        )
        self._states: dict[str, DraftKVState] = {}

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block of the pool costs in the draft model's KV (all its layers)."""
        return kv_block_bytes(self.arch, self.block_size, self.dtype)

    @torch.inference_mode()
    def propose(self, contexts: list[DraftContext], max_tokens: list[int]) -> list[list[int]]:
        """Up to `max_tokens[i]` greedy drafts after `contexts[i].token_ids`: fewer only where
        the draft's max_model_len leaves less room, none for `max_tokens[i] == 0`. Writes the
        draft KV of positions below `len(token_ids) + max_tokens[i] - 1` into the request's
        blocks (the engine allocated them), and nothing else."""
        drafts: list[list[int]] = [[] for _ in contexts]
        num_drafts = [self._num_drafts(c, m) for c, m in zip(contexts, max_tokens, strict=True)]
        active = [i for i, n in enumerate(num_drafts) if n > 0]
        if not active:
            return drafts
        block_tables = {i: list(contexts[i].block_ids) for i in active}
        for i in active:
            ctx = contexts[i]
            # The last fed position, len + n - 2, needs a slot (an engine invariant).
            needed = len(ctx.token_ids) + num_drafts[i] - 1
            assert len(block_tables[i]) * self.block_size >= needed, (
                f"{ctx.req_id}: {len(block_tables[i])} blocks hold no slot for position "
                f"{needed - 1}"
            )

        # Pass 0: catch up on the context. At least its last token is fed: its logits give d0.
        chunks = []
        for i in active:
            ctx = contexts[i]
            start = min(self._num_valid(ctx), len(ctx.token_ids) - 1)
            tokens = list(ctx.token_ids[start:])
            chunks.append(ScheduledChunk(ctx.req_id, tokens, start, block_tables[i], sample=True))
        for i, token in zip(active, self._greedy_step(chunks), strict=True):
            drafts[i].append(token)

        # Pass j: d(j-1) at position len + j - 1 gives dj; finished requests drop out.
        for j in range(1, max(num_drafts)):
            active = [i for i in active if num_drafts[i] > j]
            chunks = [
                ScheduledChunk(
                    contexts[i].req_id,
                    [drafts[i][-1]],
                    len(contexts[i].token_ids) + j - 1,
                    block_tables[i],
                    sample=True,
                )
                for i in active
            ]
            for i, token in zip(active, self._greedy_step(chunks), strict=True):
                drafts[i].append(token)

        for i in block_tables:
            ctx = contexts[i]
            # The last draft was sampled, never fed: its KV is not written.
            self._states[ctx.req_id] = DraftKVState(
                ctx.num_preemptions, len(ctx.token_ids), drafts[i][:-1]
            )
        return drafts

    def request_finished(self, context: DraftContext, completed: bool) -> None:
        """Forget the request (its blocks go back to the pool)."""
        self._states.pop(context.req_id, None)

    def _num_drafts(self, context: DraftContext, max_tokens: int) -> int:
        """Drafts for one request: at most `max_tokens`, and the context plus drafts stay
        within the draft's max_model_len (its rotary table ends there)."""
        if not context.token_ids:
            return 0
        return max(0, min(max_tokens, self.max_model_len - len(context.token_ids)))

    def _num_valid(self, context: DraftContext) -> int:
        """How many of the request's leading tokens have valid draft KV: the common prefix
        of what was fed and `token_ids` now. Accepted drafts stay valid; the first rejected
        one and all after it are not. A request's tokens only grow between preemptions, so
        the fed context (the first `num_context` tokens) is a prefix of them unless the
        request was preempted, which dropped its blocks; an unseen request has none (blocks
        from a prefix-cache hit may lack draft KV: recomputing rewrites the same values)."""
        state = self._states.get(context.req_id)
        tokens = context.token_ids
        if (
            state is None
            or state.num_preemptions != context.num_preemptions
            or len(tokens) < state.num_context
        ):
            return 0
        num_valid = state.num_context
        for token in state.fed_drafts:
            if num_valid >= len(tokens) or tokens[num_valid] != token:
                break
            num_valid += 1
        return num_valid

    def _greedy_step(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One forward pass of the draft model; the argmax token after each chunk."""
        num_tokens = sum(len(c.token_ids) for c in chunks)
        logits = self.runner.execute(SchedulerOutput(chunks, num_tokens))  # (len(chunks), V)
        return logits.argmax(dim=-1).tolist()
