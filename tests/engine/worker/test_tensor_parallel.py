"""Tensor parallelism: the model split across ranks (gloo on the CPU) gives the same greedy
fp32 tokens as one rank, with structured output and prefix caching; workers started by the
engine or by torchrun-style rendezvous; bad sizes and dead workers fail clearly."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ConfigError, EngineDeadError
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict
from agentrt.engine.loader.load import load_weights
from agentrt.engine.loader.safetensors_loader import SafetensorsLoader
from agentrt.engine.loader.weights import Shard
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.llama import LlamaForCausalLM
from agentrt.engine.model.parallel import check_tensor_parallel, shard_arch
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams
from agentrt.engine.worker.worker import decode_worker_config

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURED = SamplingParams(
    max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(json=PERSON)
)
PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land far away,"]
# Longer than two KV blocks (16 tokens each), so a request sharing it hits the prefix cache.
SHARED = "You are a careful assistant who answers briefly and checks every fact twice. " * 3


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint) -> Path:
    path = tiny_checkpoint("llama")
    arch = ModelArchConfig.from_hf_dict(load_hf_config(path))
    assert (arch.num_heads, arch.num_kv_heads, arch.intermediate_size) == (4, 2, 128)
    return path


@pytest.fixture(scope="module")
def tiny_tp1(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def tiny_tp2(tiny_llama: Path):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_tp2_shards_heads_and_kv_cache(tiny_tp2: LLM) -> None:
    runner = tiny_tp2.engine.runner
    assert (runner.arch.num_heads, runner.arch.num_kv_heads) == (2, 1)  # half of (4, 2)
    assert runner.kv_caches[0].shape == (64, 2, 16, 1, 16)  # one KV head per rank
    assert runner.model.layers[0].qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)
    assert runner.model.layers[0].down_proj.weight.shape == (64, 64)  # 128 / 2 input columns


def test_ranks_receive_rank_0s_resolved_model_and_cache(tiny_tp2: LLM) -> None:
    """The workers build from the parts of rank 0's resolved config (the checkpoint's path,
    the dtype by its canonical name, the pool as sized), not from the user's options."""
    sent = tiny_tp2.engine.executor.store.get("config")
    config = tiny_tp2.engine.config
    assert decode_worker_config(sent) == (config.model, config.cache)
    assert json.loads(sent)["model"]["dtype"] == "float32"
    assert json.loads(sent)["model"]["path"] == str(config.model.path)


def test_tp2_greedy_matches_tp1(tiny_tp1: LLM, tiny_tp2: LLM) -> None:
    assert token_ids(tiny_tp2, PROMPTS, GREEDY) == token_ids(tiny_tp1, PROMPTS, GREEDY)


def test_tp2_structured_output_matches_tp1(tiny_tp1: LLM, tiny_tp2: LLM) -> None:
    prompt = ["Extract the person as JSON: Ada Lovelace, 36."]
    tp1, tp2 = tiny_tp1.generate(prompt, STRUCTURED)[0], tiny_tp2.generate(prompt, STRUCTURED)[0]
    assert tp2.outputs[0].token_ids == tp1.outputs[0].token_ids
    assert tp2.outputs[0].finish_reason == "stop"  # the object closed: valid JSON
    assert set(json.loads(tp2.outputs[0].text)) == {"name", "age"}


def test_tp2_prefix_cache_hit_matches_tp1(tiny_tp1: LLM, tiny_tp2: LLM) -> None:
    for llm in (tiny_tp1, tiny_tp2):
        llm.reset_prefix_cache()
    first, second = SHARED + "Question one:", SHARED + "Question two, a different one:"
    expected = [tiny_tp1.generate([p], GREEDY)[0] for p in (first, second)]
    assert token_ids(tiny_tp2, [first], GREEDY) == [expected[0].outputs[0].token_ids]
    out = tiny_tp2.generate([second], GREEDY)[0]
    assert out.num_cached_tokens >= 32  # the shared blocks came from the cache
    assert out.num_cached_tokens == expected[1].num_cached_tokens
    assert out.outputs[0].token_ids == expected[1].outputs[0].token_ids


