"""Quantized weights (`quantization="gguf"`, the default for a GGUF on the CPU, and
`"int8"` / `"int4"` for any checkpoint): the GGUF's own blocks are held as they are in the
file, greedy generation is deterministic on tiny and embedded models, and prefix caching,
preemption and structured output hold as they do unquantized."""

from __future__ import annotations

import json

import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ConfigError
from agentrt.engine.loader.gguf_file import open_gguf
from agentrt.engine.loader.quantization import resolve_quantization
from agentrt.engine.model.ggml_linear import GGMLEmbedding, GGMLLinear
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.kernels.ggml_linear import GGMLType, default_kernels, deinterleave

MODES = ("int8", "int4")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = ["The history of Rome", "def fibonacci(n):", "1, 2, 3, 4,"]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=[("auto", "auto"), ("bfloat16", "gguf")])
def quantized_llm(request) -> LLM:
    """The default engine (the file's own blocks, fp32 activations: the fused CPU glue) and
    the same blocks with bf16 activations (torch's glue)."""
    dtype, quantization = request.param
    return LLM(None, dtype=dtype, quantization=quantization, kv_cache_memory_gb=0.1)


def test_gguf_mode_holds_the_files_own_blocks(smollm2_dir, smollm2_default_llm):
    """The embedded model's projections are its Q4_1 blocks and its tied embedding its Q8_0
    blocks, one copy shared by the lookup and the output projection; o_proj and down_proj
    are views of the file's memory map (nothing copied), or on AVX-512 copies interleaved
    by 16 rows (the map's pages released); q/k/v and gate/up, one block type each, are
    stacked into one weight (q/k rows un-permuted). Dequantized they are bit for bit the
    weights gguf-py dequantizes from the file (the reference for every block type)."""
    llm = smollm2_default_llm  # read only
    model = llm.engine.runner.model
    assert llm.engine.model_config.quantization == "gguf" and model.cpu_ops is not None
    embed = model.embed_tokens
    assert isinstance(embed, GGMLEmbedding) and embed.weight.qtype == GGMLType.Q8_0
    assert model.logits_proj.weights == [embed.weight]
    file_tensors = {t.name: t for t in open_gguf(smollm2_dir).reader.tensors}
    tensors = {name: torch.from_numpy(t.data) for name, t in file_tensors.items()}

    def reference(name: str, num_heads: int | None = None) -> torch.Tensor:
        """gguf-py's dequantization of the file's tensor (the reference for every block
        type); q/k rows back in HF's order (llama.cpp's converter permuted them)."""
        tensor = file_tensors[name]
        weight = torch.from_numpy(gguf_dequantize(tensor.data, tensor.tensor_type).copy())
        if num_heads is None:
            return weight
        rows, cols = weight.shape  # (num_heads * head_dim, hidden)
        halves = weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        return halves.swapaxes(1, 2).reshape(rows, cols)

    assert torch.equal(embed.weight.dequantize(), reference("token_embd.weight"))
    interleaved = default_kernels().interleaves(GGMLType.Q4_1)  # AVX-512: rows interleaved by 16
    assert embed.weight.interleaved == interleaved
    for i in (0, len(model.layers) - 1):
        layer = model.layers[i]
        for name, file_name in (("o_proj", "attn_output"), ("down_proj", "ffn_down")):
            (weight,) = getattr(layer, name).weights
            mapped = tensors[f"blk.{i}.{file_name}.weight"]
            assert weight.qtype == GGMLType.Q4_1 and weight.interleaved == interleaved
            if interleaved:  # a copy in the kernel's layout, of the file's very bytes
                assert torch.equal(deinterleave(weight).data, mapped)
            else:  # the map itself
                assert weight.data.data_ptr() == mapped.data_ptr()
        (qkv,) = layer.qkv_proj.weights
        (gate_up,) = layer.gate_up_proj.weights
        assert qkv.qtype == gate_up.qtype == GGMLType.Q4_1
        b = f"blk.{i}."
        expected = torch.cat(
            [
                reference(b + "attn_q.weight", num_heads=9),
                reference(b + "attn_k.weight", num_heads=3),
                reference(b + "attn_v.weight"),
            ]
        )
        assert torch.equal(qkv.dequantize(), expected)
        expected = torch.cat([reference(b + "ffn_gate.weight"), reference(b + "ffn_up.weight")])
        assert torch.equal(gate_up.dequantize(), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, untied lm_head
def test_tiny_models_generate_deterministically(tiny_checkpoint, arch, mode):
    path = str(tiny_checkpoint(arch))
    llm = LLM(path, quantization=mode, kv_cache_memory_gb=0.01)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.qkv_proj, GGMLLinear)  # quantized at load to blocks
    assert {w.qtype for w in layer.qkv_proj.weights} == {
        GGMLType.Q8_0 if mode == "int8" else GGMLType.Q4_1
    }
    assert llm.engine.runner.model.logits_proj.weights[0].qtype == GGMLType.Q8_0
    # fp32 on the CPU: the layers run their glue fused (qwen2's q/k/v biases in rope_qkv).
    assert llm.engine.runner.model.cpu_ops is not None
    first = _ids(llm.generate(PROMPTS, GREEDY))
    assert all(len(ids) == GREEDY.max_tokens for ids in first)
    assert _ids(llm.generate(PROMPTS, GREEDY)) == first
    # A fresh engine (prefix cache cold) gives the same tokens.
    again = LLM(path, quantization=mode, kv_cache_memory_gb=0.01)
    assert _ids(again.generate(PROMPTS, GREEDY)) == first


