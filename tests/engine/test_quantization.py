"""Quantized weights (`quantization="int8"` / `"int4"`): the GGUF's own blocks are read
exactly, greedy generation is deterministic on tiny and embedded models, and prefix caching,
preemption and structured output hold as they do unquantized."""

from __future__ import annotations

import json

import pytest
import torch

from agentrt.engine.llm import LLM
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.checkpoint import gguf_source, load_hf_config, load_state_dict
from agentrt.engine.model.quantization import (
    QuantizedLinear,
    read_gguf_int4_blocks,
    resolve_quantization,
)
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

MODES = ("int8", "int4")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The history of Rome", "def fibonacci(n):", "1, 2, 3, 4,"]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(
    scope="module",
    params=[("bfloat16", m) for m in MODES] + [("float32", "int4"), ("auto", "auto")],
)
def quantized_llm(request) -> LLM:
    """bf16 with each mode (torch's glue), fp32 + int4 (the fused CPU glue), and the default
    engine (int4 + dense weights: the fused glue for steps of few rows)."""
    dtype, quantization = request.param
    return LLM(None, dtype=dtype, quantization=quantization, kv_cache_memory_gb=0.1)


def test_int4_reads_the_gguf_blocks_exactly(smollm2_dir):
    """Dequantized, the blocks are bit for bit the converted checkpoint's fp32 weights (the
    converter dequantizes the same file), Q/K rows un-permuted, q/k/v and gate/up fused."""
    arch = ModelArchConfig.from_hf_dict(load_hf_config(smollm2_dir))
    blocks = read_gguf_int4_blocks(gguf_source(None), arch)
    assert len(blocks) == 4 * arch.num_layers
    state = load_state_dict(smollm2_dir)
    for layer in (0, arch.num_layers - 1):
        p = f"model.layers.{layer}."
        qkv = torch.cat([state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([state[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")])
        assert torch.equal(blocks[(layer, "qkv_proj")].dequantize(), qkv)
        assert torch.equal(blocks[(layer, "gate_up_proj")].dequantize(), gate_up)
        assert torch.equal(
            blocks[(layer, "down_proj")].dequantize(), state[f"{p}mlp.down_proj.weight"]
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, untied lm_head
def test_tiny_models_generate_deterministically(tiny_checkpoint, arch, mode):
    path = str(tiny_checkpoint(arch))
    llm = LLM(path, quantization=mode, kv_cache_memory_gb=0.01)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedLinear) and layer.qkv_proj.mode == mode
    assert llm.engine.runner.model.logits_proj is not None
    # fp32 on the CPU: the llama layers run their glue fused; qwen2's q/k/v biases keep torch's.
    assert (llm.engine.runner.model.cpu_ops is not None) == (arch == "llama")
    first = _ids(llm.generate(PROMPTS, GREEDY))
    assert all(len(ids) == GREEDY.max_tokens for ids in first)
    assert _ids(llm.generate(PROMPTS, GREEDY)) == first
    # A fresh engine (prefix cache cold) gives the same tokens.
    again = LLM(path, quantization=mode, kv_cache_memory_gb=0.01)
    assert _ids(again.generate(PROMPTS, GREEDY)) == first


def test_embedded_model_quantized_is_deterministic_and_close(quantized_llm, smollm2_llm):
    """Greedy twice gives the same tokens; against fp32 the first tokens agree (the
    benchmark measures agreement and perplexity over a prompt set)."""
    first = _ids(quantized_llm.generate(PROMPTS, GREEDY))
    assert _ids(quantized_llm.generate(PROMPTS, GREEDY)) == first
    reference = _ids(smollm2_llm.generate(PROMPTS, GREEDY))
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(first, reference, strict=True)
    ]
    assert sum(agree) >= len(PROMPTS) * 4, agree


def test_fused_cpu_glue_matches_the_torch_path():
    """fp32 + int4 on the CPU runs each layer's glue fused (kernels/cpu_ops.c): the same
    greedy tokens as the torch ops, and the same perplexity within 0.5% (the two differ by
    fp32 sums taken in another order, rounded to bf16 before each product)."""
    llm = LLM(None, dtype="float32", quantization="int4", kv_cache_memory_gb=0.1)
    model = llm.engine.runner.model
    assert model.cpu_ops is not None
    text = llm.tokenizer.encode(" ".join(PROMPTS) + ", the lamp burned all night long.")

    def run() -> tuple[list[list[int]], float]:
        llm.engine.reset_prefix_cache()
        ids = _ids(llm.generate(PROMPTS, GREEDY))
        # Teacher forced: one chunk of the text with a logits row per position.
        blocks = list(range(-(-len(text) // llm.engine.cache_config.block_size)))
        chunk = ScheduledChunk("text", text, 0, blocks, True, num_draft_tokens=len(text) - 1)
        logits = llm.engine.runner.execute(SchedulerOutput([chunk], len(text)))
        llm.engine.reset_prefix_cache()  # those blocks now hold the text's KV
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        return ids, logprobs.gather(1, torch.tensor(text[1:])[:, None]).mean().item()

    fused, fused_mean = run()
    model.cpu_ops, ops = None, model.cpu_ops
    try:
        unfused, unfused_mean = run()
    finally:
        model.cpu_ops = ops
    assert fused == unfused
    assert abs(fused_mean - unfused_mean) < 0.005 * abs(unfused_mean), (fused_mean, unfused_mean)


def test_int4_dense_runs_int4_for_few_rows_and_the_dense_weights_beyond(smollm2_llm):
    """quantization="int4+dense" (what "auto" picks for the embedded model): a step of at
    most 24 rows runs the int4 projections, a larger one the dense weights."""
    hybrid = LLM(None, quantization="int4+dense", kv_cache_memory_gb=0.1)
    model = hybrid.engine.runner.model
    assert model.dense_above_rows == 24 and model.cpu_ops is not None
    layer = model.layers[0]
    assert isinstance(layer.qkv_proj, torch.nn.Linear)
    assert isinstance(layer.quantized.qkv_proj, QuantizedLinear)
    # One short request: every step has a few rows, so it runs as quantization="int4" does.
    short = ["1, 2, 3, 4,"]
    int4 = LLM(None, quantization="int4", kv_cache_memory_gb=0.1)
    assert _ids(hybrid.generate(short, GREEDY)) == _ids(int4.generate(short, GREEDY))
    # 30 requests at once: every step has 30 rows or more and runs the dense weights, so the
    # tokens are the unquantized fp32 engine's.
    prompts = [f"{i} + {i} =" for i in range(30)]
    assert _ids(hybrid.generate(prompts, GREEDY)) == _ids(smollm2_llm.generate(prompts, GREEDY))


def test_prefix_cache_hit_tokens_give_the_same_tokens(quantized_llm):
    """With one weight format the cached KV is what the prompt computes: warm == cold. With
    int4+dense (the default) the cold prompts run in one step of > 24 rows on the dense
    weights and the warm ones compute their few uncached rows with int4, so the tokens may
    differ (docs/engine.md); warm runs still agree with each other."""
    shared = "<|im_start|>system\nYou are a terse assistant who answers in one line.<|im_end|>\n"
    prompts = [
        shared + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("Hi", "Why?")
    ]
    quantized_llm.engine.reset_prefix_cache()
    cold = _ids(quantized_llm.generate(prompts, GREEDY))
    hits_before = quantized_llm.engine.stats().prefix_cache_hit_tokens
    warm = _ids(quantized_llm.generate(prompts, GREEDY))
    assert quantized_llm.engine.stats().prefix_cache_hit_tokens > hits_before
    if quantized_llm.engine.runner.model.dense_above_rows is None:
        assert warm == cold
    else:
        assert _ids(quantized_llm.generate(prompts, GREEDY)) == warm


def test_structured_output_is_valid(quantized_llm):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    prompt = "<|im_start|>user\nJohn Smith is 42. Give his name and age as JSON.<|im_end|>\n<|im_start|>assistant\n"
    out = quantized_llm.generate(prompt, params)[0].outputs[0]
    assert not out.structured_errors
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_preemption_keeps_outputs(tiny_checkpoint):
    """A KV pool too small for the batch preempts and recomputes; the tokens are those of an
    engine with room to spare."""
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]
    roomy = LLM(path, quantization="int4", kv_cache_memory_gb=0.01)
    tight = LLM(path, quantization="int4", num_kv_blocks=8)
    assert _ids(tight.generate(prompts, params)) == _ids(roomy.generate(prompts, params))
    assert tight.engine.stats().num_preemptions > 0


def test_auto_quantization_is_int4_only_for_the_files_own_q4_weights(tiny_checkpoint):
    """`quantization="auto"` (the default) runs a Q4 GGUF's own blocks on the CPU when dtype
    is "auto" too (int4 for steps of few rows, the dense weights beyond); a dtype named
    explicitly, another device, or a checkpoint without Q4 blocks keeps the weights as they
    are; an explicit mode passes through."""
    embedded = gguf_source(None)
    assert resolve_quantization("auto", "auto", "cpu", embedded) == "int4+dense"
    assert resolve_quantization("auto", "float32", "cpu", embedded) == "none"
    assert resolve_quantization("auto", "auto", "cuda:0", embedded) == "none"
    assert resolve_quantization("auto", "auto", "cpu", gguf_source(tiny_checkpoint("llama"))) == (
        "none"
    )
    assert resolve_quantization("int8", "float32", "cpu", None) == "int8"
    assert resolve_quantization("none", "auto", "cpu", embedded) == "none"