def test_tp2_torch_attention_and_draft_model_match_tp1(tiny_llama: Path) -> None:
    """The torch attention backend and a draft model (run whole on rank 0) under TP=2 give
    TP=1's greedy tokens with the same options."""
    options = dict(
        dtype="float32",
        num_kv_blocks=64,
        attention_backend="torch",
        speculative_config={"method": "draft_model", "model": str(tiny_llama)},
    )
    expected = token_ids(LLM(str(tiny_llama), **options), PROMPTS, GREEDY)
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **options)
    try:
        assert token_ids(llm, PROMPTS, GREEDY) == expected
        assert llm.stats().spec_decode.num_accepted_tokens > 0
    finally:
        llm.shutdown()


# TP=1 runs the quantized tiny Llama through the fused CPU glue (bf16 rows between the
# products), TP=2 through torch's fp32 glue, and each rank quantizes its share of the
# activations to int8 blocks: next-token logprobs measured up to 0.18 apart (int8 and int4).
TOLERANCE = 0.25


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_quantized_logprobs_close_to_tp1(tiny_llama: Path, quantization: str) -> None:
    """Quantized weights (Q8_0 / Q4_1 blocks of each rank's slices) under TP=2. Not token for
    token (see TOLERANCE), so greedy runs may part at a near-tie; this
    compares the next-token distributions, teacher-forced along TP=1's output."""
    options = dict(dtype="float32", num_kv_blocks=64, quantization=quantization)
    tp1 = LLM(str(tiny_llama), **options)
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    continued = [p + ids for p, ids in zip(prompts, token_ids(tp1, prompts, GREEDY), strict=True)]
    forced = [c[: len(p) + k] for p, c in zip(prompts, continued, strict=True) for k in (0, 12, 23)]
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    expected = [o.outputs[0].logprobs[0] for o in tp1.generate(forced, one)]
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **options)
    try:
        got = [o.outputs[0].logprobs[0] for o in llm.generate(forced, one)]
    finally:
        llm.shutdown()
    for want, have in zip(expected, got, strict=True):
        assert max(want, key=lambda t: want[t].logprob) in have  # TP=1's pick is in the top 5
        for token in set(want) & set(have):
            assert abs(want[token].logprob - have[token].logprob) < TOLERANCE


def test_each_rank_loads_its_slices_of_the_checkpoint(tiny_llama: Path) -> None:
    """A rank's model holds exactly its slices of the full weights (column-parallel rows of
    q/k/v and gate/up, row-parallel columns of o and down; the rest whole), read by the
    safetensors loader slice by slice."""
    state = load_state_dict(tiny_llama)
    arch = ModelArchConfig.from_hf_dict(load_hf_config(tiny_llama))
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."

    for rank in range(2):
        with torch.device("meta"):
            model = LlamaForCausalLM(shard_arch(arch, 2), max_positions=1)
        load_weights(
            model,
            SafetensorsLoader(tiny_llama),
            arch,
            shard=Shard(rank, 2),
            dtype=torch.float32,
            device=torch.device("cpu"),
            quantization="none",
        )
        layer = model.layers[1]

        def half(name: str, dim: int, rank: int = rank) -> torch.Tensor:
            return state[name].chunk(2, dim)[rank]

        qkv = torch.cat([half(f"{attn}{n}_proj.weight", 0) for n in "qkv"])
        assert torch.equal(layer.qkv_proj.weight, qkv)
        assert torch.equal(layer.o_proj.weight, half(f"{attn}o_proj.weight", 1))
        gate_up = torch.cat([half(f"{mlp}{n}_proj.weight", 0) for n in ("gate", "up")])
        assert torch.equal(layer.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.down_proj.weight, half(f"{mlp}down_proj.weight", 1))
        embed = model.embed_tokens.weight
        assert torch.equal(embed, state["model.embed_tokens.weight"])


