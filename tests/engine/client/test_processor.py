"""Processor: the one place that checks a request against the model's limits (context length,
KV cache, vocabulary) and tokenizes it; every refusal is a typed error naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from agentrt.engine.client.processor import Processor
from agentrt.engine.errors import ContextLengthError, ErrorCode, InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams

VOCAB = 49_152  # SmolLM2's


@pytest.fixture(scope="module")
def tokenizer(smollm2_llm):
    return smollm2_llm.tokenizer


def _processor(tokenizer, *, max_model_len: int = 256, num_kv_blocks: int = 64) -> Processor:
    return Processor(
        tokenizer,
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        block_size=16,
        num_kv_blocks=num_kv_blocks,
        eos_token_ids=frozenset({2}),
    )


def _refused(fn, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args, **kwargs)
    assert info.value.code == ErrorCode.INVALID_REQUEST
    return info.value


def test_text_and_token_id_prompts(tokenizer):
    processor = _processor(tokenizer)
    text = "The capital of France is"
    assert processor.tokenize(text) == tokenizer.encode(text)
    assert processor.tokenize([1, 2, 3]) == [1, 2, 3]
    assert processor.tokenize(np.array([5, 6], dtype=np.int64)) == [5, 6]
    assert processor.tokenize((7,)) == [7]
    request = processor.process("r", text, SamplingParams(max_tokens=4), priority=3)
    assert request.prompt_token_ids == tokenizer.encode(text)
    assert request.max_tokens == 4 and request.priority == 3
    assert request.eos_token_ids == frozenset({2})


@pytest.mark.parametrize(
    ("prompt", "shown"),
    [([1, "a"], "'a'"), ([1, 2.5], "2.5"), ([True, 3], "True"), ([[1, 2], 3], "[1, 2]")],
)
def test_a_token_id_prompt_holding_something_else_is_a_typed_error(tokenizer, prompt, shown):
    error = _refused(_processor(tokenizer).tokenize, prompt)
    assert error.field == "prompt"
    assert shown in str(error) and "integers only" in str(error)


def test_bad_prompts_name_the_field(tokenizer):
    processor = _processor(tokenizer)
    assert _refused(processor.tokenize, "").field == "prompt"
    assert _refused(processor.tokenize, 5).field == "prompt"
    assert _refused(processor.tokenize, b"bytes").field == "prompt"
    error = _refused(processor.tokenize, [1, VOCAB, -1])
    assert error.field == "prompt_token_ids" and error.value == [VOCAB, -1]
    assert f"[0, {VOCAB})" in str(error)
    assert _refused(processor.process, "r", [], SamplingParams()).field == "prompt"
    assert _refused(processor.chat_token_ids, []).field == "messages"


def test_the_context_length_bounds_prompt_and_max_tokens(tokenizer):
    processor = _processor(tokenizer, max_model_len=32, num_kv_blocks=64)
    assert processor.max_request_tokens == 32
    # max_tokens=None allows all the room the prompt leaves.
    assert processor.process("r", [1] * 10, SamplingParams(max_tokens=None)).max_tokens == 22
    assert processor.process("r", [1] * 10, SamplingParams(max_tokens=22)).max_tokens == 22
    with pytest.raises(ContextLengthError) as info:
        processor.process("r", [1] * 10, SamplingParams(max_tokens=23))
    assert info.value.field == "max_tokens" and info.value.value == 23
    assert "at most 22 tokens can be generated" in str(info.value)
    assert "max_model_len is 32" in str(info.value)
    with pytest.raises(ContextLengthError) as info:
        processor.process("r", [1] * 32, SamplingParams(max_tokens=1))
    assert info.value.field == "prompt" and info.value.value == 32
    assert info.value.code == ErrorCode.INVALID_REQUEST


def test_a_kv_cache_smaller_than_the_context_bounds_the_request(tokenizer):
    processor = _processor(tokenizer, max_model_len=1024, num_kv_blocks=4)  # 64 tokens
    assert processor.max_request_tokens == 64
    assert processor.process("r", [1] * 60, SamplingParams(max_tokens=None)).max_tokens == 4
    with pytest.raises(ContextLengthError) as info:
        processor.process("r", [1] * 10, SamplingParams(max_tokens=100))
    message = str(info.value)
    assert "4 blocks of 16 tokens" in message and "raise kv_cache_memory_gb" in message
    with pytest.raises(ContextLengthError) as info:
        processor.process("r", [1] * 64, SamplingParams(max_tokens=1))
    assert info.value.field == "prompt"


def test_token_ids_in_sampling_params_must_be_in_the_vocabulary(tokenizer):
    processor = _processor(tokenizer)
    error = _refused(processor.process, "r", [1], SamplingParams(stop_token_ids=[VOCAB + 1]))
    assert error.field == "stop_token_ids" and error.value == [VOCAB + 1]
    error = _refused(processor.process, "r", [1], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert error.field == "logit_bias"


def test_chat_messages_render_with_the_template(tokenizer):
    processor = _processor(tokenizer)
    ids = processor.chat_token_ids([{"role": "user", "content": "Hello there"}])
    text = tokenizer.decode(ids)
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = processor.chat_token_ids(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=False
    )
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)


def test_llm_and_async_engine_refuse_non_integer_token_prompts(smollm2_llm):
    with pytest.raises(InvalidRequestError) as info:
        smollm2_llm.generate([[1, "a"]], SamplingParams(max_tokens=2))
    assert info.value.field == "prompt"
    assert not smollm2_llm.engine_core.has_unfinished_requests()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_async_engine_refuses_a_non_integer_token_prompt(smollm2_llm, anyio_backend):
    from agentrt.engine.client.async_engine import AsyncEngine

    async with AsyncEngine(engine=smollm2_llm.engine) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request([1, "a"], SamplingParams(max_tokens=2))
        assert info.value.field == "prompt"
        assert engine.num_pending_requests == 0
