"""Checkpoint resolution and loading; tiny random checkpoints of every supported arch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    load_hf_config,
    load_state_dict,
    resolve_model,
)
from agentrt.engine.loader.gguf_file import embedded_gguf_path
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.model.tiny import TINY_ARCHS, make_tiny_checkpoint

# --- the embedded model through the public API ------------------------------------------


def test_embedded_tokenizer_has_the_chatml_template(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer.encode("John Smith is 42.")) == "John Smith is 42."


def test_embedded_config_and_weights_load(smollm2_dir: Path) -> None:
    config = load_hf_config(smollm2_dir)
    assert config["architectures"] == ["LlamaForCausalLM"]
    state = load_state_dict(smollm2_dir, torch.bfloat16)
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.29.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert "lm_head.weight" not in state
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_gguf_file_path_resolves_to_the_file_itself(smollm2_dir: Path) -> None:
    assert resolve_model(embedded_gguf_path()) == smollm2_dir
    assert resolve_model(str(smollm2_dir)) == smollm2_dir
    assert resolve_model(smollm2_dir.parent) == smollm2_dir  # a directory of one .gguf


# --- tiny checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_loads_in_transformers_and_in_ours(arch: str, tiny_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    assert resolve_model(path) == path.resolve()
    config = load_hf_config(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ in SUPPORTED_ARCHITECTURES
    assert config["architectures"] == [type(model).__name__]
    assert config["vocab_size"] == len(load_tokenizer(path)) == 49152
    state = load_state_dict(path)
    reference = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, reference[name]), name
    tied = config["tie_word_embeddings"]
    assert ("lm_head.weight" in state) == (not tied)
    logits = model(torch.tensor([[1, 330, 2]])).logits
    assert logits.shape == (1, 3, 49152)
    assert torch.isfinite(logits).all()


def test_tiny_architectures_have_their_distinguishing_features(tiny_checkpoint) -> None:
    llama = load_hf_config(tiny_checkpoint("llama"))
    assert llama["rope_parameters"]["rope_type"] == "llama3"
    assert llama["rope_parameters"]["original_max_position_embeddings"] == 64
    assert llama["tie_word_embeddings"] is True

    qwen2 = load_state_dict(tiny_checkpoint("qwen2"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = qwen2[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().sum() > 0  # perturbed: a model that ignores biases must fail
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    assert load_hf_config(tiny_checkpoint("qwen2"))["tie_word_embeddings"] is False

    qwen3_config = load_hf_config(tiny_checkpoint("qwen3"))
    qwen3 = load_state_dict(tiny_checkpoint("qwen3"))
    assert qwen3_config["head_dim"] == 32 != qwen3_config["hidden_size"] // 4
    assert qwen3["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
    assert not torch.equal(qwen3["model.layers.1.self_attn.k_norm.weight"], torch.ones(32))
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)

    mistral = load_hf_config(tiny_checkpoint("mistral"))
    assert mistral["sliding_window"] is None
    assert mistral["num_key_value_heads"] == 2


def test_tiny_checkpoint_is_deterministic_per_seed(tmp_path, smollm2_dir: Path) -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    a = load_state_dict(make_tiny_checkpoint("qwen3", tmp_path / "a", tokenizer_from=smollm2_dir))
    b = load_state_dict(make_tiny_checkpoint("qwen3", tmp_path / "b", tokenizer_from=smollm2_dir))
    c = load_state_dict(
        make_tiny_checkpoint("qwen3", tmp_path / "c", seed=1, tokenizer_from=smollm2_dir)
    )
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # the global RNG was not consumed


def test_unknown_tiny_architecture_is_rejected(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="gpt2.*llama"):
        make_tiny_checkpoint("gpt2", tmp_path)


# --- sharded checkpoints ------------------------------------------------------------------


def _shard(source: Path, out: Path) -> dict[str, torch.Tensor]:
    """Copy a checkpoint into two safetensors shards plus an index, as HF does."""
    state = load_state_dict(source)
    out.mkdir()
    for name in source.iterdir():
        if name.suffix != ".safetensors":
            shutil.copy(name, out / name.name)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(out / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def test_sharded_checkpoint_loads_every_tensor(tmp_path, tiny_checkpoint) -> None:
    sharded = tmp_path / "sharded"
    state = _shard(tiny_checkpoint("qwen2"), sharded)
    assert resolve_model(sharded) == sharded.resolve()
    loaded = load_state_dict(sharded, torch.float16)
    assert set(loaded) == set(state)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float16
        assert torch.equal(tensor, state[name].to(torch.float16)), name


def test_sharded_checkpoint_with_a_missing_shard_names_it(tmp_path, tiny_checkpoint) -> None:
    sharded = tmp_path / "sharded"
    _shard(tiny_checkpoint("qwen2"), sharded)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        resolve_model(sharded)


# --- errors -------------------------------------------------------------------------------


def test_hub_ids_and_missing_paths_are_not_downloaded() -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelLoadError, match="not a local path"):
        resolve_model("/nonexistent/checkpoint")


def test_directory_without_config_or_gguf_is_rejected(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json and no .gguf file"):
        resolve_model(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="exactly one .gguf file.*a.gguf, b.gguf"):
        resolve_model(tmp_path)


def test_file_that_is_not_gguf_is_rejected(tmp_path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(weights)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model(fake)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, tiny_checkpoint) -> None:
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(path)
    message = str(excinfo.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_pytorch_bin_checkpoint_asks_for_safetensors(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model.bin"):
        resolve_model(tmp_path)


def test_broken_config_and_weights_raise_model_load_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not readable JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_state_dict(tmp_path)
    with pytest.raises(ModelLoadError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)
