"""`agentrt serve --speculative-config JSON`: the server drafts, replies as without drafting,
and reports vLLM's spec_decode series on /metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.agentrt.server.helpers import ServerProcess, metrics


@pytest.mark.slow
def test_serve_with_speculative_config(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    base = ("--model", model, "--dtype", "float32", "--kv-cache-memory-gb", "0.05")
    # The model drafting for itself: every draft holds, so the counts are exact.
    spec = json.dumps({"method": "draft_model", "model": model, "adaptive": False})
    request = {"model": "llama", "prompt": "one two", "max_tokens": 24, "temperature": 0}
    replies = []
    for args in (base, (*base, "--speculative-config", spec)):
        with ServerProcess(*args) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            reply = client.completions.create(**request, extra_body={"ignore_eos": True})
            replies.append(reply.choices[0].text)
            with httpx.Client(base_url=server.url) as http:
                values = metrics(http)
    assert replies[0] == replies[1]
    label = '{method="draft_model",model_name="llama"}'
    drafted = values[f"agentrt:spec_decode_num_draft_tokens_total{label}"]
    assert drafted > 0
    assert values[f"agentrt:spec_decode_num_accepted_tokens_total{label}"] == drafted
    assert values[f"agentrt:spec_decode_acceptance_rate{label}"] == 1.0
    assert values[f"agentrt:spec_decode_mean_accepted_length{label}"] > 2
