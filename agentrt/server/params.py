"""From an API request to engine inputs: `SamplingParams` for each choice and the structured
output constraint (`response_format`, tools, or vLLM's `structured_outputs`).

Every problem is a 400 naming the request field (`APIError`, or a typed error whose `field`
the error handler reports); nothing here touches the engine thread, so a bad request fails
before it is queued. Limits that depend on the model (context length, KV cache, vocabulary)
are the engine Processor's to check, when the request is queued.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.errors import SchemaError
from agentrt.formats import resolve_format, tools_format
from agentrt.server.calls_or_answer import answer_possible, calls_or_answer
from agentrt.server.errors import bad_request, from_exception
from agentrt.server.protocol import (
    MAX_SEED,
    MIN_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputsRequest,
)
from agentrt.tool_calls import MAX_PARALLEL_TOOL_CALLS
from agentrt.turn import ChatConstraint

_SEED_SPAN = MAX_SEED - MIN_SEED + 1
_MAX_CACHED_SCHEMA_CHARS = 65536  # larger schemas are checked every time


def choice_params(
    request: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int | None,
    max_tokens_field: str,
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
    cache_salt: str | None = None,
) -> list[SamplingParams]:
    """One `SamplingParams` per choice (`n` engine requests). Choice i of a seeded request
    gets seed + i, so the choices differ and the response is reproducible. max_tokens=None
    leaves the engine to allow all the room the prompt leaves. `cache_salt`: the salt the
    server derived (ServerState.cache_salt), not the request's own field."""
    options: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "structured_outputs": structured,
        "cache_salt": cache_salt,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
    ):
        value = getattr(request, name)
        if value is not None:
            options[name] = value
    if request.stop is not None:
        options["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.stop_token_ids:
        options["stop_token_ids"] = request.stop_token_ids
    if request.logit_bias:
        options["logit_bias"] = _logit_bias(request.logit_bias)
    names = {"max_tokens": max_tokens_field}
    params = []
    for i in range(request.n or 1):
        seed = (
            None if request.seed is None else (request.seed + i - MIN_SEED) % _SEED_SPAN + MIN_SEED
        )
        # One prefill is sent or fetched per request, by its first choice: the others start
        # from the prefix it cached.
        kv = {"kv_transfer_params": request.kv_transfer_params} if i == 0 else {}
        try:
            params.append(SamplingParams(**options, **kv, seed=seed))
        except InvalidRequestError as exc:
            raise from_exception(exc, names) from None
    return params


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id: keys are token ids as strings.",
                param="logit_bias",
            ) from None
        out[token_id] = value
    return out


def vllm_structured(request: StructuredOutputsRequest) -> StructuredOutputsParams:
    given = request.model_dump(by_alias=True, exclude_none=True)
    if given.get("json_object") is False:
        del given["json_object"]
    return StructuredOutputsParams(**given)  # InvalidRequestError names the field


def chat_constraint(request: ChatCompletionRequest, tool_style: str = "json") -> ChatConstraint:
    """`tool_style` is the served model's tool-call format (`agentrt.tool_calls`)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    choice = request.tool_choice
    if not tools and choice is not None and choice not in ("none", "auto"):
        raise bad_request(
            f"tool_choice={_choice_text(choice)} needs tools: pass `tools`, or drop tool_choice.",
            param="tool_choice",
        )
    constraints = []
    fmt = None
    answer_too = False
    if tools and choice != "none":
        tool_choice = choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto"
        fmt = tools_format(
            tools,
            tool_choice,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            max_parallel_tool_calls=request.max_parallel_tool_calls or MAX_PARALLEL_TOOL_CALLS,
        )
        fmt = dataclasses.replace(fmt, tool_style=tool_style)
        # SchemaError names the field at fault: tools or tool_choice.
        constraints.append(("tools", fmt.structured_outputs()))
    if request.response_format is not None and request.response_format.type != "text":
        answer = _response_format(request)
        if fmt is None:
            constraints.append(("response_format", answer))
        else:  # the format shapes the answer, the tools the calls (OpenAI takes both)
            constraints[0] = ("tools", calls_or_answer(fmt, answer))
            answer_too = answer_possible(fmt)
    if request.structured_outputs is not None:
        constraints.append(("structured_outputs", vllm_structured(request.structured_outputs)))
    if len(constraints) > 1:
        names = [name for name, _ in constraints]
        raise bad_request(
            f"{' and '.join(names)} both constrain the reply: use one of them (tool_choice "
            "'none' turns tool calls off).",
            param=names[1],
        )
    structured = constraints[0][1] if constraints else None
    parallel = request.parallel_tool_calls is not False
    return ChatConstraint(structured, fmt, tools, answer_too, parallel)


def _response_format(request: ChatCompletionRequest) -> StructuredOutputsParams:
    """OpenAI's json_object (any JSON object) and json_schema; and llama.cpp's json_object
    with a `schema`, which is enforced as json_schema is."""
    response_format = request.response_format
    if response_format.type == "json_object":
        if response_format.schema_ is None:
            return StructuredOutputsParams(json_object=True)
        return _json_schema(response_format.schema_, "response_format.schema")
    if response_format.schema_ is not None:
        raise bad_request(
            "response_format type 'json_schema' takes its schema in `json_schema.schema`; "
            "a top-level `schema` goes with type 'json_object'.",
            param="response_format.schema",
        )
    spec = response_format.json_schema
    if spec is None:
        raise bad_request(
            "response_format type 'json_schema' needs a `json_schema` object with `name` and "
            "`schema`.",
            param="response_format.json_schema",
        )
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    return _json_schema(schema, "response_format.json_schema.schema")


def _json_schema(schema: dict[str, Any], param: str) -> StructuredOutputsParams:
    text = json.dumps(schema, sort_keys=True)
    check = _cached_schema_error if len(text) <= _MAX_CACHED_SCHEMA_CHARS else _schema_error
    error = check(text)  # the schema must itself be a valid JSON schema
    if error is not None:
        raise SchemaError(error, field=param)
    return StructuredOutputsParams(json=schema)


def _schema_error(text: str) -> str | None:
    """Why the JSON schema `text` is not a valid JSON schema, or None."""
    try:
        resolve_format(json.loads(text))
    except SchemaError as exc:
        return str(exc)
    return None


# The check against the meta-schema costs ~1 ms of CPU on the event loop, and many requests
# send the same schema (every line of a batch, an extraction client's requests): it is made
# once per schema text (at most 64 x 64 KiB of them held).
_cached_schema_error = functools.lru_cache(maxsize=64)(_schema_error)


def _choice_text(choice: Any) -> str:
    if hasattr(choice, "function"):
        return f"{{'function': {{'name': {choice.function.name!r}}}}}"
    return repr(choice)