@pytest.mark.slow
def test_tp3_embedded_matches_tp1(smollm2_llm: LLM) -> None:
    """The embedded model (9 query heads, 3 KV heads) on 3 ranks: 3 and 1 per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Ada Lovelace is 36."]
    params = [GREEDY, GREEDY, STRUCTURED]
    # One batch on each (fp32 steps stream the whole model: the steps of the longest only).
    *expected, expected_json = (o.outputs[0] for o in smollm2_llm.generate(prompts, params))
    llm = LLM(None, dtype="float32", kv_cache_memory_gb=0.25, tensor_parallel_size=3)
    try:
        assert llm.engine.runner.kv_caches[0].shape[3] == 1  # one KV head per rank
        *plain, structured = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in plain] == [o.token_ids for o in expected]
        structured = structured.outputs[0]
        assert structured.token_ids == expected_json.token_ids
        assert structured.text == expected_json.text
    finally:
        llm.shutdown()


def test_two_nodes_by_rendezvous_env(tiny_llama: Path, tiny_tp1: LLM, monkeypatch) -> None:
    """Rank 1 as its own process (`python -m agentrt.engine.worker.worker`), as on a second machine;
    this process is rank 0 by RANK=0: the engine starts no workers of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "agentrt.engine.worker.worker"],
        env={**os.environ, **rendezvous, "RANK": "1", "LOCAL_RANK": "0"},
    )
    try:
        for name, value in {**rendezvous, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
        assert llm.engine.executor.processes == []  # rank 1 is the one started above
        assert token_ids(llm, PROMPTS, GREEDY) == token_ids(tiny_tp1, PROMPTS, GREEDY)
        llm.shutdown()
        assert worker.wait(timeout=30) == 0  # the worker left when rank 0 shut down
    finally:
        worker.kill()
        worker.wait()


def test_worker_rank_is_refused_by_the_engine(tiny_llama: Path, monkeypatch) -> None:
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ConfigError, match=r"RANK=1.*python -m agentrt.engine.worker.worker"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)


def test_heads_not_divisible_names_the_counts() -> None:
    """The embedded model has 9 query heads and 3 KV heads: 2 ranks cannot split them; the
    error comes from the model's config, before any worker starts."""
    with pytest.raises(ConfigError) as info:
        LLM(None, dtype="float32", kv_cache_memory_gb=0.25, tensor_parallel_size=2)
    message = str(info.value)
    assert "tensor_parallel_size=2" in message
    assert "9 query heads" in message and "3 KV heads" in message
    assert "Allowed sizes for this model: 1, 3" in message


def test_unsupported_combinations_are_refused(tiny_llama: Path) -> None:
    arch = ModelArchConfig.from_hf_dict(load_hf_config(tiny_llama))
    check_tensor_parallel(arch, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2.*intermediate size 97"):
        check_tensor_parallel(dataclasses.replace(arch, intermediate_size=97), 2)
    with pytest.raises(ConfigError, match="AsyncEngine, Runtime and `agentrt serve`"):
        LLM(str(tiny_llama), num_kv_blocks=64, engine_process=True)
    with pytest.raises(ConfigError, match="data_parallel_size=1"):
        LLM(str(tiny_llama), num_kv_blocks=64, data_parallel_size=2)


def test_killed_worker_fails_the_engine_without_hanging(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    (worker,) = llm.engine.executor.processes
    worker.kill()
    worker.wait()
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, GREEDY)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion below
            errors.append(exc)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung after a worker died"
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)
    assert "tensor-parallel rank 0 of 2" in str(errors[0])
    with pytest.raises(EngineDeadError):  # and it stays dead
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()


def test_workers_exit_when_the_engine_is_garbage_collected(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    (worker,) = llm.engine.executor.processes
    assert token_ids(llm, PROMPTS[:1], GREEDY)
    del llm
    gc.collect()
    assert worker.wait(timeout=30) == 0