def teacher_forced(llm: LLM, text: list[int]) -> tuple[torch.Tensor, float]:
    """(the next token at each position of `text`, the mean log-likelihood of text[1:]):
    one chunk of the text with a logits row per position, the prefix cache left empty."""
    llm.engine.reset_prefix_cache()
    blocks = list(range(-(-len(text) // llm.engine.cache_config.block_size)))
    chunk = ScheduledChunk("text", text, 0, blocks, True, num_draft_tokens=len(text) - 1)
    logits = llm.engine.runner.execute(SchedulerOutput([chunk], len(text)))[:-1].float()
    llm.engine.reset_prefix_cache()  # those blocks now hold the text's KV
    logprobs = torch.log_softmax(logits, dim=-1)
    return logits.argmax(-1), logprobs.gather(1, torch.tensor(text[1:])[:, None]).mean().item()


STORY = (
    ", the lamp burned all night long. Once upon a time there was a little girl who lived in "
    "a village near the forest. Whenever she went out, she wore a red riding cloak."
)


def test_embedded_model_quantized_is_deterministic_and_close(quantized_llm, smollm2_llm):
    """Greedy twice gives the same tokens; against the fp32 model, teacher-forced over a
    text of ~60 tokens, the same next token at >= 90% of positions and the mean
    log-likelihood within 1% (measured on AVX-512: the default engine 98% and 0.23%, bf16
    activations 93% and 0.63%). Greedy runs are not compared whole: int8 activations move
    near-ties (the three prompts' first difference from fp32 came at 14, 24+ and 24+ tokens
    on the interleaved kernels, at 8, 24+, 24+ on the file's layout)."""
    first = _ids(quantized_llm.generate(PROMPTS, GREEDY))
    assert all(len(ids) == GREEDY.max_tokens for ids in first)
    assert _ids(quantized_llm.generate(PROMPTS, GREEDY)) == first
    text = smollm2_llm.tokenizer.encode(" ".join(PROMPTS) + STORY)
    (got, got_mean), (want, want_mean) = (
        teacher_forced(quantized_llm, text),
        teacher_forced(smollm2_llm, text),
    )
    agreement = (got == want).float().mean().item()
    assert agreement >= 0.9, agreement
    assert abs(got_mean - want_mean) < 0.01 * abs(want_mean), (got_mean, want_mean)


def test_fused_cpu_glue_matches_the_torch_path():
    """The default engine (the GGUF's blocks, fp32 activations on the CPU) runs each layer's
    glue fused (kernels/cpu_ops.c) and agrees with the torch ops: teacher-forced, the same
    next token at >= 85% of positions and the same mean log-likelihood within 1% (measured:
    26 of 28, 0.65%; the exact fp32 model is 0.24% from the fused path, 0.9% from the torch
    ops). Greedy tokens are not compared whole: the kernels round activations to int8 per
    block, the fused path after a bf16 rounding the torch path does not make, so a near-tie
    flips (one of the three prompts parts after 8 tokens)."""
    llm = LLM(None, kv_cache_memory_gb=0.1)
    model = llm.engine.runner.model
    assert model.cpu_ops is not None
    text = llm.tokenizer.encode(" ".join(PROMPTS) + ", the lamp burned all night long.")

    fused, fused_mean = teacher_forced(llm, text)
    model.cpu_ops, ops = None, model.cpu_ops
    try:
        unfused, unfused_mean = teacher_forced(llm, text)
    finally:
        model.cpu_ops = ops
    agreement = (fused == unfused).float().mean().item()
    assert agreement >= 0.85, agreement
    assert abs(fused_mean - unfused_mean) < 0.01 * abs(unfused_mean), (fused_mean, unfused_mean)


def test_prefix_cache_hit_tokens_give_the_same_tokens(quantized_llm):
    """One weight format for every step: the cached KV is what the prompt computes, so a
    warm run gives the cold run's tokens."""
    shared = "<|im_start|>system\nYou are a terse assistant who answers in one line.<|im_end|>\n"
    prompts = [
        shared + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("Hi", "Why?")
    ]
    quantized_llm.engine.reset_prefix_cache()
    cold = _ids(quantized_llm.generate(prompts, GREEDY))
    hits_before = quantized_llm.engine.stats().prefix_cache_hit_tokens
    warm = _ids(quantized_llm.generate(prompts, GREEDY))
    assert quantized_llm.engine.stats().prefix_cache_hit_tokens > hits_before
    assert warm == cold


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


def test_auto_quantization_runs_a_gguf_in_its_own_formats_on_the_cpu():
    """`quantization="auto"` (the default) is "gguf" for a GGUF on the CPU when dtype is
    "auto" too; a dtype named explicitly (exact dequantized weights), another device (bf16
    dequantized at load) or an HF checkpoint keeps dense weights; explicit modes pass."""
    assert resolve_quantization("auto", "auto", "cpu", True) == "gguf"
    assert resolve_quantization("auto", "float32", "cpu", True) == "none"
    assert resolve_quantization("auto", "auto", "cuda:0", True) == "none"
    assert resolve_quantization("auto", "auto", "cpu", False) == "none"
    assert resolve_quantization("int8", "float32", "cpu", False) == "int8"
    assert resolve_quantization("none", "auto", "cpu", True) == "none"
    with pytest.raises(ConfigError, match="'int8' or 'int4'"):
        resolve_quantization("gguf", "auto", "cpu", False)
