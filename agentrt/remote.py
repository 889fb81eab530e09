"""RemoteBackend: Session, Agent and extraction turns over HTTP, with the official `openai`
client, against `agentrt serve` or any OpenAI-compatible server.

Each turn is one streaming chat completion. Output formats travel the way OpenAI (and vLLM)
spell them: a JSON schema as `response_format` json_schema (strict), tools as `tools` /
`tool_choice` / `parallel_tool_calls`, a regex or a choice as vLLM's `structured_outputs`
extension. Returned tool calls are turned back into the text payload the local engine
produces (`[{"name": ..., "arguments": {...}}]`), so `OutputFormat.parse` and everything
above it work unchanged. The final check of a constrained output, which the server does
not send, runs here on the received text (`OutputFormat.final_errors`, the engine's own
validator), so Session sees the same `structured_errors` as with the local backend.

Reasoning travels as vLLM and `agentrt serve` spell it: `reasoning=True | False` as the chat
template's `enable_thinking` (`chat_template_kwargs`), `max_reasoning_tokens` and
`reasoning_parser` as `agentrt serve` takes them, and `reasoning_effort` as OpenAI's own
parameter; the reply's `reasoning_content` deltas (or
`reasoning`, vLLM's newer name) stream as `ReasoningText`, and the completion carries the
reasoning and its token count (`completion_tokens_details.reasoning_tokens`), as the local
backend's does. A reply that wrote text and then called tools keeps the text as
its `content` beside the calls.

HTTP errors come back through `agentrt.errors.ERROR_KINDS` read backwards: the error
object's `code` gives the exception class the local backend raises (by HTTP status when the
server sent no code of ours), and a code the engine ends requests with (a schema that does
not compile, an output that cannot be valid, a failure in the engine) comes back as a failed
`Completion` carrying it, as the local backend reports it.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import anyio

from agentrt.backend import Completion, Usage, check_sampling, reasoning_options
from agentrt.engine.errors import EngineDeadError, ErrorCode, InvalidRequestError
from agentrt.engine.records import SchedulerStats
from agentrt.errors import ERROR_KINDS, code_for_status, error_for
from agentrt.formats import OutputFormat
from agentrt.reasoning import ReasoningText

# SamplingParams options OpenAI itself has; the others go in `extra_body` (vLLM's names),
# and only when they differ from the default, so plain OpenAI endpoints accept the request.
_OPENAI_OPTIONS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
_EXTRA_DEFAULTS: dict[str, Any] = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "stop_token_ids": (),
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
}


def _openai():
    try:
        import openai
    except ImportError:
        raise ImportError(
            "Runtime(base_url=...) needs the openai client: pip install 'agentrt[server]'"
        ) from None
    return openai


class RemoteBackend:
    """`model=None` uses the first model the server lists (`GET /v1/models`)."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 2,
    ) -> None:
        openai = _openai()
        self.base_url = base_url.rstrip("/")
        self.model = model
        # A server without auth still needs some key for the client to start.
        self.client = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=api_key or "EMPTY",
            timeout=timeout_s,
            max_retries=max_retries,
        )

    async def aclose(self) -> None:
        await self.client.close()

    async def stream(
        self, messages: list[dict], fmt: OutputFormat, sampling: dict[str, Any]
    ) -> AsyncIterator[str | Completion]:
        openai = _openai()
        sampling, reasoning = reasoning_options(sampling)
        request = self.request(messages, fmt, check_sampling(sampling), reasoning)
        request["model"] = await self._model_name()
        try:
            stream = await self.client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            yield _failed("", Usage(), exc)
            return
        except openai.APIConnectionError as exc:
            raise EngineDeadError(f"cannot reach {self.base_url}: {exc}") from None
        text, thought, calls = "", None, {}
        finish_reason, usage = None, Usage()
        failed = None
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = _usage(chunk.usage)
                for choice in chunk.choices:
                    delta = choice.delta
                    piece = _reasoning_of(delta)
                    if piece:
                        thought = (thought or "") + piece
                        yield ReasoningText(piece)
                    if delta.content:
                        text += delta.content
                        yield delta.content
                    for call in delta.tool_calls or []:
                        _merge_call(calls, call)
                    if choice.finish_reason is not None:
                        finish_reason = choice.finish_reason
        except openai.APIError as exc:  # an error event in the stream
            failed = _failed(text, usage, exc)
        finally:  # closing the connection makes the server abort the request
            with anyio.CancelScope(shield=True):
                await stream.close()
        if failed is not None:
            yield failed
            return
        # The server sends calls apart: a tools reply without any is text, whatever it says.
        content, call_texts = text, [] if fmt.kind == "tools" else None
        if calls:
            text = _tool_payload(calls, fmt)
            call_texts = [json.dumps(item, ensure_ascii=False) for item in _call_items(calls)]
            yield text
        if finish_reason == "tool_calls":
            finish_reason = "stop"
        structured_errors = None
        if finish_reason in ("stop", "length"):
            structured_errors = fmt.final_errors(text)
        yield Completion(
            text,
            finish_reason,
            usage,
            structured_errors=structured_errors,
            reasoning=thought,
            content=content if fmt.kind == "tools" else None,
            calls=call_texts,
        )

    def request(
        self,
        messages: list[dict],
        fmt: OutputFormat,
        sampling: dict[str, Any],
        reasoning: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments of `chat.completions.create` for one turn (no model);
        `reasoning`: the reasoning options (`agentrt.backend.reasoning_options`)."""
        request: dict[str, Any] = {
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for name in _OPENAI_OPTIONS:
            if sampling.get(name) is not None:
                request[name] = sampling[name]
        if sampling.get("max_tokens") is not None:
            request["max_tokens"] = sampling["max_tokens"]
        if sampling.get("stop"):
            stop = sampling["stop"]
            request["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if sampling.get("logit_bias"):
            request["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
        extra = {
            name: list(value) if isinstance(value, tuple) else value
            for name, default in _EXTRA_DEFAULTS.items()
            if (value := sampling.get(name, default)) != default
        }
        if fmt.kind == "json":
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": _schema_name(fmt.name),
                    "schema": fmt.json_schema,
                    "strict": True,
                },
            }
        elif fmt.kind == "regex":
            extra["structured_outputs"] = {"regex": fmt.regex}
        elif fmt.kind == "choice":
            extra["structured_outputs"] = {"choice": list(fmt.choices)}
        elif fmt.kind == "tools":
            request["tools"] = list(fmt.tools)
            request["tool_choice"] = _tool_choice(fmt.tool_choice)
            if fmt.tool_choice != "none":
                request["parallel_tool_calls"] = fmt.parallel_tool_calls
        reasoning = reasoning or {}
        if reasoning.get("reasoning") in (True, False):
            extra["chat_template_kwargs"] = {"enable_thinking": reasoning["reasoning"]}
        for name in ("max_reasoning_tokens", "reasoning_parser"):
            if reasoning.get(name) is not None:
                extra[name] = reasoning[name]
        if reasoning.get("reasoning_effort") is not None:
            request["reasoning_effort"] = reasoning["reasoning_effort"]
        if extra:
            request["extra_body"] = extra
        return request

    async def _model_name(self) -> str:
        if self.model is None:
            openai = _openai()
            try:
                models = await self.client.models.list()
            except openai.APIStatusError as exc:
                raise _error(exc) from None
            except openai.APIConnectionError as exc:
                raise EngineDeadError(f"cannot reach {self.base_url}: {exc}") from None
            if not models.data:
                raise InvalidRequestError(f"{self.base_url} serves no models.", field="model")
            self.model = models.data[0].id
        return self.model

    async def stats(self) -> SchedulerStats:
        """The server's scheduler gauges and counters, read from its Prometheus `/metrics`
        (agentrt and vLLM servers). Counts add up over a metric's series (several engines
        or models); the KV-cache usage fraction is their mean."""
        import httpx  # the openai client's own HTTP library
        from prometheus_client.parser import text_string_to_metric_families

        root = re.sub(r"/v1$", "", self.base_url)
        headers = {"Authorization": f"Bearer {self.client.api_key}"}
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                response = await http.get(root + "/metrics", headers=headers)
        except httpx.HTTPError as exc:
            raise EngineDeadError(f"cannot reach {root}/metrics: {exc}") from None
        if response.status_code != 200:
            raise InvalidRequestError(
                f"{root}/metrics answered {response.status_code}: the server does not export "
                "Prometheus metrics.",
                field="base_url",
            )
        series: dict[str, list[float]] = {}  # sample name without its "agentrt:" prefix
        try:
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    series.setdefault(sample.name.split(":", 1)[-1], []).append(sample.value)
        except ValueError as exc:
            raise InvalidRequestError(
                f"{root}/metrics is not in the Prometheus text format: {exc}", field="base_url"
            ) from None

        def total(name: str) -> int:
            return int(sum(series.get(name, ())))

        usage = series.get("kv_cache_usage_perc") or [0.0]
        return SchedulerStats(
            num_running=total("num_requests_running"),
            num_waiting=total("num_requests_waiting"),
            kv_cache_usage=sum(usage) / len(usage),
            num_preemptions=total("num_preemptions_total"),
            prefix_cache_queried_tokens=total("prefix_cache_queries_total"),
            prefix_cache_hit_tokens=total("prefix_cache_hits_total"),
        )


def _tool_choice(choice: str | dict) -> str | dict:
    """OpenAI names a forced tool as an object; the SDK also takes the bare name."""
    if isinstance(choice, str) and choice not in ("auto", "required", "none"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def _schema_name(name: str) -> str:
    """OpenAI's json_schema names match ^[a-zA-Z0-9_-]{1,64}$."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name)[:64] or "output"


