"""What a tensor-parallel rank receives: the model and cache parts of rank 0's resolved
config, as JSON through the rendezvous store. It round-trips exactly (the dtype included)
and a rank builds its runner from it without resolving the user's model string again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrt.engine.args import EngineArgs
from agentrt.engine.errors import ModelLoadError
from agentrt.engine.worker.worker import build_runner, decode_worker_config, encode_worker_config


@pytest.fixture(scope="module")
def tiny_config(tiny_checkpoint):
    args = EngineArgs(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=8)
    return args.create_engine_config()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_worker_config_round_trips_through_json(tiny_config, dtype) -> None:
    model = dataclasses.replace(tiny_config.model, dtype=dtype, quantization="int8")
    decoded_model, decoded_cache = decode_worker_config(
        encode_worker_config(model, tiny_config.cache)
    )
    assert decoded_model == model and decoded_model.dtype is dtype
    assert decoded_model.arch == model.arch and decoded_model.path == model.path
    assert decoded_cache == tiny_config.cache and decoded_cache.num_blocks == 8


def test_a_rank_builds_from_the_resolved_path_not_the_users_string(tiny_config) -> None:
    """The user's string names nothing on this "machine"; the resolved path does."""
    model = dataclasses.replace(tiny_config.model, model="/nowhere/model")
    model, cache = decode_worker_config(encode_worker_config(model, tiny_config.cache))
    runner = build_runner(model, cache, torch.device("cpu"), None)
    reference = build_runner(tiny_config.model, tiny_config.cache, torch.device("cpu"), None)
    assert runner.arch == tiny_config.model.arch and runner.dtype == torch.float32
    assert runner.kv_caches[0].shape == (8, 2, 16, 2, 16)  # (blocks, K/V, block, heads, dim)
    for ours, theirs in zip(
        runner.model.state_dict().values(), reference.model.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs)


def test_a_rank_without_the_checkpoint_says_which_path_it_needs(tiny_config, tmp_path) -> None:
    model = dataclasses.replace(tiny_config.model, path=tmp_path / "moved")
    with pytest.raises(ModelLoadError, match="moved.*same checkpoint at the same path"):
        build_runner(model, tiny_config.cache, torch.device("cpu"), None)
