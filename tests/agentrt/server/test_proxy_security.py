"""`agentrt proxy` and the p2p instances behind it, attacked over HTTP on localhost.

Stub instances (test_proxy.py's) show what the proxy lets through: nothing without its API
key, no oversized body, no upstream address on its open /health. Real `agentrt serve`
processes on a tiny model (a p2p producer and consumer sharing a secret) show that a client
cannot steer the consumer: params it altered are a 400 naming the field and the consumer
contacts nobody, while the proxy's own flow still decodes the producer's prefill.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import anyio
import httpx
import pytest

from agentrt.cli import build_parser
from agentrt.server.proxy_app import MAX_REQUEST_BYTES, create_proxy_app
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import ServerProcess, metrics
from tests.agentrt.server.test_proxy import ServerThread, Stub, stub_app

KEY = "sk-proxy-key"
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[Stub, Stub, str]]:
    """A proxy with an API key in front of a stub prefill and a stub decode instance."""
    prefill, decode = Stub("prefill"), Stub("decode")
    with ServerThread(stub_app(prefill)) as p, ServerThread(stub_app(decode)) as d:
        with ServerThread(create_proxy_app([p.url], [d.url], api_key=KEY)) as proxy:
            yield prefill, decode, proxy.url


def test_the_proxy_forwards_nothing_without_its_key(guarded):
    prefill, decode, url = guarded
    prefill.reset()
    decode.reset()
    with httpx.Client(base_url=url, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for path in ("/v1/chat/completions", "/v1/completions"):
                response = http.post(path, json=BODY, headers=headers)
                assert response.status_code == 401
                assert response.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/v1/models", headers=headers).status_code == 401
            assert http.get("/metrics", headers=headers).status_code == 401
        assert prefill.calls == [] and decode.calls == []
        ok = http.post(
            "/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert ok.status_code == 200
        assert len(prefill.calls) == len(decode.calls) == 1


def test_the_proxy_refuses_huge_bodies_before_forwarding(guarded):
    prefill, decode, url = guarded
    prefill.reset()
    decode.reset()
    huge = b'{"model": "m", "prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as it comes
        for start in range(0, len(huge), 1 << 20):
            yield huge[start : start + (1 << 20)]

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        for content in (huge, chunks()):
            response = http.post("/v1/completions", content=content)
            assert response.status_code == 413
            assert response.json()["error"]["code"] == "request_too_large"
    assert prefill.calls == [] and decode.calls == []
    assert MAX_REQUEST_BYTES == ServerConfig().max_request_bytes  # the server's limit


def test_the_open_health_route_names_no_upstream(guarded):
    _, _, url = guarded
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}


def test_proxy_key_and_body_limit_flags(monkeypatch):
    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--api-key", "k"]
    )
    assert (args.api_key, args.max_request_bytes) == ("k", MAX_REQUEST_BYTES)
    monkeypatch.setenv("AGENTRT_API_KEY", "from-env")
    args = build_parser().parse_args(["proxy", "--prefill", "http://p:1", "--decode", "http://d:1"])
    assert args.api_key == "from-env"


# -- real instances -------------------------------------------------------------------------------

SECRET = "the-instances-shared-secret"
PROMPT = "The river flows past the old mill and the bridge, where the town began long ago. " * 2


@pytest.fixture(scope="module")
def disagg(tiny_checkpoint) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    common = ("--model", str(tiny_checkpoint("llama")), "--served-model-name", "m")
    common += ("--dtype", "float32")
    common += ("--num-kv-blocks", "64", "--kv-connector", "p2p", "--kv-secret", SECRET)
    with (
        ServerProcess(*common, "--kv-role", "producer") as producer,
        ServerProcess(*common, "--kv-role", "consumer", "--kv-transfer-timeout-s", "2") as consumer,
        ServerProcess(
            "--prefill", producer.url, "--decode", consumer.url, "--api-key", KEY, command="proxy"
        ) as proxy,
    ):
        yield producer, consumer, proxy


def complete(url: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.slow  # three server processes
def test_params_a_client_altered_are_a_400_and_nothing_is_contacted(disagg):
    producer, consumer, proxy = disagg
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    held = complete(
        producer.url, PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    assert held.status_code == 200
    kv = held.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["signature"]
    for altered in (
        {**kv, "remote_port": port},
        {**kv, "remote_host": "127.0.0.2"},
        {k: v for k, v in kv.items() if k != "signature"},
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port},
    ):
        response = complete(consumer.url, PROMPT, kv_transfer_params=altered)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "kv_transfer_params"
    with pytest.raises(TimeoutError):
        listener.accept()  # nobody came
    listener.close()
    with httpx.Client(base_url=consumer.url) as http:
        assert metrics(http)["agentrt:kv_transfer_num_loads_total"] == 0

    # The proxy's own flow: the client's params are dropped, the producer's loaded.
    expected = complete(producer.url, PROMPT + " Then")
    proxied = complete(proxy.url, PROMPT + " Then", kv_transfer_params={**kv, "remote_port": port})
    assert proxied.status_code == 200, proxied.text
    assert proxied.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    with httpx.Client(base_url=consumer.url) as http:
        loaded = metrics(http)
    assert loaded["agentrt:kv_transfer_num_loads_total"] == 1
    assert loaded["agentrt:kv_transfer_num_load_failures_total"] == 0


def token_prompt(seed: int, num_tokens: int = 100) -> list[int]:
    """A prompt of its own, as token ids: 7 blocks of 16 (with the sampled token)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(num_tokens)]


