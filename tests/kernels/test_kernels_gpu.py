"""On a GPU (skipped without CUDA): the kernels against their references at real model
sizes, and the engine's CUDA path end to end (Triton attention, fused RMSNorm and RoPE,
the grammar bitmask and seeded sampling on device) against its CPU path."""

from __future__ import annotations

import json

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.kernels import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (32, 32, 128)]
)
@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([4100, 300, 8193, 77], [1, 1, 1, 1]),  # long decode: split-KV path
        ([1500], [1500]),  # prefill
        ([2049, 512, 33, 700], [1, 512, 16, 128]),  # mixed / chunked prefill
    ],
)
def test_paged_attention_gpu(
    make_paged_batch, tol, dtype, num_heads, num_kv_heads, head_dim, seq_lens, query_lens
):
    for block_size in (16, 32):
        batch = make_paged_batch(
            seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
        )
        out = paged_attention(*batch.args())
        ref = paged_attention_ref(*batch.args())  # the torch reference on the GPU
        torch.testing.assert_close(out, ref, **tol(dtype))


def test_reshape_and_cache_gpu():
    dev = torch.device("cuda")
    cache = torch.zeros(512, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    key = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device=dev)
    value = torch.randn_like(key)
    slots = torch.randperm(512 * 16, device=dev)[:4096]
    slots[::7] = -1
    ref = cache.clone()
    reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, ref, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("batch", [1, 512])
def test_bitmask_gpu_128k_vocab(batch):
    dev = torch.device("cuda")
    vocab = 128_256
    logits = torch.randn(batch, vocab, device=dev)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, -(-vocab // 32)), dtype=torch.int32)
    expect = logits.clone()
    apply_token_bitmask_ref(expect, mask.to(dev))
    apply_token_bitmask(logits, mask.to(dev))
    assert torch.equal(logits, expect)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_and_rotary_gpu(tol, dtype):
    dev = torch.device("cuda")
    x = torch.randn(1024, 4096, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    w = torch.rand(4096, dtype=dtype, device=dev)
    out, new_res = rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, residual=res)
    torch.testing.assert_close(out, ref_out, **tol(dtype))
    torch.testing.assert_close(new_res, ref_res, **tol(dtype))
    positions = torch.randint(0, 8192, (1024,), device=dev)
    angles = torch.rand(8192, 64, device=dev) * 100
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q = torch.randn(1024, 32 * 128, dtype=dtype, device=dev)
    k = torch.randn(1024, 8 * 128, dtype=dtype, device=dev)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, cache, 128)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, 128)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))


PROMPTS = [
    "The history of Rome",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "<|im_start|>user\nWhat is the capital of Japan?<|im_end|>\n<|im_start|>assistant\n",
]


def greedy_ids(llm: LLM, num_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_model_cuda_path_matches_cpu_fp32(tiny_checkpoint, arch, attention_backend):
    """Tiny models have peaked logits, so fp32 greedy tokens must agree exactly."""
    path = str(tiny_checkpoint(arch))
    options = dict(dtype="float32", kv_cache_memory_gb=0.05, max_num_batched_tokens=40)
    cpu = LLM(path, **options)
    gpu = LLM(path, device="cuda", attention_backend=attention_backend, **options)
    expected = "triton" if attention_backend == "auto" else "torch"
    assert gpu.runner.attention.name == expected
    assert gpu.runner.model.rotary.kernel_ops == (expected == "triton")
    assert greedy_ids(gpu, 24) == greedy_ids(cpu, 24)


def test_embedded_model_cuda_fp32_matches_cpu_and_bf16_runs(smollm2_dir):
    cpu = LLM(None, dtype="float32", kv_cache_memory_gb=0.25)
    gpu = LLM(None, device="cuda", dtype="float32", kv_cache_memory_gb=0.25)
    assert gpu.runner.attention.name == "triton"
    assert greedy_ids(gpu, 16) == greedy_ids(cpu, 16)
    bf16 = LLM(None, device="cuda", dtype="bfloat16", kv_cache_memory_gb=0.25)
    assert all(len(ids) == 16 for ids in greedy_ids(bf16, 16))


def test_structured_and_seeded_sampling_on_cuda(smollm2_dir):
    """The grammar bitmask (built on the CPU) and per-request generators must reach the
    device the logits live on."""
    llm = LLM(None, device="cuda", dtype="bfloat16", kv_cache_memory_gb=0.25)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    constrained = SamplingParams(
        temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (out,) = llm.generate("John Smith is 42. As JSON:", constrained)
    assert set(json.loads(out.outputs[0].text)) == {"name", "age"}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first, second = (llm.generate("Once upon a time", seeded)[0] for _ in range(2))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
