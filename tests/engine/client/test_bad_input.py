"""Every bad input gets a typed error naming the field, the value and the limit, and leaves
the engine able to serve the next request."""

from __future__ import annotations

import pytest

from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ConfigError, InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams

OK = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-1 (disabled)"),
        ({"top_k": 0}, "top_k", "-1 (disabled)"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": -3}, "max_tokens", "at least 1"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "<= max_tokens"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": ["x" * 4097]}, "stop", "at most 4096 chars"),
        ({"stop": [str(i) for i in range(65)]}, "stop", "at most 64"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"logit_bias": {5: 500.0}}, "logit_bias", "[-100, 100]"),
        ({"seed": 2**64}, "seed", "[-2**63, 2**64)"),
        ({"seed": -(2**63) - 1}, "seed", "[-2**63, 2**64)"),
    ],
)
def test_sampling_params_are_validated(kwargs, field, hint):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value) and hint in str(info.value)


def _expect(llm: LLM, prompt, params: SamplingParams, field: str, *fragments: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt, params)
    assert info.value.field == field
    for fragment in fragments:
        assert fragment in str(info.value)


def test_model_dependent_limits(smollm2_llm):
    llm = smollm2_llm
    limit = llm.max_model_len
    vocab = llm.arch.vocab_size
    _expect(llm, "", OK, "prompt", "empty")
    _expect(llm, [], OK, "prompts", "empty")
    _expect(llm, [1] * limit, OK, "prompt", str(limit), "max_model_len")
    _expect(llm, "hello", SamplingParams(max_tokens=limit), "max_tokens", str(limit))
    _expect(llm, [5, vocab + 3], OK, "prompt_token_ids", str(vocab + 3), str(vocab))
    _expect(llm, [5, -1], OK, "prompt_token_ids", "-1")
    _expect(llm, "hi", SamplingParams(logit_bias={vocab: 1.0}), "logit_bias", str(vocab))
    _expect(llm, "hi", SamplingParams(stop_token_ids=[vocab + 10]), "stop_token_ids")
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [OK, OK, OK])
    assert info.value.field == "sampling_params"
    with pytest.raises(InvalidRequestError):
        llm.chat([], OK)


def test_bad_request_in_a_batch_queues_nothing_and_engine_goes_on(smollm2_llm):
    llm = smollm2_llm
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "also fine", ""], OK)
    assert not llm.engine_core.has_unfinished_requests()
    (out,) = llm.generate("The capital of France is", OK)
    assert len(out.outputs[0].token_ids) == 4


def test_request_that_can_never_fit_is_rejected_at_admission(smollm2_dir):
    llm = LLM(None, dtype="float32", num_kv_blocks=4, block_size=16)  # 64 tokens in all
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hello there", SamplingParams(max_tokens=100))
    assert "4 blocks" in str(info.value) and "could never be scheduled" in str(info.value)
    (out,) = llm.generate("hello there", SamplingParams(max_tokens=20, temperature=0.0))
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"block_size": 12}, "block_size=12"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0"),
        ({"scheduling_policy": "lifo"}, "policy='lifo'"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"kv_cache_memory_gb": -1}, "kv_cache_memory_gb=-1"),
    ],
)
def test_engine_config_is_validated(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        LLM(None, **kwargs)
