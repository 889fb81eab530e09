"""Processor: user input -> a validated `Request`. Tokenizes, applies the chat template, and
checks every limit that depends on the model, so a bad request fails alone, before it
reaches the scheduler."""

from __future__ import annotations

from collections.abc import Sequence

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.kv_cache_manager import cdiv
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams

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
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(
                    "prompt is empty: pass at least one character.", field="prompt", value=prompt
                )
            return self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt]
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
    ) -> Request:
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt has no tokens.", field="prompt", value=prompt)
        num_prompt = len(token_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {num_prompt} tokens; the context length (max_model_len) is "
                f"{self.max_model_len}, and at least one token must be generated. "
                "Shorten the prompt.",
                field="prompt",
                value=num_prompt,
            )
        room = self.max_model_len - num_prompt
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} is past the context: the prompt has "
                f"{num_prompt} tokens and max_model_len is {self.max_model_len}, so at most "
                f"{room} tokens can be generated.",
                field="max_tokens",
                value=params.max_tokens,
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", tuple(params.logit_bias or ()))
        num_blocks = cdiv(num_prompt + max_tokens, self.block_size)
        if num_blocks > self.num_kv_blocks:
            raise InvalidRequestError(
                f"the request needs up to {num_prompt + max_tokens} tokens ({num_blocks} KV "
                f"blocks) but the KV cache holds {self.num_kv_blocks} blocks of "
                f"{self.block_size}; it could never be scheduled. Lower max_tokens or "
                "raise kv_cache_memory_gb.",
                field="max_tokens",
                value=max_tokens,
            )
        return Request(
            req_id,
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
        )

    def _check_token_ids(self, field: str, token_ids: tuple[int, ...]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{field} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size}).",
                field=field,
                value=bad[:5],
            )
