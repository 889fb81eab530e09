"""A mixed soak with 5% hostile requests (issue #42): no 5xx for anyone, and the well-behaved
requests' p99 latency stays within 2x of the same soak without the hostile ones.

The suite runs 200 requests each way; the issue's full soak is 2,000:
    AGENTRT_SOAK_REQUESTS=2000 .venv/bin/python -m pytest -s tests/security/test_soak.py
"""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.agentrt.server.helpers import API_KEY
from tests.security.test_hostile_requests import SELF_ANY_OF
from tests.security.victim import MODEL

NUM_REQUESTS = int(os.environ.get("AGENTRT_SOAK_REQUESTS", "200"))
CONCURRENCY = 4
HOSTILE_SHARE = 0.05

PROMPTS = ["The capital of France is", "List three fruits:", "2 + 2 =", "Say hello in Spanish."]


def well_behaved(rng: random.Random) -> tuple[str, dict]:
    kind = rng.randrange(3)
    if kind == 0:
        return "/v1/completions", {"prompt": rng.choice(PROMPTS), "max_tokens": 4}
    if kind == 1:
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": 4}
    choice = {"choice": ["yes", "no"]}
    return "/v1/completions", {"prompt": rng.choice(PROMPTS), "structured_outputs": choice}


def hostile(rng: random.Random) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "Write nested JSON arrays."}]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SELF_ANY_OF}}
    return rng.choice(
        [
            ("/v1/chat/completions", {"messages": messages, "response_format": schema,
                                      "max_tokens": 24}),
            ("/v1/completions", {"prompt": "x", "stop": ["y" * 100_000]}),
            ("/v1/chat/completions", {"messages": messages,
                                      "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
            ("/v1/completions", {"prompt": "x", "structured_outputs":
                                 {"regex": "(a|" * 2000 + "b" + ")" * 2000}}),
            ("/v1/completions", {"prompt": "lorem ipsum " * 400_000, "max_tokens": 1}),
        ]
    )  # fmt: skip


def soak(url: str, share: float, seed: int) -> tuple[list[float], list[int]]:
    """Latencies of the well-behaved requests, and every status code."""
    rng = random.Random(seed)
    every = round(1 / share) if share else 0  # every 20th request is hostile: 5% exactly
    plan = [
        (True, hostile(rng)) if every and i % every == every // 2 else (False, well_behaved(rng))
        for i in range(NUM_REQUESTS)
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def send(item: tuple[bool, tuple[str, dict]]) -> tuple[bool, float, int]:
        is_hostile, (path, body) = item
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
            start = time.monotonic()
            reply = client.post(path, json={"model": MODEL, **body})
            return is_hostile, time.monotonic() - start, reply.status_code

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(send, plan))
    latencies = [seconds for is_hostile, seconds, _ in results if not is_hostile]
    return latencies, [status for _, _, status in results]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def test_a_soak_with_hostile_requests_keeps_others_served(server, victim) -> None:
    clean, clean_statuses = soak(server.url, 0.0, seed=1)
    mixed, mixed_statuses = soak(server.url, HOSTILE_SHARE, seed=2)
    assert all(status < 500 for status in clean_statuses + mixed_statuses)
    assert all(status == 200 for status in clean_statuses)
    num_hostile = len(mixed_statuses) - len(mixed)
    assert num_hostile == NUM_REQUESTS * HOSTILE_SHARE
    print(
        f"\nsoak: {NUM_REQUESTS} requests each, {num_hostile} hostile; well-behaved p99 "
        f"{p99(clean):.2f} s clean, {p99(mixed):.2f} s with hostile ones"
    )
    assert p99(mixed) <= 2 * p99(clean), (p99(clean), p99(mixed))
