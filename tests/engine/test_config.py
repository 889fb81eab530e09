"""The engine config is resolved once: `EngineArgs.create_engine_config()` finds the
checkpoint, makes "auto" concrete, caps the context length and sizes the KV pool, into one
frozen record; the engine built from it reads none of the user's strings again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.llm_engine import LLMEngine
from agentrt.engine.loader.checkpoint import resolve_model
from agentrt.engine.sampling_params import SamplingParams


def test_the_embedded_model_resolves_to_its_file_and_block_formats(smollm2_dir):
    config = EngineArgs().create_engine_config()
    model = config.model
    assert model.model is None and model.path == smollm2_dir == resolve_model(None)
    assert (model.dtype, model.quantization) == (torch.float32, "gguf")  # "auto" twice
    assert model.arch.num_layers == 30 and model.hf_config["num_hidden_layers"] == 30
    assert model.max_model_len == model.arch.max_position_embeddings
    # The pool holds what 2 GiB (the default) hold, sized once: a block of 16 tokens costs
    # 2 (K, V) x 16 x 3 KV heads x 64 x 4 bytes (fp32) x 30 layers = 737,280 bytes.
    assert config.cache.block_size == 16 and config.cache.num_blocks == 2912
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.quantization = "none"  # type: ignore[misc]


def test_options_given_by_name_resolve_as_named(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    given = f"{path}/../{path.name}"  # not the canonical spelling of the path
    config = EngineArgs(
        model=given, dtype="bf16", max_model_len=10**6, num_kv_blocks=40, tensor_parallel_size=2
    ).create_engine_config()
    assert config.model.model == given and config.model.path == path.resolve()
    assert config.model.dtype == torch.bfloat16
    assert config.model.quantization == "none"  # an HF checkpoint with "auto"
    assert config.model.max_model_len == 2048  # capped at max_position_embeddings
    assert config.cache.num_blocks == 40
    assert config.draft_model is None


def test_the_pool_is_sized_per_rank_and_for_a_draft_model(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    gb = 0.001
    one = EngineArgs(path, dtype="float32", kv_cache_memory_gb=gb).create_engine_config()
    two = EngineArgs(
        path, dtype="float32", kv_cache_memory_gb=gb, tensor_parallel_size=2
    ).create_engine_config()
    assert two.cache.num_blocks == 2 * one.cache.num_blocks  # half the KV heads per rank
    drafted = EngineArgs(
        path,
        dtype="float32",
        kv_cache_memory_gb=gb,
        speculative_config={"method": "draft_model", "model": path},
    ).create_engine_config()
    assert drafted.draft_model.path == one.model.path
    assert drafted.draft_model.arch == one.model.arch
    assert drafted.cache.num_blocks == one.cache.num_blocks // 2  # both models' KV per block


def test_an_engine_takes_the_resolved_config_not_the_options(tiny_checkpoint):
    """Built from a config whose user string no longer resolves and whose context length
    differs from what the options would give, the engine runs on the resolved values."""
    args = EngineArgs(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=32)
    config = args.create_engine_config()
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, model="/nowhere/model", max_model_len=40)
    )
    engine = LLMEngine.from_engine_config(args, config)
    assert engine.config is config and engine.max_model_len == 40
    assert engine.processor.max_model_len == 40 and engine.kv_manager.num_blocks == 32
    assert engine.runner.dtype == torch.float32
    request = engine.processor.process(
        "r", "hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    engine.add_request(request, "hello")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [d.output for d in engine.step() if d.output is not None]
    assert len(outputs[0].outputs[0].token_ids) == 4
    engine.shutdown()
