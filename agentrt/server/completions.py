"""`POST /v1/completions` (OpenAI's legacy text completions): one or more prompts (text or
token ids), n choices each, optional `echo` and logprobs, streamed or not."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from agentrt.engine.client.outputs import RequestDelta, RequestOutput
from agentrt.engine.errors import InvalidRequestError
from agentrt.server.errors import bad_request, from_exception
from agentrt.server.generation import Generation, respond
from agentrt.server.offload import check_text_length, off_loop
from agentrt.server.params import choice_params, vllm_structured
from agentrt.server.protocol import CompletionRequest
from agentrt.server.responses import completion_logprobs, kv_transfer, new_id, now, usage
from agentrt.server.state import ServerState

# Engine requests one HTTP request may start (prompts x n): 16 prompts x n=16 queued 256
# requests ahead of every other client (a 2-token completion waited past 60 s); 16 run
# beside others (theirs took at most 0.45 s on the embedded model).
MAX_CHOICES = 16
_PARAM_NAMES = {"prompt_token_ids": "prompt"}  # the engine's field -> the request's


async def create_completion(
    state: ServerState, request: CompletionRequest, raw: Request
) -> Response:
    state.check_model(request.model)
    if request.suffix:
        raise bad_request("suffix is not supported by this server.", param="suffix")
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        raise bad_request(
            f"best_of={request.best_of} is not supported: only best_of == n ({n}).",
            param="best_of",
        )
    if request.echo and request.logprobs is not None:
        raise bad_request(
            "echo with logprobs is not supported (prompt logprobs are not computed).",
            param="echo",
        )
    texts, prompts = await off_loop(state.prompt_limiter, _prompts, state, request.prompt)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices: at most "
            f"{MAX_CHOICES} per request; send more requests.",
            param="n",
        )
    structured = vllm_structured(request.structured_outputs) if request.structured_outputs else None
    params = choice_params(
        request,
        max_tokens=request.max_tokens if request.max_tokens is not None else 16,
        max_tokens_field="max_tokens",
        logprobs=request.logprobs,
        structured=structured,
        cache_salt=state.cache_salt(request.cache_salt, request.user, raw.headers),
    )
    generation = Generation(
        state.engine,
        state.metrics,
        [p for p in prompts for _ in range(n)],
        params * len(prompts),
        priority=state.priority(request.priority),
        param_names=_PARAM_NAMES,
    )
    view = _CompletionView(state.model_name, n, texts if request.echo else None, request.logprobs)
    return await respond(generation, view, request, raw.receive)


def _prompts(state: ServerState, prompt) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) of each prompt; the forms are a string, a list of strings, a list
    of token ids, or a list of such lists. Runs off the event loop (offload.py)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > MAX_CHOICES:
        raise bad_request(
            f"at most {MAX_CHOICES} prompts per request (prompts x n: {MAX_CHOICES}); send "
            "more requests.",
            param="prompt",
        )
    texts, token_ids = [], []
    processor, tokenizer = state.engine.processor, state.engine.tokenizer
    for item in items:
        try:
            if isinstance(item, str):
                check_text_length(item, state.max_model_len, state.max_token_chars)
            ids = processor.tokenize(item)
        except InvalidRequestError as exc:
            raise from_exception(exc, _PARAM_NAMES) from None
        token_ids.append(ids)
        texts.append(item if isinstance(item, str) else tokenizer.decode(ids))
    return texts, token_ids


class _CompletionView:
    def __init__(self, model: str, n: int, echo: list[str] | None, top_n: int | None) -> None:
        self.model = model
        self.n = n
        self.echo = echo
        self.top_n = top_n
        self.id = new_id("cmpl")
        self.created = now()

    def _prefix(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def completion(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            logprobs = None
            if self.top_n is not None:
                logprobs = completion_logprobs(completion.logprobs or [], self.top_n)
            choices.append(
                {
                    "index": index,
                    "text": self._prefix(index) + completion.text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                }
            )
        return self._body(choices, usage=usage(outputs, self.n), **kv_transfer(outputs))

    def _body(self, choices: list[dict[str, Any]], **extra) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    async def stream(
        self, generation: Generation, firsts: list[RequestDelta], emit, include_usage: bool
    ) -> None:
        extra = {"usage": None} if include_usage else {}
        pending = [self._prefix(index) for index in range(len(firsts))]  # echo, then nothing
        offsets = [len(text) for text in pending]

        async def on_delta(index: int, delta: RequestDelta) -> None:
            text, pending[index] = pending[index] + delta.text, ""
            logprobs = None
            if self.top_n is not None and delta.logprobs:
                logprobs = completion_logprobs(delta.logprobs, self.top_n, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            finish = delta.output.outputs[0].finish_reason if delta.output else None
            if text or logprobs or finish:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
                await emit(self._body([choice], **extra))

        outputs = await generation.stream_choices(firsts, emit, on_delta)
        if include_usage:
            await emit(self._body([], usage=usage(outputs, self.n)))
