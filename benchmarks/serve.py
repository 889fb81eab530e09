"""`agentrt serve` under load: concurrent HTTP clients with Poisson arrivals at several request
rates, mixed prompt and output lengths, a share of JSON-schema requests.

Starts a server on the embedded model (or targets `--url`), then for each rate sends
`--num-requests` streaming chat completions whose arrival times are a Poisson process. Output
lengths are fixed per request (`ignore_eos`) except for JSON-schema requests, which end when
the object is complete. Prints, per rate: request and output-token throughput, time to first
token and inter-token latency p50/p90/p99, end-to-end latency, failed requests (must be 0).
Last line: a JSON object with the figures.

    python benchmarks/serve.py                 # rates 0.5, 1, 2 req/s, 32 requests each
    python benchmarks/serve.py --quick         # a smoke run
    python benchmarks/serve.py --url http://127.0.0.1:8000 --rates 4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

FILLER = (
    "The quarterly report covers revenue, costs, hiring and the product roadmap. "
    "Each section lists the owner, the deadline and the open risks. "
)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT_SENTENCES = (1, 8, 24)  # about 30, 200 and 600 prompt tokens
OUTPUT_TOKENS = (16, 48, 96)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    kind: str
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def make_request(rng: random.Random, model: str, json_share: float, scale: float) -> dict:
    sentences = rng.choice(PROMPT_SENTENCES)
    max_tokens = max(4, int(rng.choice(OUTPUT_TOKENS) * scale))
    context = FILLER * max(1, int(sentences * scale))
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "seed": rng.randrange(2**31),
    }
    if rng.random() < json_share:
        body["messages"] = [
            {"role": "system", "content": context},
            {"role": "user", "content": "Invent the report's owner as JSON: name, age, city."},
        ]
        body["max_tokens"] = 96
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        }
        return body
    body["messages"] = [{"role": "user", "content": context + "Summarize the report."}]
    body["max_tokens"] = max_tokens
    body["ignore_eos"] = True
    return body


async def send(http: httpx.AsyncClient, body: dict) -> RequestResult:
    kind = "json" if "response_format" in body else "text"
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False, kind=kind)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                content = event["choices"][0]["delta"].get("content") if event["choices"] else None
                if content:
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.ttft is not None
    return result


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


async def run_rate(url: str, model: str, rate: float, args) -> dict:
    rng = random.Random(args.seed + int(rate * 1000))
    bodies = [
        make_request(rng, model, args.json_share, args.scale) for _ in range(args.num_requests)
    ]
    limits = httpx.Limits(max_connections=args.num_requests + 8)
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=limits, headers=args.headers
    ) as http:
        await send(http, {**bodies[0], "max_tokens": 2})  # warm-up (not counted)
        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(send(http, body)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    for r in failed[:3]:
        print(f"  failed: {r.error}", file=sys.stderr)
    tokens = sum(r.output_tokens for r in ok)
    return {
        "rate": rate,
        "requests": len(results),
        "failed": len(failed),
        "json_requests": sum(r.kind == "json" for r in results),
        "duration_s": round(duration, 2),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(tokens / duration, 2),
        "ttft_s": percentiles([r.ttft for r in ok]),
        "itl_s": percentiles([gap for r in ok for gap in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "agentrt",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    command += ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    if args.model:
        command += ["--model", args.model]
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "2"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("agentrt serve exited during startup")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise SystemExit("agentrt serve did not start in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an already running server (else start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="for the started server")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma-separated")
    parser.add_argument("--num-requests", type=int, default=32, help="per rate")
    parser.add_argument("--json-share", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 requests per rate, short ones")
    args = parser.parse_args()
    args.scale = 0.5 if args.quick else 1.0
    if args.quick:
        args.num_requests = 12
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args)
    try:
        model = httpx.get(url + "/v1/models", headers=args.headers).json()["data"][0]["id"]
        results = []
        for rate in (float(r) for r in args.rates.split(",")):
            result = asyncio.run(run_rate(url, model, rate, args))
            results.append(result)
            print(
                f"rate {rate:>5} req/s: {result['request_throughput']:.2f} req/s, "
                f"{result['output_tokens_per_s']:.1f} tok/s | TTFT p50/p90/p99 "
                f"{result['ttft_s']['p50']}/{result['ttft_s']['p90']}/{result['ttft_s']['p99']} s "
                f"| ITL p50/p90/p99 {result['itl_s']['p50']}/{result['itl_s']['p90']}/"
                f"{result['itl_s']['p99']} s | failed {result['failed']}/{result['requests']}"
            )
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    failed = sum(r["failed"] for r in results)
    print(json.dumps({"benchmark": "serve", "model": model, "failed": failed, "rates": results}))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
