"""`agentrt serve` vs llama-server on one GGUF file, side by side in one run (issue 41).

Both servers run the same file with the same threads, and get the same requests over HTTP
(streamed OpenAI chat completions, greedy). Three workloads, each at every --concurrency
(that many requests in flight, a closed loop):

  extraction  extraction.py's labelled invoices and contact cards, system = its instruction,
              response_format json_schema (its Record): s/doc, valid outputs, and the share
              of fields equal to the values the generator put in each document
  chat        a user question after 30-130 tokens of notes, 128 output tokens (ignore_eos)
  agent       one ~900-token system prompt shared by every request (an agent's tools and
              rules), a short task, the next step as json_schema: the shared prefix is what a
              prefix cache computes once
  prefill     (at concurrency 1 only) a ~512-token prompt of its own, 1 output token: the
              request's end-to-end time is one prefill (issue 41's "prefill 512" target)

Reported per cell, each side: seconds a request (wall / requests: s/doc for extraction),
output tok/s, TTFT p50/p99, valid / fields, and the share of prompt tokens the server did not
compute (agentrt: usage.prompt_tokens_details.cached_tokens; llama-server: timings.cache_n).
Ratios are llama-server / agentrt for times, agentrt / llama-server for tok/s: above 1 means
agentrt is ahead. Each cell uses its own documents and questions (no server holds them from
an earlier cell, nor from its warm-up: an agent cell's system prompt is its own, so its first
wave is a cold burst on one prompt), the same on both sides; the side that runs first
alternates from cell to cell, and each side gets one warm-up request per cell. The CPU model,
the load average and the exact commands are printed; last line: JSON with every figure.

llama-server is started per concurrency with `-np C` (as a user sizes it: C slots of --ctx
tokens each), `--jinja`, `-t/-tb --threads`; agentrt serve once, with AGENTRT_NUM_THREADS. Idle,
neither uses the CPU (checked: each server's CPU time over a second while the other runs).

    .venv/bin/python benchmarks/serving_vs_llama.py                  # Qwen2.5-1.5B-shaped Q4_K_M
    .venv/bin/python benchmarks/serving_vs_llama.py --model embedded --workloads extraction
    .venv/bin/python benchmarks/serving_vs_llama.py --concurrency 8 --requests 16 --quick

The default file is gguf_models.py's (gguf.py makes it: see its docstring); its weights are
random, so only speed and validity mean something there: field accuracy needs real weights,
the embedded SmolLM2 (`--model embedded`). llama-server comes from llama-cpp-python's sdist
(vendor/llama.cpp, `cmake -B build -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=ON
-DLLAMA_CURL=OFF`, then `cmake --build build --target llama-server`; on an Intel CPU whose VM
does not grant AMX, add -DGGML_NATIVE=OFF with the AVX-512 flags on and -DGGML_AMX_*=OFF);
pass its build/bin/llama-server as --llama-server or $LLAMA_SERVER, or put it on PATH.

Requests per cell (default): 3 at concurrency 1, else max(8, C) (one full wave at least),
so that the whole table (3 workloads at 1, 4, 8 and 16, and the prefill probe) fits in about
20 minutes on the 1.5B-shaped file on 2 idle cores (an estimate from the issue's s/doc
figures; the run prints how long it took). At the end every target of the issue is printed
as met, missed or not measured, with the figures behind it (see `judge`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from extraction import INSTRUCTION, Record, fields_true, make_labeled_document, validate
from pydantic import BaseModel, Field

from agentrt.engine.loader.checkpoint import resolve_model
from agentrt.engine.loader.tokenizer import load_tokenizer

DEFAULT_FILE = Path.home() / ".cache/agentrt-bench/gguf/qwen2.5-1.5b-v2-s0-Q4_K_M.gguf"
# A llama-server built from the llama-cpp-python sdist (see the docstring): --llama-server,
# else $LLAMA_SERVER, else the one on PATH.
DEFAULT_LLAMA_SERVER = Path(
    os.environ.get("LLAMA_SERVER") or shutil.which("llama-server") or "llama-server"
)
WORKLOADS = ("extraction", "chat", "agent", "prefill")
PREFILL_TOKENS = 512  # the prefill probe's prompt, in tokens of the file's tokenizer
# The real-files issue's one-request extraction figure (a real Qwen2.5 1.5B-class Q4_K_M
# file, agentrt vs llama.cpp one request at a time): 2.05 vs 9.93 s/doc.
ONE_REQUEST_RATIO = 4.85
TIMEOUT_S = 1800


def requests_per_cell(concurrency: int) -> int:
    """The default: 3 one at a time, else max(8, C) (at least one full wave)."""
    return 3 if concurrency == 1 else max(8, concurrency)


# -- workloads -------------------------------------------------------------------------------


class Step(BaseModel):
    """An agent's next step."""

    thought: str = Field(max_length=160)
    tool: str = Field(pattern="^(search_orders|refund|send_email|escalate|answer)$")
    argument: str = Field(max_length=80)


