"""`serve` mode: the workload as streaming OpenAI requests to a running server, with httpx.

Plain prompts go to /v1/completions, chat messages to /v1/chat/completions; a schema is sent
as `response_format` json_schema. TTFT is the time to the first chunk with text, ITL the gap
between text chunks, E2E the time to the end of the stream; token counts come from the
`usage` of the last chunk (`stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from agentrt.bench.datasets import BenchRequest, DatasetConfig, make_requests
from agentrt.bench.errors import BenchConfigError
from agentrt.bench.load import LoadConfig, drive
from agentrt.bench.results import BenchResult, RequestRecord, build_result, is_valid

TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A running OpenAI-compatible server (`agentrt serve`)."""

    base_url: str
    api_key: str | None = None
    model: str | None = None  # default: the first model the server lists


async def run_http(
    endpoint: Endpoint, dataset: DatasetConfig, load: LoadConfig, config: dict
) -> BenchResult:
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    requests = make_requests(dataset)
    limits = httpx.Limits(max_connections=(load.max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(
        base_url=endpoint.base_url.rstrip("/"), headers=headers, timeout=TIMEOUT_S, limits=limits
    ) as http:
        model = endpoint.model or await _first_model(http)
        config["endpoint"]["model"] = model
        records, duration = await drive(
            requests, load, lambda request: _send(http, model, request, load), dataset.seed
        )
    return build_result(
        "serve",
        config,
        records,
        duration,
        goodput_e2e_ms=load.goodput_e2e_ms,
        goodput_ttft_ms=load.goodput_ttft_ms,
    )


async def _first_model(http: httpx.AsyncClient) -> str:
    try:
        response = await http.get("/v1/models")
    except httpx.HTTPError as exc:
        raise BenchConfigError(
            f"cannot reach {http.base_url}: {exc!r}. Is `agentrt serve` running there?"
        ) from None
    if response.status_code != 200:
        raise BenchConfigError(
            f"GET {http.base_url}/v1/models answered {response.status_code}: "
            f"{response.text[:200]} (a wrong --api-key?)"
        )
    return response.json()["data"][0]["id"]


def _body(model: str, request: BenchRequest, load) -> tuple[str, dict]:
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "temperature": load.temperature,
    }
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": request.schema},
        }
    if request.messages is not None:
        return "/v1/chat/completions", {**body, "messages": request.messages}
    return "/v1/completions", {**body, "prompt": request.prompt}


async def _send(http: httpx.AsyncClient, model: str, request: BenchRequest, load) -> RequestRecord:
    path, body = _body(model, request, load)
    record = RequestRecord(valid=False if request.schema is not None else None)
    text: list[str] = []
    finish_reason = None
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))
                    return record
                if event.get("usage"):
                    record.prompt_tokens = event["usage"]["prompt_tokens"]
                    record.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    delta = choice.get("delta", {}).get("content") or choice.get("text")
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if delta:
                        now = time.perf_counter()
                        if record.ttft is None:
                            record.ttft = now - start
                        else:
                            record.itls.append(now - last)
                        last = now
                        text.append(delta)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = repr(exc)
        return record
    if finish_reason not in ("stop", "length"):
        record.error = f"finish_reason {finish_reason}"
        return record
    record.ok = True
    record.e2e = time.perf_counter() - start
    if request.schema is not None:
        record.valid = is_valid("".join(text), request.schema)
    return record
