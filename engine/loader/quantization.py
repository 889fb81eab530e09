"""Which format each weight is held in: `quantization` made concrete, per part.

    none   every weight dense in the engine's dtype (a GGUF's blocks dequantized once, at
           load, in memory: the exact reference, and the CUDA path)
    gguf   a GGUF's own block formats (Q4_K_M's mixture of Q4_K and Q6_K, the embedded
           model's Q4_1 and Q8_0 ...) through the kernels package's GGML kernels; its
           F32 / F16 / BF16 tensors dense
    int8   projections, embedding and output in Q8_0 (blocks of 32, one fp16 scale each):
           a checkpoint's weights quantized at load (a tensor already Q8_0 kept as it is)
    int4   projections in Q4_1 (blocks of 32, a scale and a min; a Q4_0 / Q4_1 tensor kept
           as it is), embedding and output in Q8_0 (int4 there costs the quality
           the benchmark shows)
    auto   gguf for a GGUF on the CPU with dtype "auto"; else none

Norms and biases are always dense. One format in memory per weight: a quantized weight has
no dense copy beside it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from agentrt.engine.errors import ConfigError
from agentrt.engine.loader.weights import Part
from agentrt.kernels.ggml_linear import GGMLType, GGMLWeight, block_shape

logger = logging.getLogger(__name__)

QUANTIZED_MODES = ("gguf", "int8", "int4")


def resolve_quantization(
    requested: str, dtype: str | torch.dtype, device: str, is_gguf: bool
) -> str:
    """`requested` with "auto" made concrete (module table): "gguf" when the model is a
    GGUF, it runs on the CPU and `dtype` is "auto" too (a dtype asked for by name means
    those weights, exactly); else "none". Raises ConfigError for "gguf" on a non-GGUF."""
    if requested == "gguf" and not is_gguf:
        raise ConfigError(
            "quantization='gguf' runs a GGUF file's own block formats, and this model is an "
            "HF checkpoint: use 'int8' or 'int4' to quantize it at load, or 'none'."
        )
    if requested != "auto":
        return requested
    return "gguf" if is_gguf and device == "cpu" and dtype == "auto" else "none"


def weight_format(part: Part, mode: str, *, vocabulary: bool) -> int | None:
    """The block type `part` is held in under `mode` (None: dense). `vocabulary`: the
    embedding or output projection, else a layer projection."""
    stored = part.qtype if isinstance(part, GGMLWeight) else None
    if mode == "gguf":
        return stored
    if mode == "int8" or (mode == "int4" and vocabulary):
        return int(GGMLType.Q8_0)
    if mode == "int4":
        return stored if stored in (GGMLType.Q4_0, GGMLType.Q4_1) else int(GGMLType.Q4_1)
    return None


def convert(part: Part, qtype: int | None, dtype: torch.dtype, name: str) -> Part:
    """`part` in format `qtype` (None: dense `dtype`)."""
    if isinstance(part, GGMLWeight):
        if part.qtype == qtype:
            return part
        dense = part.dequantize(torch.float32 if qtype is not None else dtype)
    else:
        dense = part
    if qtype is None:
        return dense.to(dtype).contiguous()
    return requantize(dense, qtype, name)


def requantize(weight: torch.Tensor, qtype: int, name: str) -> Part:
    """weight (N, K) quantized to `qtype` blocks by gguf-py (round to nearest); K not a
    multiple of the block stays dense fp32."""
    import gguf

    block_size = block_shape(qtype)[0]
    if weight.shape[-1] % block_size:
        logger.warning(
            "%s: %d columns are not whole blocks of %d; kept dense",
            name,
            weight.shape[-1],
            block_size,
        )
        return weight.float().contiguous()
    values = np.ascontiguousarray(weight.float().numpy())
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType(qtype))  # (N, row bytes)
    return GGMLWeight(torch.from_numpy(blocks), qtype, weight.shape[-1])
