"""EngineArgs is the one definition of the engine's options: every entry point and every CLI
command takes the same names with the same defaults, and a bad or misspelt option fails the
same way everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import anyio
import pytest
import safetensors.torch
import torch

from agentrt.cli import build_parser
from agentrt.engine.args import EngineArgs
from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ConfigError
from agentrt.engine.sampling_params import SamplingParams
from agentrt.runtime import Runtime
from agentrt.server.state import ServerConfig

COMMANDS = {
    "generate": ["generate", "hello"],
    "chat": ["chat"],
    "extract": ["extract", "--schema", "s.json", "--input", "in.jsonl", "--output", "o.jsonl"],
    "serve": ["serve"],
}
# A value other than the default for every field, as (python value, command-line words).
NON_DEFAULTS = {
    "model": ("/models/m.gguf", ["--model", "/models/m.gguf"]),
    "dtype": ("bfloat16", ["--dtype", "bfloat16"]),
    "quantization": ("none", ["--quantization", "none"]),  # valid with the test device (cuda)
    "device": ("cuda:1", ["--device", "cuda:1"]),
    "max_model_len": (512, ["--max-model-len", "512"]),
    "seed": (7, ["--seed", "7"]),
    "block_size": (32, ["--block-size", "32"]),
    "kv_cache_memory_gb": (0.5, ["--kv-cache-memory-gb", "0.5"]),
    "num_kv_blocks": (100, ["--num-kv-blocks", "100"]),
    "enable_prefix_caching": (False, ["--no-enable-prefix-caching"]),
    "max_num_seqs": (4, ["--max-num-seqs", "4"]),
    "max_num_batched_tokens": (256, ["--max-num-batched-tokens", "256"]),
    "scheduling_policy": ("priority", ["--scheduling-policy", "priority"]),
    "long_prefill_token_threshold": (64, ["--long-prefill-token-threshold", "64"]),
    "jump_forward": (False, ["--no-jump-forward"]),
    "max_waiting_requests": (3, ["--max-waiting-requests", "3"]),
    "attention_backend": ("torch", ["--attention-backend", "torch"]),
    "grammar_timeout_s": (2.5, ["--grammar-timeout-s", "2.5"]),
    "speculative_config": ('{"method": "ngram"}', ["--speculative-config", '{"method": "ngram"}']),
    "tensor_parallel_size": (2, ["--tensor-parallel-size", "2"]),
    "data_parallel_size": (2, ["--data-parallel-size", "2"]),
    "engine_process": (True, ["--engine-process"]),
    "kv_connector": ("storage", ["--kv-connector", "storage"]),
    "kv_role": ("consumer", ["--kv-role", "consumer"]),
    "kv_storage_path": ("/tmp/kv", ["--kv-storage-path", "/tmp/kv"]),
    "kv_host": ("10.0.0.2", ["--kv-host", "10.0.0.2"]),
    "kv_port": (5555, ["--kv-port", "5555"]),
    "kv_transfer_timeout_s": (5.0, ["--kv-transfer-timeout-s", "5"]),
    "kv_hold_timeout_s": (60.0, ["--kv-hold-timeout-s", "60"]),
    "kv_max_held_fraction": (0.25, ["--kv-max-held-fraction", "0.25"]),
    "kv_secret": ("s3cret", ["--kv-secret", "s3cret"]),
    "kv_allowed_producers": ("10.0.0.3:5555", ["--kv-allowed-producers", "10.0.0.3:5555"]),
    "kv_storage_max_gb": (1.5, ["--kv-storage-max-gb", "1.5"]),
}


def test_every_field_has_a_test_value():
    assert set(NON_DEFAULTS) == {f.name for f in dataclasses.fields(EngineArgs)}
    for name, (value, _) in NON_DEFAULTS.items():
        assert value != getattr(EngineArgs(), name), name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_cli_defaults_are_the_dataclass_defaults(command):
    args = build_parser().parse_args(COMMANDS[command])
    assert EngineArgs.from_cli_args(args) == EngineArgs()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_sets_its_field(command):
    words = [w for _, flag in NON_DEFAULTS.values() for w in flag]
    args = build_parser().parse_args(COMMANDS[command] + words)
    expected = EngineArgs(**{name: value for name, (value, _) in NON_DEFAULTS.items()})
    assert EngineArgs.from_cli_args(args) == expected


def test_flags_carry_help_and_default():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "(default: 256)" in text  # max_waiting_requests: one default, here and everywhere
    assert "{fcfs,priority}" in text


def test_server_flags_match_server_config_defaults():
    from agentrt.server.cli import run_serve  # noqa: F401 - the module the flags come from

    args = build_parser().parse_args(["serve"])
    config = ServerConfig()
    assert args.max_request_bytes == config.max_request_bytes
    assert args.drain_timeout == config.drain_timeout_s
    assert config.engine_args == EngineArgs()


def test_misspelt_option_names_the_closest_one_everywhere():
    for make in (
        lambda: EngineArgs.from_options(None, max_num_seq=4),
        lambda: LLM(None, max_num_seq=4),
        lambda: AsyncEngine(max_num_seq=4),
        lambda: Runtime(max_num_seq=4),
    ):
        with pytest.raises(ConfigError, match="'max_num_seq'.*'max_num_seqs'"):
            make()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_waiting_requests", -1),
        ("max_num_seqs", 0),
        ("block_size", 12),
        ("dtype", "int3"),
        ("quantization", "int3"),
        ("quantization", "q4_k"),
        ("attention_backend", "flash"),
        ("grammar_timeout_s", 0),
        ("speculative_config", {"method": "medusa"}),
        ("speculative_config", {"method": "ngram", "num_speculative_tokens": 0}),
        ("speculative_config", {"method": "draft_model"}),  # without a draft model
        ("speculative_config", '{"method": "ngram",'),
        ("tensor_parallel_size", 0),
        ("data_parallel_size", -1),
    ],
)
def test_bad_values_fail_before_anything_loads(option, value):
    """The same ConfigError, naming the option, from every entry point (no model is loaded:
    the check runs first)."""
    for make in (
        lambda: EngineArgs.from_options(None, **{option: value}),
        lambda: LLM(None, **{option: value}),
        lambda: AsyncEngine(**{option: value}),
        lambda: Runtime(**{option: value}),
    ):
        with pytest.raises(ConfigError, match=option.split("_s")[0]):
            make()


def test_speculative_config_as_vllm_takes_it():
    """A dict, a JSON object or the record give the same config; unknown keys name the
    closest one; the number of drafts defaults per method."""
    from agentrt.engine.config import SpeculativeConfig

    record = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=5)
    as_dict = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    for value in (record, as_dict, json.dumps(as_dict)):
        assert EngineArgs(speculative_config=value).create_engine_config().speculative == record
    assert EngineArgs().create_engine_config().speculative is None
    assert SpeculativeConfig("grammar").num_speculative_tokens == 16
    with pytest.raises(ConfigError, match="'num_spec_tokens'.*'num_speculative_tokens'"):
        LLM(None, speculative_config={"method": "ngram", "num_spec_tokens": 2})
    with pytest.raises(ConfigError, match="needs a 'method'"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})


def test_cli_reports_a_bad_value_as_an_error(capsys):
    from agentrt.cli import main

    assert main(["generate", "hi", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs=0 is invalid" in capsys.readouterr().err


def test_built_engine_takes_only_the_front_end_limit(smollm2_llm):
    with pytest.raises(ConfigError, match="already built"):
        AsyncEngine(engine=smollm2_llm.engine, dtype="bfloat16")
    engine = AsyncEngine(engine=smollm2_llm.engine, max_waiting_requests=5)
    assert engine.max_waiting_requests == 5
    # Without the option, the built engine's own setting applies.
    assert AsyncEngine(engine=smollm2_llm.engine).max_waiting_requests == (
        smollm2_llm.engine.args.max_waiting_requests
    )


def test_remote_runtime_refuses_engine_options():
    with pytest.raises(ConfigError, match="remote server"):
        Runtime(base_url="http://127.0.0.1:9/v1", dtype="bfloat16")


def test_runtime_passes_options_to_its_engine(tiny_checkpoint):
    async def main():
        path = str(tiny_checkpoint("llama"))
        async with Runtime(path, dtype="float32", max_num_seqs=3, kv_cache_memory_gb=0.01) as rt:
            engine = rt.engine.engine
            return engine.scheduler_config.max_num_seqs, engine.model_config.dtype

    max_num_seqs, dtype = anyio.run(main)
    assert max_num_seqs == 3
    assert str(dtype) == "torch.float32"


def test_auto_dtype_follows_the_configured_device():
    """fp32 for a CPU model even on a machine with a GPU; bf16 for a CUDA one."""
    assert str(EngineArgs(device="cpu").create_engine_config().model.dtype) == "torch.float32"
    assert str(EngineArgs(device="cuda:0").create_engine_config().model.dtype) == "torch.bfloat16"


@pytest.mark.parametrize(("stored", "auto"), [("bfloat16", "bfloat16"), ("float16", "float32")])
def test_auto_dtype_on_the_cpu_keeps_a_bf16_checkpoint_in_bf16(
    tmp_path, tiny_checkpoint, stored, auto
):
    """A bf16 HF checkpoint runs in bf16 on the CPU (half the bytes of fp32, and faster:
    docs/engine.md); an fp16 one in fp32 (torch's fp16 CPU matmuls are the slow ones)."""
    path = tmp_path / stored
    shutil.copytree(tiny_checkpoint("llama"), path)
    weights = safetensors.torch.load_file(path / "model.safetensors")
    want = getattr(torch, stored)
    safetensors.torch.save_file(
        {k: v.to(want) for k, v in weights.items()}, path / "model.safetensors", {"format": "pt"}
    )
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = stored
    (path / "config.json").write_text(json.dumps(config))
    assert EngineArgs(model=str(path)).create_engine_config().model.dtype == getattr(torch, auto)
    llm = LLM(str(path), kv_cache_memory_gb=0.01)
    params = {p.dtype for p in llm.engine.runner.model.parameters()}
    assert params == {getattr(torch, auto)}  # held once, in the dtype it runs in
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["Once upon a time"], greedy)[0].outputs[0].token_ids) == 6


