"""The victim of the adversarial suite: while a hostile request runs, it polls /health and
sends a 2-token completion, round after round, and records each round's latency."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"
IDLE_ROUNDS = 5


@dataclass(slots=True)
class Attack:
    """What one hostile request got, and what the victim saw meanwhile."""

    response: httpx.Response | None
    seconds: float
    victim_rounds: list[float] = field(default_factory=list)
    victim_failures: list[str] = field(default_factory=list)


class Victim:
    def __init__(self, url: str, api_key: str) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.idle_s = 0.0  # the slowest idle round

    def round(self, client: httpx.Client) -> float:
        """One round: /health, then a 2-token completion; returns its seconds."""
        start = time.monotonic()
        health = client.get("/health")
        assert health.status_code == 200, health.text
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
        return time.monotonic() - start

    def measure_idle(self) -> float:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=60) as client:
            self.round(client)  # warm: the first round loads what later ones reuse
            rounds = [self.round(client) for _ in range(IDLE_ROUNDS)]
        self.idle_s = max(statistics.median(rounds), 0.05)
        return self.idle_s

    @property
    def bound_s(self) -> float:
        """What a round may take while a hostile request runs: 2x idle, plus 1 s."""
        return 2 * self.idle_s + 1.0

    def during(self, hostile: Callable[[httpx.Client], Any], timeout_s: float = 120) -> Attack:
        """Run `hostile(client)` while the victim keeps sending rounds (from just before it
        starts until it ends, at least two rounds)."""
        stop = threading.Event()
        rounds: list[float] = []
        failures: list[str] = []

        def victim() -> None:
            with httpx.Client(base_url=self.url, headers=self.headers, timeout=60) as client:
                while not stop.is_set() or len(rounds) < 2:
                    try:
                        rounds.append(self.round(client))
                    except (AssertionError, httpx.HTTPError) as exc:
                        failures.append(repr(exc))
                        return

        thread = threading.Thread(target=victim, daemon=True)
        thread.start()
        start = time.monotonic()
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout_s) as client:
            try:
                response = hostile(client)
            except httpx.TimeoutException:
                response = None
        seconds = time.monotonic() - start
        stop.set()
        thread.join(timeout=120)
        return Attack(response, seconds, rounds, failures)

    def check(self, attack: Attack) -> None:
        """The victim was served throughout, each round within the bound."""
        assert not attack.victim_failures, attack.victim_failures
        assert attack.victim_rounds, "the victim sent no round"
        slowest = max(attack.victim_rounds)
        assert slowest <= self.bound_s, (
            f"a victim round took {slowest:.2f} s under attack (idle {self.idle_s:.2f} s, "
            f"bound {self.bound_s:.2f} s): {attack.victim_rounds}"
        )