@pytest.mark.slow  # three server processes (the module's)
def test_a_flood_of_holds_gets_429s_and_the_counter_moves(disagg):
    producer, consumer, proxy = disagg
    with httpx.Client(base_url=producer.url) as http:
        refused_before = metrics(http)["agentrt:kv_transfer_num_holds_refused_total"]

    # 32 of the producer's 64 blocks may be held (kv_max_held_fraction 0.5), 7 per request.
    async def flood() -> list[tuple[list[int], httpx.Response]]:
        out: list[tuple[list[int], httpx.Response]] = []
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=producer.url, headers=headers, timeout=60) as http:

            async def one(seed: int) -> None:
                body = {"model": "m", "prompt": token_prompt(seed), "max_tokens": 1}
                body["kv_transfer_params"] = {"do_remote_decode": True}
                out.append((body["prompt"], await http.post("/v1/completions", json=body)))

            async with anyio.create_task_group() as tg:
                for seed in range(12):
                    tg.start_soon(one, seed)
        return out

    responses = anyio.run(flood)
    held = [(p, r) for p, r in responses if r.status_code == 200]
    refused = [r for _, r in responses if r.status_code == 429]
    assert len(held) == 4 and len(refused) == 8, [r.text for _, r in responses]
    error = refused[0].json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "kv_max_held_fraction" in error["message"]
    assert int(refused[0].headers["Retry-After"]) >= 1
    assert all(r.json()["kv_transfer_params"]["do_remote_prefill"] for _, r in held)
    with httpx.Client(base_url=producer.url) as http:
        assert metrics(http)["agentrt:kv_transfer_num_holds_refused_total"] == refused_before + 8
    # A normal request still completes on the producer; through the proxy (whose prefill is a
    # hold too) the full cap no longer reaches the client (a few holds every 2 minutes used to
    # 429 everyone): the decode instance prefills it itself.
    assert complete(producer.url, PROMPT).status_code == 200
    proxied = complete(proxy.url, token_prompt(100))
    assert proxied.status_code == 200, proxied.text
    with httpx.Client(base_url=proxy.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        values = metrics(http)
    assert values['agentrt_proxy_prefill_fallbacks_total{reason="overloaded"}'] >= 1
    # The held prefills decode on the consumer, which frees them: holds are taken again.
    with httpx.Client(base_url=consumer.url) as http:
        loads_before = metrics(http)["agentrt:kv_transfer_num_loads_total"]
    for ids, response in held:
        kv = response.json()["kv_transfer_params"]
        assert complete(consumer.url, ids, kv_transfer_params=kv).status_code == 200
    with httpx.Client(base_url=consumer.url) as http:
        assert metrics(http)["agentrt:kv_transfer_num_loads_total"] == loads_before + 4
    proxied = complete(proxy.url, token_prompt(100))
    assert proxied.status_code == 200, proxied.text