def test_a_config_file_gives_runtime_its_options(tmp_path, tiny_checkpoint):
    """`Runtime(config=FILE)` reads engine options from JSON, flat or under "engine_args"
    (as `agentrt tune` writes it); options given in the call win."""
    path = str(tiny_checkpoint("llama"))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"model": path, "max_num_seqs": 3, "kv_cache_memory_gb": 0.01}))
    tuned = tmp_path / "tuned.json"
    tuned.write_text(
        json.dumps({"engine_args": {"max_num_seqs": 5, "block_size": 32}, "goodput": 1.5})
    )
    assert Runtime(config=flat)._local.args.max_num_seqs == 3
    assert Runtime(config=flat)._local.args.model == path
    args = Runtime(path, config=tuned, max_num_seqs=7)._local.args
    assert (args.model, args.max_num_seqs, args.block_size) == (path, 7, 32)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"max_num_seq": 4}', "'max_num_seq'.*'max_num_seqs'"),
        ("[1, 2]", "expected a JSON object"),
        ("{", "cannot read the config file"),
        ('{"block_size": 12}', "block_size"),
    ],
)
def test_a_bad_config_file_names_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        Runtime(config=path)
    with pytest.raises(ConfigError, match="cannot read"):
        Runtime(config=tmp_path / "missing.json")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_config_flag_reads_a_file_that_flags_override(tmp_path, command):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"engine_args": {"max_num_seqs": 5, "block_size": 32}}))
    args = build_parser().parse_args(
        COMMANDS[command] + ["--config", str(path), "--max-num-seqs", "7"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_num_seqs, engine_args.block_size) == (7, 32)
    assert engine_args.max_num_batched_tokens == EngineArgs().max_num_batched_tokens