AGENT_TOOLS = {
    "search_orders": "find a customer's orders by e-mail, order number or date range",
    "refund": "refund an order in full or in part; needs the order number and the amount",
    "send_email": "send the customer an e-mail; needs the address and the text",
    "escalate": "hand the case to a human supervisor with a one-line summary",
    "answer": "reply to the customer directly when no tool is needed",
}
AGENT_RULES = [
    "Refunds above 500 EUR need a supervisor: escalate them instead.",
    "Never promise a delivery date that the order system does not show.",
    "Look up the order before any refund, even when the customer quotes its number.",
    "Customers in the loyalty programme get free return shipping.",
    "Orders older than 90 days cannot be refunded; offer store credit instead.",
    "Answer in the customer's language when you can tell what it is.",
    "Do not share another customer's data, even with a colleague of theirs.",
    "A damaged item is refunded without a return once a photo is on file.",
    "Gift cards are never refunded in cash.",
    "Business customers are invoiced monthly; refunds go on the next invoice.",
    "When a customer is angry, acknowledge it in one sentence before anything else.",
    "Escalate any mention of legal action at once.",
]
AGENT_TASKS = [
    "Customer anna.meyer@northwind.com says order 55120 arrived broken and wants her money.",
    "Where is my parcel? I ordered a desk lamp two weeks ago, e-mail hugo.ito@suncrest.com.",
    "I want to return the office chair from order 80411, I am in the loyalty programme.",
    "Refund 1,200 EUR for order 71023, the consulting hours were never delivered.",
    "Can you send me a copy of my last invoice? It's kenji.berg@bluepeak.com.",
    "My lawyer will contact you about order 60234 if this is not fixed today.",
    "Do you ship toner cartridges to Osaka, and how long does it take?",
    "I paid twice for order 43390, please give one payment back.",
    "Please change the delivery address of order 99812 to 12 Mill Lane, Leeds.",
    "A gift card I bought for 50 EUR was never used: can I have the cash back?",
]
CHAT_TOPICS = [
    "the water cycle",
    "how a bicycle gear works",
    "why the sky is blue",
    "the history of the printing press",
    "how vaccines train the immune system",
    "what a compiler does",
    "how bees make honey",
    "the causes of the seasons",
    "how a refrigerator cools",
    "what inflation means for savings",
    "how plants turn light into sugar",
    "why bridges have expansion joints",
]


def agent_system_prompt(shop: int = 0) -> str:
    """The prompt every agent request of a cell shares (~900 tokens): tools, rules, examples.
    `shop` opens it, so that each cell's (and each warm-up's) differs from its first block
    on: a cell's first wave is a cold burst on one prompt on both sides (no server holds it
    from an earlier cell or from the warm-up)."""
    tools = "\n".join(f"- {name}: {what}" for name, what in AGENT_TOOLS.items())
    rules = "\n".join(f"{i + 1}. {rule}" for i, rule in enumerate(AGENT_RULES * 2))
    examples = "\n".join(
        f'Task: {task}\nStep: {{"thought": "...", "tool": "{tool}", "argument": "..."}}'
        for task, tool in zip(AGENT_TASKS, [*AGENT_TOOLS] * 2, strict=False)
    )
    return (
        f"Shop {shop}. You are the support agent of an office-supplies shop. At each turn you "
        "choose ONE next step: a tool and its argument, with a short thought that says why. "
        f"Reply with a JSON object and nothing else.\n\nTools:\n{tools}\n\nRules:\n{rules}\n\n"
        f"Examples:\n{examples}"
    )


