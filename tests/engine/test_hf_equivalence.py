"""Greedy fp32 token ids equal HF transformers `generate`, one request at a time and in one
continuous batch, on the embedded model and on tiny random Llama / Qwen2 / Qwen3 / Mistral
models; also under chunked prefill and KV pressure that forces preemption."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy_batch

PROMPTS = [
    "The history of Rome",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "Translate to French: I love cheese.",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
    "Q: What is 17 * 3?\nA:",
    "Emoji party: 🎉 and 日本語のテキスト",
    "A long list of fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
    "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry,",
]
NUM_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# Engines under scheduling pressure and the prefix-cache pass compare the first 24 of those
# tokens: every variant still chunks, preempts, caps or hits as it says, at a third of the
# decode steps (greedy: HF's first 24 tokens of 64 are its 24-token continuation).
SHORT_TOKENS = 24
SHORT_GREEDY = SamplingParams(temperature=0.0, max_tokens=SHORT_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(smollm2_llm, hf_smollm2) -> list[list[int]]:
    tokenizer = smollm2_llm.tokenizer
    return hf_greedy_batch(hf_smollm2, [tokenizer.encode(p) for p in PROMPTS], NUM_TOKENS)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_embedded_model_batched_equals_hf(smollm2_llm, hf_reference):
    assert _token_ids(smollm2_llm.generate(PROMPTS, GREEDY)) == hf_reference


@pytest.mark.slow
def test_embedded_model_one_at_a_time_equals_hf(smollm2_llm, hf_reference):
    # one request per step: plain text, a chat turn, emoji and CJK (the batch test has all)
    for i in (0, 5, 7):
        assert _token_ids(smollm2_llm.generate(PROMPTS[i], GREEDY)) == [hf_reference[i]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 7}, id="chunked-prefill-7"),
        pytest.param({"max_num_batched_tokens": 32, "max_num_seqs": 3}, id="chunked-32-seqs3"),
        # 12 blocks of 16 = 192 tokens for 9 requests of up to ~60 tokens: must preempt.
        pytest.param({"num_kv_blocks": 12}, id="preemption"),
        pytest.param({"block_size": 32, "max_num_batched_tokens": 50}, id="block32"),
        # The default on the CPU is the compiled attention kernel; the pure-torch path too,
        # here without a prefix cache (one engine for both: distinct prompts in one batch hit
        # no cached block, so caching changes only the bookkeeping, not the attention).
        pytest.param(
            {"attention_backend": "torch", "enable_prefix_caching": False},
            id="torch-attention-no-prefix-cache",
        ),
        pytest.param(
            {"long_prefill_token_threshold": 5, "scheduling_policy": "priority"},
            id="prefill-cap-priority",
        ),
    ],
)
def test_embedded_model_under_scheduling_pressure_equals_hf(smollm2_dir, hf_reference, engine_args):
    llm = LLM(None, dtype="float32", **engine_args)
    expected = [ids[:SHORT_TOKENS] for ids in hf_reference]
    assert _token_ids(llm.generate(PROMPTS, SHORT_GREEDY)) == expected
    if "num_kv_blocks" in engine_args:
        assert llm.scheduler.num_preemptions > 0
    llm.kv_manager.check_invariants()
    assert llm.kv_manager.pool.num_free_blocks == llm.kv_manager.num_blocks


TINY_ENGINES = {
    "default": {},
    "preemption": {"num_kv_blocks": 10, "block_size": 8},
    "kernels-backend": {"attention_backend": "triton"},  # kernels' torch references on CPU
    "torch-attention": {"attention_backend": "torch"},  # SDPA decode instead of the C kernel
    "no-prefix-cache-priority": {"enable_prefix_caching": False, "scheduling_policy": "priority"},
}


@pytest.mark.parametrize(
    ("arch", "engine"),
    [(arch, "default") for arch in ("llama", "qwen2", "qwen3", "mistral")]
    + [("qwen2", name) for name in TINY_ENGINES if name != "default"],
)
def test_tiny_models_equal_hf(tiny_checkpoint, arch, engine):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine_args = {"kv_cache_memory_gb": 0.05, "max_num_batched_tokens": 40}
    llm = LLM(str(path), dtype="float32", **(engine_args | TINY_ENGINES[engine]))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = hf_greedy_batch(hf, prompts, 24)
    assert _token_ids(llm.generate(prompts, params)) == expected
    assert _token_ids(llm.generate(prompts[0], params)) == expected[:1]
    if engine == "preemption":
        assert llm.scheduler.num_preemptions > 0
    llm.kv_manager.check_invariants()


def test_prefix_cache_hits_keep_outputs_identical(smollm2_llm, hf_reference):
    """Second pass over the same prompts: prompts of two or more blocks hit the cache and
    still produce HF's tokens, in a batch and alone. (The first pass caches the prompts'
    full blocks; one token each is enough for that: a hit is on prompt blocks only.)"""
    smollm2_llm.reset_prefix_cache()
    first = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
    assert all(o.num_cached_tokens == 0 for o in first)
    second = smollm2_llm.generate(PROMPTS, SHORT_GREEDY)
    assert _token_ids(second) == [ids[:SHORT_TOKENS] for ids in hf_reference]
    block = smollm2_llm.cache_config.block_size
    for out in second:
        expected = (len(out.prompt_token_ids) - 1) // block * block
        assert out.num_cached_tokens == expected
    assert smollm2_llm.stats().prefix_cache_hit_tokens >= sum(o.num_cached_tokens for o in second)


def test_multi_turn_session_reuses_the_history(smollm2_llm):
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    history = [system]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    cached = []  # (cached tokens, prompt tokens) per turn
    for question in ["What is 2 + 2?", "And times 3?", "Name a prime number."]:
        history.append({"role": "user", "content": question})
        (out,) = smollm2_llm.chat(history, params)
        cached.append((out.num_cached_tokens, len(out.prompt_token_ids)))
        history.append({"role": "assistant", "content": out.outputs[0].text})
    # Every later turn finds (nearly) the whole previous conversation in the cache.
    block = smollm2_llm.cache_config.block_size
    for turn in range(1, len(cached)):
        assert cached[turn][0] >= cached[turn - 1][1] // block * block
    smollm2_llm.kv_manager.check_invariants()
