"""Whether a model fits before anything is allocated: weights + KV pool vs free memory.

The weights are counted from the checkpoint's tensor table (no tensor is read), in the
format `quantization` holds them (a GGUF's own blocks: their bytes in the file; dense: the
elements times the dtype's size); the KV pool as `kv_pool_blocks` sizes it, on every rank.
Free memory is the OS's `MemAvailable` on the CPU (page cache it may reclaim included) and
the device's free memory on CUDA. The CPU pool is mapped lazily (worker/model_runner.py), so a
model refused here would fail later, under load, with the pool filling up: refusing at
once, with the numbers and the options that would make it fit, is the useful answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.errors import ModelTooLargeError
from agentrt.engine.loader.weights import Split, parameter_specs
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.kernels.ggml_linear import GGMLType

GiB = 2**30
# Beyond weights and KV: activations of a step, torch and the kernels' own memory.
OVERHEAD_BYTES = GiB // 2
# Bytes per element of the block types int8 / int4 quantize to (34 / 32, 20 / 32).
_BYTES_PER_ELEMENT = {GGMLType.Q8_0: 34 / 32, GGMLType.Q4_1: 20 / 32}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weight_bytes: int  # every rank's weights, in the format they are held in
    kv_bytes: int  # every rank's KV pool
    available_bytes: int | None  # None: unknown on this platform (nothing is checked)

    @property
    def fits(self) -> bool:
        needed = self.weight_bytes + self.kv_bytes + OVERHEAD_BYTES
        return self.available_bytes is None or needed <= self.available_bytes


def weight_bytes(
    tensors: dict[str, tuple[int, int, int | None]],
    arch: ModelArchConfig,
    dtype: torch.dtype,
    quantization: str,
    tp_size: int,
) -> int:
    """Bytes of the weights on all `tp_size` ranks. `tensors`: HF name -> (elements, bytes
    stored, GGML block type or None for dense), as a loader's `tensor_table()` gives."""
    total = 0.0
    for spec in parameter_specs(arch):
        copies = tp_size if spec.split is Split.NONE else 1  # replicated on every rank
        vocabulary = spec.name in ("embed_tokens.weight", "lm_head.weight")
        for name in spec.parts:
            if name not in tensors:
                continue
            numel, stored, qtype = tensors[name]
            if not (spec.is_projection or vocabulary) or quantization == "none":
                held = numel * dtype.itemsize
            elif quantization == "gguf":
                held = stored if qtype is not None else numel * dtype.itemsize
            elif quantization == "int4" and not vocabulary:
                held = numel * _BYTES_PER_ELEMENT[GGMLType.Q4_1]
            else:
                held = numel * _BYTES_PER_ELEMENT[GGMLType.Q8_0]
            total += held * copies
    return int(total)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for this model on `device` (None where it cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fit(estimate: MemoryEstimate, *, quantization: str, device: torch.device) -> None:
    """Raise `ModelTooLargeError` with the numbers and what would fit, unless it fits."""
    if estimate.fits:
        return
    assert estimate.available_bytes is not None
    room_for_kv = estimate.available_bytes - estimate.weight_bytes - OVERHEAD_BYTES
    options = []
    if room_for_kv > 0.01 * GiB:
        options.append(
            f"a smaller KV pool: --kv-cache-memory-gb {room_for_kv / GiB * 0.9:.2f} "
            "(kv_cache_memory_gb=; or fewer --num-kv-blocks)"
        )
    if quantization == "none":
        options.append(
            "smaller weights: quantization 'gguf' for a GGUF file (its own blocks, on the "
            "CPU), 'int8' or 'int4' for an HF checkpoint"
        )
    elif quantization in ("gguf", "int8"):
        options.append("a smaller quantization: a Q4_K_M / Q4_0 GGUF file, or 'int4'")
    options.append("a smaller model")
    raise ModelTooLargeError(
        f"the model does not fit in the memory free on {device.type}: weights "
        f"{estimate.weight_bytes / GiB:.2f} GiB (quantization {quantization!r}) + KV pool "
        f"{estimate.kv_bytes / GiB:.2f} GiB + {OVERHEAD_BYTES / GiB:.1f} GiB for activations "
        f"> {estimate.available_bytes / GiB:.2f} GiB available. Options: "
        + "; ".join(options)
        + ".",
        weight_bytes=estimate.weight_bytes,
        kv_bytes=estimate.kv_bytes,
        available_bytes=estimate.available_bytes,
    )
