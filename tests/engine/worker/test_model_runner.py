"""ModelRunner: the flat varlen batch `prepare_input` builds from scheduled chunks (checked
against hand-computed values), its attention metadata, the KV pool size, and `execute` on
a tiny random Llama in fp32: a prompt gives the same logits in one chunk, in two chunks
(chunked prefill through the KV cache) and as a decode after its prefill, equal to HF
transformers, with the 'torch' and 'cpu' attention backends; one row per sampled chunk, in
chunk order; and teacher-forced verification steps (gguf.py's dense fp32 reference) equal to
transformers on a Qwen2 with Qwen2.5-1.5B's attention (head_dim 128, 6 query heads per KV head)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from agentrt.engine.config import CacheConfig
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.worker.model_runner import (
    ModelRunner,
    attention_metadata,
    kv_block_bytes,
    kv_pool_blocks,
    prepare_input,
)

CPU = torch.device("cpu")
BS = 8  # block size of the runners below: prompts span several blocks
PROMPT = [(7 * i + 3) % 1000 + 100 for i in range(21)]  # 21 tokens: blocks of 8, 8 and 5
# fp32 logits of the same tokens computed in different chunkings (or by HF) differ only by
# the order of float sums; the tiny model's logits are O(10).
TOL = {"rtol": 1e-4, "atol": 1e-4}


# --- prepare_input --------------------------------------------------------------------------


def test_prepare_input_builds_the_flat_batch():
    """Three requests with block size 4: a decode-like chunk of 3 after 5 cached tokens, a
    prefill chunk that does not sample and crosses a block boundary, and a single decode."""
    chunks = [
        ScheduledChunk("a", [11, 12, 13], start_pos=5, block_ids=[7, 2], sample=True),
        ScheduledChunk("b", [21, 22, 23, 24, 25, 26], start_pos=0, block_ids=[3, 9], sample=False),
        ScheduledChunk("c", [31], start_pos=8, block_ids=[1, 4, 6], sample=True),
    ]
    inp = prepare_input(chunks, 4, CPU)
    assert inp.input_ids.tolist() == [11, 12, 13, 21, 22, 23, 24, 25, 26, 31]
    assert inp.positions.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 5, 8]
    # slot = block_ids[pos // 4] * 4 + pos % 4
    assert inp.slot_mapping.tolist() == [9, 10, 11, 12, 13, 14, 15, 36, 37, 24]
    assert inp.query_start_loc.tolist() == [0, 3, 9, 10]
    assert inp.seq_lens.tolist() == [8, 6, 9]
    assert inp.block_tables.tolist() == [[7, 2, 0], [3, 9, 0], [1, 4, 6]]
    assert inp.logits_indices.tolist() == [2, 9]  # the last token of each sampled chunk
    assert inp.query_lens == [3, 6, 1] and inp.context_lens == [5, 0, 8]
    assert inp.max_seq_len == 9
    dtypes = [inp.input_ids, inp.positions, inp.slot_mapping, inp.logits_indices]
    assert all(t.dtype == torch.int64 for t in dtypes)
    assert all(t.dtype == torch.int32 for t in (inp.query_start_loc, inp.seq_lens))
    assert inp.block_tables.dtype == torch.int32


def test_prepare_input_without_a_sampled_chunk_selects_no_rows():
    chunk = ScheduledChunk("a", list(range(16)), start_pos=16, block_ids=[0, 5, 6, 3], sample=False)
    inp = prepare_input([chunk], 8, CPU)
    assert inp.logits_indices.shape == (0,)
    assert inp.slot_mapping.tolist() == list(range(48, 56)) + list(range(24, 32))
    assert inp.positions.tolist() == list(range(16, 32))
    assert inp.seq_lens.tolist() == [32] and inp.context_lens == [16]


def test_attention_metadata_carries_the_batch():
    chunks = [
        ScheduledChunk("a", [1, 2], start_pos=3, block_ids=[4, 7], sample=True),
        ScheduledChunk("b", [5], start_pos=9, block_ids=[0, 2, 8], sample=True),
    ]
    inp = prepare_input(chunks, 4, CPU)
    meta = attention_metadata(inp, 4)
    assert meta.slot_mapping is inp.slot_mapping
    assert meta.query_start_loc is inp.query_start_loc
    assert meta.seq_lens is inp.seq_lens and meta.block_tables is inp.block_tables
    assert meta.max_seq_len == 10 and meta.block_size == 4
    assert meta.query_lens == [2, 1] and meta.context_lens == [3, 9]
    assert meta.key_rows is None  # derived by the backend's prepare()
    # Each new K's row in the cache viewed as (blocks * 2 * 4, heads, dim): V follows K's block.
    # Slots 19 (block 4), 28 (block 7), 33 (block 8) -> 4*8+3, 7*8+0, 8*8+1.
    assert meta.slot_mapping.tolist() == [19, 28, 33]
    assert meta.key_cache_rows().tolist() == [35, 56, 65]


# --- kv_pool_blocks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    return ModelArchConfig.from_hf_dict(load_hf_config(path)), load_state_dict(path), path


def cache_config(**fields) -> CacheConfig:
    return CacheConfig(**({"block_size": 16, "enable_prefix_caching": True} | fields))


def test_kv_pool_blocks_from_memory_or_an_explicit_count(tiny_llama):
    arch = tiny_llama[0]  # 2 layers, 2 KV heads of 16
    # K and V * 16 slots * 2 heads * 16 dims * 4 bytes, per layer, 2 layers.
    assert kv_block_bytes(arch, 16, torch.float32) == 2 * 16 * 2 * 16 * 4 * 2 == 8192
    counted = cache_config(kv_cache_memory_gb=1.0, num_blocks=7)
    assert kv_pool_blocks(arch, counted, torch.float32) == 7  # the count wins over memory
    memory = cache_config(kv_cache_memory_gb=0.001, num_blocks=None)
    assert kv_pool_blocks(arch, memory, torch.float32) == int(0.001 * 2**30) // 8192 == 131
    assert kv_pool_blocks(arch, memory, torch.bfloat16) == int(0.001 * 2**30) // 4096


# --- ModelRunner.execute ----------------------------------------------------------------------


def make_runner(tiny_llama, backend: str, num_blocks: int = 16) -> ModelRunner:
    arch, state, _ = tiny_llama
    return ModelRunner(
        arch,
        state,
        dtype=torch.float32,
        device=CPU,
        block_size=BS,
        num_blocks=num_blocks,
        max_model_len=256,
        attention_backend=backend,
    )


def step(runner: ModelRunner, *chunks: ScheduledChunk) -> torch.Tensor:
    num_tokens = sum(len(c.token_ids) for c in chunks)
    return runner.execute(SchedulerOutput(list(chunks), num_tokens))


@pytest.fixture(scope="module")
def hf_logits(tiny_llama) -> torch.Tensor:
    """HF transformers' logits (len(PROMPT), vocab) for PROMPT on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama[2]), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([PROMPT])).logits[0].float()