@dataclass(slots=True)
class Workload:
    """The requests of one cell, and how to score their outputs."""

    name: str
    bodies: list[dict]
    truths: list[Record] | None = None  # extraction: what each document holds


def _schema_format(name: str, model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def make_workload(name: str, num: int, seed: int, tokenizer, args) -> Workload:
    """`num` requests of workload `name`; `seed` picks the documents and questions (one per
    cell: a server never saw them before)."""
    rng = random.Random(seed)
    if name == "extraction":
        docs = [make_labeled_document(rng, rng.randint(120, 400), tokenizer) for _ in range(num)]
        fmt = _schema_format("record", Record)
        bodies = [
            {
                "messages": [
                    {"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": text},
                ],
                "response_format": fmt,
                "max_tokens": args.extraction_tokens,
            }
            for text, _ in docs
        ]
        return Workload(name, bodies, [truth for _, truth in docs])
    if name == "chat":
        bodies = []
        for _ in range(num):
            # Notes in an order of their own: requests share no prefix beyond the template.
            notes = rng.sample(CHAT_TOPICS, rng.randint(3, len(CHAT_TOPICS)))
            context = "Notes: " + " ".join(
                f"Reader {rng.randint(10, 99)} asked about {topic}." for topic in notes
            )
            question = f"Explain {rng.choice(CHAT_TOPICS)} to a curious twelve-year-old."
            bodies.append(
                {
                    "messages": [{"role": "user", "content": f"{context}\n\n{question}"}],
                    "max_tokens": args.chat_tokens,
                    "ignore_eos": True,
                }
            )
        return Workload(name, bodies)
    if name == "prefill":
        bodies = []
        for _ in range(num):
            # Words in an order of their own from the first one: no server has any of it.
            words = [rng.choice(CHAT_TOPICS).split()[-1] for _ in range(PREFILL_TOKENS)]
            while len(tokenizer.encode(" ".join(words))) > PREFILL_TOKENS - 24:  # template
                del words[-8:]
            content = f"{rng.randint(10**5, 10**6)} " + " ".join(words)
            bodies.append({"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        return Workload(name, bodies)
    system = agent_system_prompt(shop=seed)
    fmt = _schema_format("step", Step)
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Ticket {rng.randint(1000, 9999)}: {task}"},
            ],
            "response_format": fmt,
            "max_tokens": args.agent_tokens,
        }
        for task in (rng.choice(AGENT_TASKS) for _ in range(num))
    ]
    return Workload(name, bodies)


# -- requests --------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    ok: bool = False
    text: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


