"""Processor: user input -> a validated `EngineCoreRequest`. Tokenizes, applies the chat template, and
checks every limit that depends on the model, so a bad request fails alone, before it
reaches the scheduler."""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Iterable, Sequence

from agentrt.engine.config import EngineConfig, KVTransferConfig
from agentrt.engine.core.kv_cache_groups import kv_cache_layout, max_request_tokens
from agentrt.engine.errors import ContextLengthError, InvalidRequestError
from agentrt.engine.kv_transfer.auth import check_client_params
from agentrt.engine.records import EngineCoreRequest
from agentrt.engine.sampling_params import SamplingParams, to_grammar_spec

Prompt = str | Sequence[int]


class Processor:
    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_kv_blocks: int,
        eos_token_ids: frozenset[int],
        kv_transfer: KVTransferConfig | None = None,
        max_kv_tokens: int | None = None,
    ) -> None:
        """`kv_transfer`: the engine's KV connector config, which decides what
        `kv_transfer_params` a request may carry (kv_transfer/auth.py). `max_kv_tokens`:
        the tokens one request can hold in the pool (None: every block's; a model with
        sliding-window layers holds more, core/kv_cache_groups.py)."""
        self.kv_transfer = kv_transfer
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_kv_tokens = num_kv_blocks * block_size if max_kv_tokens is None else max_kv_tokens
        self.eos_token_ids = eos_token_ids

    @classmethod
    def for_engine(cls, config: EngineConfig, tokenizer) -> Processor:
        """The Processor of an engine's resolved config: its model's vocabulary, context
        length and end-of-sequence ids (the config's and the tokenizer's), its KV pool."""
        eos = set(config.model.arch.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(
            tokenizer,
            vocab_size=config.model.arch.vocab_size,
            max_model_len=config.model.max_model_len,
            block_size=config.cache.block_size,
            num_kv_blocks=config.cache.num_blocks,
            eos_token_ids=frozenset(eos),
            kv_transfer=config.kv_transfer,
            max_kv_tokens=max_request_tokens(
                kv_cache_layout(config.model.arch),
                config.cache.num_blocks,
                config.cache.block_size,
                config.scheduler.max_num_batched_tokens,
            ),
        )

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus output tokens one request may hold: the context length, or what the
        KV cache can hold if that is less (more could never be scheduled)."""
        return min(self.max_model_len, self.max_kv_tokens)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text -> token ids (with the tokenizer's special tokens); token ids are checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(
                    "prompt is empty: pass at least one character.", field="prompt", value=prompt
                )
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, bytes | dict) or not isinstance(prompt, Iterable):
            raise InvalidRequestError(
                f"prompt is a {type(prompt).__name__}: pass a string or a list of token ids.",
                field="prompt",
                value=type(prompt).__name__,
            )
        token_ids = [_token_id(t) for t in prompt]
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}).",
                field="prompt_token_ids",
                value=bad[:5],
            )
        return token_ids

    def chat_token_ids(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The conversation rendered with the model's chat template, as token ids (the
        template spells out its special tokens, so none are added). `tools` go to templates
        that render tool definitions."""
        if not messages:
            raise InvalidRequestError(
                "messages is empty: pass at least one message.", field="messages", value=messages
            )
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def process(
        self, req_id: str, prompt: Prompt, params: SamplingParams, *, priority: int = 0
    ) -> EngineCoreRequest:
        """The request as the engine core takes it; raises `InvalidRequestError` (or its
        `ContextLengthError`) naming the field for anything that can never run."""
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt has no tokens.", field="prompt", value=prompt)
        max_tokens = self._check_length(len(token_ids), params.max_tokens)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", tuple(params.logit_bias or ()))
        if params.kv_transfer_params is not None:
            check_client_params(params.kv_transfer_params, self.kv_transfer)
        constraint = params.structured_outputs
        return EngineCoreRequest(
            req_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=dataclasses.replace(params, structured_outputs=None),
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            grammar=to_grammar_spec(constraint) if constraint is not None else None,
            priority=priority,
            arrival_time=time.monotonic(),
        )

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> int:
        """The request's max_tokens (by default, all the room the prompt leaves); raises
        `ContextLengthError` when the prompt, or the prompt plus max_tokens, cannot fit."""
        limit = self.max_request_tokens
        limits = (
            f"max_model_len is {self.max_model_len} and the KV cache holds {self.num_kv_blocks} "
            f"blocks of {self.block_size} tokens"
        )
        fix = "raise kv_cache_memory_gb" if limit < self.max_model_len else "use a longer context"
        if num_prompt >= limit:
            raise ContextLengthError(
                f"prompt is {num_prompt} tokens; one request holds at most {limit} ({limits}), "
                "and at least one token must be generated. Shorten the prompt.",
                field="prompt",
                value=num_prompt,
            )
        room = limit - num_prompt
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthError(
                f"max_tokens={max_tokens} is past the context: the prompt has {num_prompt} "
                f"tokens and one request holds at most {limit} ({limits}), so at most {room} "
                f"tokens can be generated; more could never be scheduled. Lower max_tokens or "
                f"{fix}.",
                field="max_tokens",
                value=max_tokens,
            )
        return room if max_tokens is None else max_tokens

    def _check_token_ids(self, field: str, token_ids: tuple[int, ...]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{field} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size}).",
                field=field,
                value=bad[:5],
            )


def _token_id(token) -> int:
    """An integer token id (a Python or numpy integer); anything else is a typed error."""
    if isinstance(token, bool):
        raise InvalidRequestError(
            f"prompt holds {token!r}: a token-id prompt holds integers only.",
            field="prompt",
            value=token,
        )
    try:
        return operator.index(token)
    except TypeError:
        raise InvalidRequestError(
            f"prompt holds {token!r} ({type(token).__name__}): a token-id prompt holds "
            "integers only; pass text as one string.",
            field="prompt",
            value=repr(token)[:40],
        ) from None