BACKENDS = ["torch", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunk_two_chunks_and_a_decode_give_the_same_logits(tiny_llama, hf_logits, backend):
    runner = make_runner(tiny_llama, backend)
    assert runner.attention.name == backend
    n = len(PROMPT)
    # Three requests in their own (scattered) blocks of one KV pool.
    one = step(runner, ScheduledChunk("one", PROMPT, 0, [5, 2, 9], True))
    # Chunked prefill: 13 tokens (a block and 5 slots), then the other 8 read them back.
    first = step(runner, ScheduledChunk("two", PROMPT[:13], 0, [1, 12], False))
    assert first.shape == (0, runner.arch.vocab_size)
    two = step(runner, ScheduledChunk("two", PROMPT[13:], 13, [1, 12, 7], True))
    # Prefill all but the last token (that step samples position n - 2), then decode it.
    before = step(runner, ScheduledChunk("dec", PROMPT[:-1], 0, [3, 0, 14], True))
    decode = step(runner, ScheduledChunk("dec", PROMPT[-1:], n - 1, [3, 0, 14], True))

    for logits in (one, two, decode):
        assert logits.shape == (1, runner.arch.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(two, one, **TOL)
    torch.testing.assert_close(decode, one, **TOL)
    torch.testing.assert_close(one[0], hf_logits[n - 1], **TOL)
    torch.testing.assert_close(before[0], hf_logits[n - 2], **TOL)
    assert one.abs().max() > 1.0  # the comparison is not between near-zero rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_is_written_to_the_scheduled_slots_only(tiny_llama, backend):
    runner = make_runner(tiny_llama, backend)
    step(runner, ScheduledChunk("a", PROMPT[:13], 0, [6, 3], False))
    for cache in runner.kv_caches:  # (num_blocks, 2, BS, kv heads, head_dim)
        written = cache.abs().sum(dim=(1, 3, 4)) != 0  # (num_blocks, BS)
        expected = torch.zeros_like(written)
        expected[6, :] = True  # positions 0..7
        expected[3, :5] = True  # positions 8..12
        assert torch.equal(written, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_execute_returns_one_row_per_sampled_chunk_in_chunk_order(tiny_llama, backend):
    """A mixed step: a decode, a prefill chunk that does not sample, a whole prompt. Each
    sampled row equals the same request run alone in a fresh runner."""
    other = [(5 * i + 1) % 900 + 200 for i in range(11)]

    def alone(*steps: list[ScheduledChunk]) -> torch.Tensor:
        runner = make_runner(tiny_llama, backend)
        return [step(runner, *chunks) for chunks in steps][-1]

    runner = make_runner(tiny_llama, backend)
    step(runner, ScheduledChunk("dec", PROMPT[:-1], 0, [4, 8, 2], True))
    mixed = step(
        runner,
        ScheduledChunk("dec", PROMPT[-1:], len(PROMPT) - 1, [4, 8, 2], True),
        ScheduledChunk("pre", PROMPT[:10], 0, [0, 1], False),
        ScheduledChunk("new", other, 0, [10, 11], True),
    )
    assert mixed.shape == (2, runner.arch.vocab_size)
    expected_dec = alone(
        [ScheduledChunk("dec", PROMPT[:-1], 0, [4, 8, 2], True)],
        [ScheduledChunk("dec", PROMPT[-1:], len(PROMPT) - 1, [4, 8, 2], True)],
    )
    expected_new = alone([ScheduledChunk("new", other, 0, [10, 11], True)])
    torch.testing.assert_close(mixed[0], expected_dec[0], **TOL)
    torch.testing.assert_close(mixed[1], expected_new[0], **TOL)
    assert not torch.allclose(mixed[0], mixed[1])  # different requests, different rows


ALLOCATIONS_SCRIPT = """
import ctypes
import torch
from agentrt.engine.worker.model_runner import large_allocations_mapped

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2

def mapped(nbytes):
    before = libc.mallinfo2().hblkhd
    block = torch.empty(nbytes, dtype=torch.uint8)
    grown = libc.mallinfo2().hblkhd - before
    del block
    return grown >= nbytes

big = torch.empty(16 << 20, dtype=torch.uint8)
del big  # glibc's threshold now follows it up
# Sizes that no freed block holds (malloc reuses one before it decides anything).
result = [mapped(1 << 20)]
with large_allocations_mapped():
    result.append(mapped(3 << 20))
result += [mapped(5 << 20), mapped(40 << 20)]
print(result)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # By default a freed 16 MiB block lifts the threshold: 1 MiB comes from the heap.
        # Loading, 3 MiB is mapped; after, the thresholds are glibc's ceiling (32 MiB).
        ({}, "[False, True, False, True]"),
        # The user's own threshold (128 KiB) is left alone: mapped before, during and after.
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "[True, True, True, True]"),
    ],
)
def test_a_load_maps_its_large_allocations(env, expected):
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == expected


# --- the dense fp32 reference path at Qwen2.5-1.5B's attention geometry -----------------------


@pytest.fixture(scope="module")
def qwen_15b_heads():
    """A random 2-layer Qwen2 with Qwen2.5-1.5B's attention (issue 39's dense fp32 reference):
    12 query heads of 128 over 2 KV heads (6 per KV head), q/k/v biases, rope theta 1e6, a
    tied output; hidden and vocabulary small. (arch, HF state dict, HF model)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith(".bias"):  # transformers initialises them to zero
                    param.normal_(0.0, 0.5)
    arch = ModelArchConfig.from_hf_dict(config.to_dict())
    assert (arch.head_dim, arch.num_heads // arch.num_kv_heads, arch.qkv_bias) == (128, 6, True)
    # As save_pretrained writes a tied checkpoint: without the output's copy of the embedding.
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    return arch, state, hf


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_forced_steps_equal_hf_at_qwen_1_5b_attention(qwen_15b_heads, backend):
    # benchmarks/gguf.py's --reference-engine agentrt scores a text in steps of 16 tokens, each
    # a verification step with a logits row per token (benchmarks/latency.py
    # teacher_forced_logits): every row of each step equals transformers' fp32 logits.
    arch, state, hf = qwen_15b_heads
    runner = ModelRunner(
        arch,
        state,
        dtype=torch.float32,
        device=CPU,
        block_size=16,
        num_blocks=4,
        max_model_len=64,
        attention_backend=backend,
    )
    assert runner.attention.name == backend
    ids = torch.randint(0, arch.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    rows = []
    for start in range(0, len(ids), 16):  # 16, 16 and 8 tokens
        chunk = ids[start : start + 16]
        rows.append(
            step(runner, ScheduledChunk("ppl", chunk, start, [0, 1, 2], True, len(chunk) - 1))
        )
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = torch.cat(rows)
    assert got.shape == expected.shape == (40, arch.vocab_size)
    torch.testing.assert_close(got, expected, **TOL)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert expected.std(-1).min() > 0.1  # rows that are not flat: a wrong row would show