async def send(http: httpx.AsyncClient, model: str, body: dict) -> Reply:
    """One streamed chat completion: its text, TTFT (first chunk with text), token counts
    (usage, else llama-server's timings)."""
    body = {
        **body,
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    reply = Reply()
    text: list[str] = []
    start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                reply.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    reply.error = str(event["error"])
                    return reply
                if usage := event.get("usage"):
                    reply.prompt_tokens = usage.get("prompt_tokens", 0)
                    reply.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    reply.cached_tokens = details.get("cached_tokens", reply.cached_tokens)
                if timings := event.get("timings"):  # llama-server
                    reply.cached_tokens = timings.get("cache_n", reply.cached_tokens)
                for choice in event.get("choices") or ():
                    if content := (choice.get("delta") or {}).get("content"):
                        if reply.ttft is None:
                            reply.ttft = time.perf_counter() - start
                        text.append(content)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        reply.error = repr(exc)
        return reply
    reply.e2e = time.perf_counter() - start
    reply.text = "".join(text)
    # (One output token may decode to no text: the prefill probe's is judged by its usage.)
    reply.ok = reply.ttft is not None or body.get("max_tokens") == reply.output_tokens == 1
    return reply


async def run_cell(url: str, workload: Workload, concurrency: int, warmup: dict) -> dict:
    """Every request of `workload`, `concurrency` in flight; the cell's figures."""
    # Idle connections are dropped after 2 s, before either server's keep-alive (5 s in
    # uvicorn and cpp-httplib) closes them: a request sent on a connection the server is
    # closing fails with RemoteProtocolError on either side, which is the client's race.
    limits = httpx.Limits(max_connections=concurrency + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        if (first := await send(http, model, warmup)).error:
            raise SystemExit(f"{url} failed the warm-up request: {first.error}")
        gate = asyncio.Semaphore(concurrency)

        async def one(body: dict) -> Reply:
            async with gate:
                return await send(http, model, body)

        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        replies = await asyncio.gather(*(one(b) for b in workload.bodies))
        wall = time.perf_counter() - start
    return score(workload, replies, wall, load_before)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def score(workload: Workload, replies: list[Reply], wall: float, load_before: float) -> dict:
    num = len(replies)
    ttfts = [r.ttft for r in replies if r.ttft is not None]
    prompt_tokens = sum(r.prompt_tokens for r in replies)
    figures = {
        "requests": num,
        "failed": sum(not r.ok for r in replies),
        "wall_s": round(wall, 2),
        "s_per_request": round(wall / num, 3),
        "output_tokens": sum(r.output_tokens for r in replies),
        "output_tok_s": round(sum(r.output_tokens for r in replies) / wall, 2),
        "ttft_p50": round(percentile(ttfts, 0.5) or 0, 3),
        "ttft_p99": round(percentile(ttfts, 0.99) or 0, 3),
        "e2e_p50": round(percentile([r.e2e for r in replies if r.ok], 0.5) or 0, 3),
        "prompt_tokens_mean": round(prompt_tokens / num, 1),
        "cached_share": round(sum(r.cached_tokens for r in replies) / max(prompt_tokens, 1), 3),
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    errors = [r.error for r in replies if r.error]
    if errors:
        figures["first_error"] = errors[0][:300]
    if workload.name == "extraction":
        records = [validate(r.text) if r.ok else None for r in replies]
        figures["valid"] = sum(r is not None for r in records)
        figures["fields_true"] = round(fields_true(records, workload.truths), 4)
    elif workload.name == "agent":
        figures["valid"] = sum(_valid_step(r.text) for r in replies if r.ok)
    return figures


def _valid_step(text: str) -> bool:
    try:
        Step.model_validate_json(text)
    except ValueError:
        return False
    return True


# -- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class Server:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    url: str = ""
    log: Path | None = None

    def start(self, log_dir: Path, startup_s: float = 600) -> None:
        port = free_port()
        command = [*self.command, "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{self.name}-{port}.log"
        print(f"$ {shlex.join(command)}  (log {self.log})", flush=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited at start-up: see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not answer /health in {startup_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def cpu_s(self) -> float:
        """The process's user + system CPU seconds so far."""
        fields_ = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_share(server: Server, seconds: float = 1.0) -> float:
    before = server.cpu_s()
    time.sleep(seconds)
    return (server.cpu_s() - before) / seconds


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    else:
        name = "unknown CPU"
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(f for f in wanted if f in flags)}"


# -- the run ---------------------------------------------------------------------------------


def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    if not ours or not theirs:
        return None
    return round(ours / theirs if higher_is_better else theirs / ours, 2)


def compare(ours: dict, theirs: dict) -> dict:
    return {
        "s_per_request": ratio(ours["s_per_request"], theirs["s_per_request"], False),
        "output_tok_s": ratio(ours["output_tok_s"], theirs["output_tok_s"], True),
        "ttft_p50": ratio(ours["ttft_p50"], theirs["ttft_p50"], False),
        "ttft_p99": ratio(ours["ttft_p99"], theirs["ttft_p99"], False),
        "e2e_p50": ratio(ours["e2e_p50"], theirs["e2e_p50"], False),
    }


def judge(results: dict) -> list[tuple[str, bool | None, str]]:
    """Issue 41's targets: (target, met (None: not measured in this run), the figures).
    Ratios are in agentrt's favour (compare). "Equal accuracy": at least llama-server's
    valid count, and field accuracy no more than one point below its."""

    def cell(name: str, concurrency: int) -> dict:
        return results.get(name, {}).get(concurrency, {})

    def verdict(label: str, got: float | None, target: float, extra: str = "", ok=True):
        if got is None:
            return (label, None, "not measured in this run")
        return (label, got >= target and ok, f"{got:.2f}x (target >= {target:g}x){extra}")

    verdicts = []
    extraction = cell("extraction", 8)
    ours, theirs = extraction.get("agentrt", {}), extraction.get("llama_server", {})
    same_accuracy = (
        ours.get("valid", 0) >= theirs.get("valid", 0)
        and ours.get("fields_true", 0) >= theirs.get("fields_true", 0) - 0.01
    )
    accuracy = (
        f"; valid {ours.get('valid')} vs {theirs.get('valid')} (llama-server),"
        f" fields {ours.get('fields_true', 0):.1%} vs {theirs.get('fields_true', 0):.1%}"
    )
    verdicts.append(
        verdict(
            "extraction c=8 s/doc, equal accuracy",
            extraction.get("ratio", {}).get("s_per_request"),
            3.0,
            accuracy,
            same_accuracy,
        )
    )
    chat = cell("chat", 16).get("ratio", {}).get("output_tok_s")
    verdicts.append(verdict("chat c=16 output tok/s", chat, 2.0))
    for name in ("extraction", "chat", "agent"):
        got = cell(name, 8).get("ratio", {}).get("ttft_p99")
        verdicts.append(verdict(f"{name} c=8 TTFT p99 <= llama-server's", got, 1.0))
    one = cell("extraction", 1).get("ratio", {}).get("s_per_request")
    verdicts.append(
        verdict(
            "one request: extraction c=1 s/doc, no regression",
            one,
            ONE_REQUEST_RATIO,
            " (the real-files issue's ratio, on a real file against llama.cpp one at a time;"
            " here llama-server -np 1 on this file: indicative)",
        )
    )
    prefill = cell("prefill", 1)
    tokens = prefill.get("agentrt", {}).get("prompt_tokens_mean")
    verdicts.append(
        verdict(
            f"prefill {PREFILL_TOKENS} on one request",
            prefill.get("ratio", {}).get("e2e_p50"),
            2.0,
            f" ({tokens} prompt tokens, 1 output token, median end-to-end)",
        )
    )
    return verdicts


def print_cell(workload: str, concurrency: int, cell: dict) -> None:
    ours, theirs, ratios = cell["agentrt"], cell.get("llama_server"), cell.get("ratio", {})

    def col(side: dict | None, key: str, fmt: str) -> str:
        value = None if side is None else side.get(key)
        return f"{value:{fmt}}" if value is not None else "-"

    def acc(side: dict | None) -> str:
        if side is None or "valid" not in side:
            return "-"
        fields = f" {side['fields_true']:.1%}" if "fields_true" in side else ""
        return f"{side['valid']}/{side['requests']}{fields}"

    print(
        f"{workload:10s} c={concurrency:<3d}"
        f" s/req {col(theirs, 's_per_request', '.2f')} vs {col(ours, 's_per_request', '.2f')}"
        f" ({col(ratios, 's_per_request', '.2f')}x)"
        f"  tok/s {col(theirs, 'output_tok_s', '.1f')} vs {col(ours, 'output_tok_s', '.1f')}"
        f" ({col(ratios, 'output_tok_s', '.2f')}x)"
        f"  TTFT p50 {col(theirs, 'ttft_p50', '.2f')} vs {col(ours, 'ttft_p50', '.2f')}"
        f" p99 {col(theirs, 'ttft_p99', '.2f')} vs {col(ours, 'ttft_p99', '.2f')}"
        f" ({col(ratios, 'ttft_p99', '.2f')}x)"
        f"  valid {acc(theirs)} vs {acc(ours)}"
        f"  cached {col(theirs, 'cached_share', '.0%')} vs {col(ours, 'cached_share', '.0%')}"
        f"  load {ours['load'][0]:.1f}",
        flush=True,
    )
    for name, side in (("llama-server", theirs), ("agentrt", ours)):
        if side and side.get("failed"):
            print(f"    {name}: {side['failed']} failed: {side.get('first_error')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_FILE), help="a GGUF file, or 'embedded'")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    parser.add_argument("--no-llama", action="store_true", help="agentrt alone")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--requests", type=int, default=None, help="per cell (default: 3 at c=1, else max(8, C))"
    )
    parser.add_argument("--ctx", type=int, default=2048, help="llama-server tokens per slot")
    parser.add_argument("--extraction-tokens", type=int, default=256)
    parser.add_argument("--chat-tokens", type=int, default=128)
    parser.add_argument("--agent-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agentrt-args", default="", help="more `agentrt serve` flags")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}: choose from {WORKLOADS}")
    # A SIGTERM (timeout, Ctrl-C in a pool) unwinds like Ctrl-C: the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    path = resolve_model(None if args.model == "embedded" else args.model)
    if not path.exists():
        raise SystemExit(f"{path} is not made yet: benchmarks/gguf.py makes it (its docstring)")
    if not args.no_llama and not args.llama_server.exists():
        raise SystemExit(f"no llama-server at {args.llama_server}: build it (see the docstring)")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    tokenizer = load_tokenizer(path)
    started = time.monotonic()

    print(f"CPU: {cpu_model()}; load average {os.getloadavg()}", flush=True)
    print(f"file: {path} ({path.stat().st_size / 2**20:.0f} MiB), {args.threads} threads each")
    threads = str(args.threads)
    ours = Server(
        "agentrt",
        [sys.executable, "-m", "agentrt", "serve", "--model", str(path)]
        + shlex.split(args.agentrt_args),
        {"AGENTRT_NUM_THREADS": threads, "OMP_NUM_THREADS": threads},
    )
    ours.start(args.log_dir)
    results: dict = {}
    cell_index = 0
    try:
        for concurrency in concurrencies:
            theirs = None
            if not args.no_llama:
                theirs = Server(
                    "llama-server",
                    [str(args.llama_server), "-m", str(path), "-t", threads, "-tb", threads]
                    + ["-np", str(concurrency), "-c", str(concurrency * args.ctx), "--jinja"]
                    + ["--host", "127.0.0.1", "--no-webui"],
                )
                theirs.start(args.log_dir)
                idle = {s.name: idle_cpu_share(s) for s in (ours, theirs)}
                print(f"idle CPU share: {idle}", flush=True)
            num = args.requests or requests_per_cell(concurrency)
            for name in workloads:
                if name == "prefill" and concurrency != 1:
                    continue  # one request's prefill: measured at concurrency 1 only
                seed = args.seed * 1000 + 10 * concurrency + WORKLOADS.index(name)
                workload = make_workload(name, num, seed, tokenizer, args)
                warmup = make_workload(name, 1, seed + 500, tokenizer, args).bodies[0]
                sides = [ours] if theirs is None else [theirs, ours][:: 1 - 2 * (cell_index % 2)]
                cell_index += 1
                cell = {}
                for server in sides:
                    key = "agentrt" if server is ours else "llama_server"
                    cell[key] = asyncio.run(run_cell(server.url, workload, concurrency, warmup))
                if "llama_server" in cell:
                    cell["ratio"] = compare(cell["agentrt"], cell["llama_server"])
                results.setdefault(name, {})[concurrency] = cell
                print_cell(name, concurrency, cell)
            if theirs is not None:
                theirs.stop()
    finally:
        ours.stop()

    print(f"\nissue 41's targets (ran {(time.monotonic() - started) / 60:.1f} min):")
    verdicts = judge(results)
    for label, met, figures in verdicts:
        mark = "not measured" if met is None else ("met" if met else "MISSED")
        print(f"  {mark:12s} {label}: {figures}")
    ratios = [
        cell["ratio"]["s_per_request"]
        for cells in results.values()
        for cell in cells.values()
        if cell.get("ratio", {}).get("s_per_request")
    ]
    if ratios:
        print(f"median s/request ratio over the cells: {statistics.median(ratios):.2f}x")
    print(
        json.dumps(
            {
                "benchmark": "serving_vs_llama",
                "cpu": cpu_model(),
                "file": str(path),
                "threads": args.threads,
                "results": results,
                "targets": [{"target": t, "met": m, "figures": f} for t, m, f in verdicts],
            }
        )
    )


if __name__ == "__main__":
    main()