def _usage(usage) -> Usage:
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    completion_details = getattr(usage, "completion_tokens_details", None)
    reasoning = getattr(completion_details, "reasoning_tokens", None) or 0
    return Usage(usage.prompt_tokens, cached, usage.completion_tokens, reasoning)


def _reasoning_of(delta) -> str | None:
    """A streamed delta's reasoning text: `reasoning_content` (vLLM's and agentrt's name) or
    `reasoning` (vLLM's newer one); the openai client keeps such extra fields."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(delta, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def _merge_call(calls: dict[int, dict[str, str]], delta) -> None:
    """Accumulate a streamed tool-call delta (the first one of a call names it)."""
    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
    if delta.function is not None:
        call["name"] += delta.function.name or ""
        call["arguments"] += delta.function.arguments or ""


def _call_items(calls: dict[int, dict[str, str]]) -> list[dict[str, Any]]:
    """The received calls as `{"name": ..., "arguments": {...}}`, in order."""
    items = []
    for index in sorted(calls):
        call = calls[index]
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = call["arguments"]  # OutputFormat.parse reports it
        items.append({"name": call["name"], "arguments": arguments})
    return items


def _tool_payload(calls: dict[int, dict[str, str]], fmt: OutputFormat) -> str:
    """The local engine's tool-call text: one call object, or a list with parallel calls."""
    items = _call_items(calls)
    payload = items if fmt.allows_many_calls or len(items) > 1 else items[0]
    return json.dumps(payload, ensure_ascii=False)


def _error_body(exc) -> dict[str, Any]:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]
    return body if isinstance(body, dict) else {}


def _code(exc) -> ErrorCode:
    """The error's code: ours from the error object, else from the HTTP status (another
    server's code, e.g. "model_not_found", or none)."""
    try:
        return ErrorCode(_error_body(exc).get("code"))
    except ValueError:
        pass
    status = getattr(exc, "status_code", None)
    return code_for_status(status) if status is not None else ErrorCode.INTERNAL


def _error(exc) -> Exception:
    """The exception the local backend raises for the same failure."""
    error = _error_body(exc)
    message = str(error.get("message") or exc)
    return error_for(_code(exc), message, field=error.get("param"))


def _failed(text: str, usage: Usage, exc) -> Completion:
    """A failed turn as the local backend reports it: a code the engine ends requests with
    is a Completion with finish_reason "error"; any other error is raised."""
    code = _code(exc)
    if not ERROR_KINDS[code].finishes:
        raise _error(exc) from None
    message = str(_error_body(exc).get("message") or exc)
    return Completion(text, "error", usage, error=message, error_code=code)
