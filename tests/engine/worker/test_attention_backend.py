"""Choosing the attention backend: `auto` takes the compiled CPU kernel on the CPU and the
Triton kernels on CUDA, and falls back to the torch path, with a warning, when that one
cannot run (no compiler, shapes, no triton). CUDA choices are made without a GPU: choosing
constructs nothing on the device."""

from __future__ import annotations

import logging

import pytest
import torch

from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.records import ScheduledChunk
from agentrt.engine.worker.attention import (
    CpuAttentionBackend,
    KernelAttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
    preferred_backend,
)
from agentrt.engine.worker.model_runner import attention_metadata, prepare_input
from agentrt.kernels import dispatch, load_cpu_attention, paged_attention_ref

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A fresh kernel cache and a C compiler that always fails."""
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    load_cpu_attention.cache_clear()
    yield
    load_cpu_attention.cache_clear()


def test_auto_picks_the_cpu_kernel_on_the_cpu():
    backend = get_attention_backend("auto", CPU)
    assert isinstance(backend, CpuAttentionBackend) and backend.name == "cpu"


def test_preferred_backend_per_device():
    assert preferred_backend(CPU) == "cpu"
    assert preferred_backend(CUDA) == "triton"
    assert preferred_backend(torch.device("cuda:1")) == "triton"
    assert preferred_backend(torch.device("meta")) == "torch"


def test_auto_picks_triton_on_cuda_when_triton_imports(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    backend = get_attention_backend("auto", CUDA)
    assert type(backend) is KernelAttentionBackend and backend.name == "triton"


def test_auto_falls_back_to_torch_on_cuda_without_triton(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="agentrt.engine.worker.attention"):
        backend = get_attention_backend("auto", CUDA)
    assert type(backend) is TorchAttentionBackend
    assert "attention_backend='triton' is unavailable" in caplog.text
    assert "pip install 'agentrt[triton]'" in caplog.text
    assert "Falling back to the slower 'torch' attention backend" in caplog.text
    with pytest.raises(ConfigError, match=r"'triton' is unavailable: .*agentrt\[triton\]"):
        get_attention_backend("triton", CUDA)


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="agentrt.engine.worker.attention"):
        backend = get_attention_backend("auto", CPU)
    assert type(backend) is TorchAttentionBackend
    assert "compiling cpu_attention.c with 'false' failed" in caplog.text
    assert "Falling back to the slower 'torch' attention backend" in caplog.text


def test_auto_falls_back_to_torch_for_shapes_the_kernel_does_not_take(caplog):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 288,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 72,  # not a multiple of 16
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64,
    }
    arch = ModelArchConfig.from_hf_dict(config)
    with caplog.at_level(logging.WARNING, logger="agentrt.engine.worker.attention"):
        backend = get_attention_backend("auto", CPU, arch, block_size=16)
    assert type(backend) is TorchAttentionBackend
    assert "head_dim 72" in caplog.text
    with pytest.raises(ConfigError, match="head_dim a multiple of 16"):
        get_attention_backend("cpu", CPU, arch, block_size=16)


def test_explicit_cpu_backend_raises_when_the_kernel_cannot_build(no_compiler):
    with pytest.raises(ConfigError, match="attention_backend='cpu' is unavailable"):
        get_attention_backend("cpu", CPU)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ConfigError, match="expected 'auto' or one of"):
        get_attention_backend("flash", CPU)


def _step_metadata(chunks, block_size):
    """The engine's AttentionMetadata for chunks of (block table, context length, query
    length), as ModelRunner.execute builds it."""
    scheduled = [
        ScheduledChunk(str(i), [0] * num, context, table, True)
        for i, (table, context, num) in enumerate(chunks)
    ]
    return attention_metadata(prepare_input(scheduled, block_size, CPU), block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_step_matches_the_reference(dtype):
    """One step as the engine builds it, mixing: 5 decodes over a 20-block shared prefix, 4
    requests (6 query tokens: one is a 3-token jump-forward chunk) over another, 2 decodes
    with their own blocks and a 40-token prefill after the second prefix. The new K/V are
    written to the cache and every row matches the kernels package's reference attention."""
    torch.manual_seed(0)
    bs, kv_heads, group, dim = 16, 3, 3, 64
    cache = torch.randn(400, 2, bs, kv_heads, dim).to(dtype)
    free = iter(range(100, 400))

    def table(prefix, length):
        return prefix + [next(free) for _ in range(-(-length // bs) - len(prefix))]

    prefix_a, prefix_b = list(range(0, 20)), list(range(40, 46))
    chunks = [(table(prefix_a, n), n - 1, 1) for n in (330, 400, 345, 500, 321)]
    chunks += [(table(prefix_b, n), n - q, q) for n, q in ((120, 1), (99, 3), (97, 1), (200, 1))]
    chunks += [(table([], n), n - 1, 1) for n in (50, 81)]
    chunks += [(table(prefix_b, 140), 100, 40)]
    meta = _step_metadata(chunks, bs)
    num_tokens = int(meta.query_start_loc[-1])
    q = torch.randn(num_tokens, kv_heads * group, dim).to(dtype)
    k, v = (torch.randn(num_tokens, kv_heads, dim).to(dtype) for _ in range(2))

    backend = get_attention_backend("cpu", CPU)
    backend.prepare(meta)
    out = backend.forward(q, k, v, cache, meta, dim**-0.5)

    slots = meta.slot_mapping
    assert torch.equal(cache[slots // bs, 0, slots % bs], k)
    assert torch.equal(cache[slots // bs, 1, slots % bs], v)
    expected = paged_attention_ref(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, dim**-0.5
    )
    accuracy = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **accuracy)
