"""`/v1/completions`, `/v1/models`, `/tokenize`, `/detokenize`, `/health` and `/metrics` on the
embedded model."""

from __future__ import annotations

import httpx
import openai

from tests.agentrt.server.helpers import metrics

MODEL = "SmolLM2-135M-Instruct"


def test_models_lists_the_served_model(client: openai.OpenAI):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_completions_text_tokens_batch_and_echo(client: openai.OpenAI, http: httpx.Client):
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    text = reply.choices[0].text
    assert reply.object == "text_completion" and text
    token_ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    same = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=6, temperature=0)
    assert same.choices[0].text == text  # token-id prompts are the same prompt
    batch = client.completions.create(
        model=MODEL,
        prompt=["The capital of France is", "1, 2, 3,"],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text
    assert batch.usage.prompt_tokens == len(token_ids) + len(
        http.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    )
    echoed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The capital of France is" + text
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == text


def test_completion_logprobs(client: openai.OpenAI):
    reply = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob


def test_tokenize_and_detokenize_round_trip(http: httpx.Client):
    text = "Hello, agentrt!"
    tokenized = http.post("/tokenize", json={"prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 8192
    assert http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "<|im_start|>user\n" + text in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_health_and_metrics(server, http: httpx.Client, client: openai.OpenAI):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = metrics(http)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    after = metrics(http)
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in (
        "agentrt:num_requests_running",
        "agentrt:num_requests_waiting",
        "agentrt:kv_cache_usage_perc",
        "agentrt:num_preemptions_total",
        "agentrt:prefix_cache_hit_rate",
        "agentrt:time_to_first_token_seconds_count",
        "agentrt:inter_token_latency_seconds_count",
        "agentrt:e2e_request_latency_seconds_bucket",
    ):
        assert name in after, name
    assert after["agentrt:generation_tokens_total"] - before["agentrt:generation_tokens_total"] == 3
    assert after["agentrt:prompt_tokens_total"] > before["agentrt:prompt_tokens_total"]
    assert (
        after["agentrt:time_to_first_token_seconds_count"]
        == before["agentrt:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["agentrt:inter_token_latency_seconds_count"]
        == before["agentrt:inter_token_latency_seconds_count"] + 2
    )
    assert 'agentrt:http_responses_total{model_name="SmolLM2-135M-Instruct",status="200"}' in after
