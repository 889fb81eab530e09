"""Test and benchmark helpers for the GGML block formats (kernels/ggml_linear.py): random
blocks of every quantized type."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from agentrt.kernels.ggml_linear import GGMLWeight, block_shape

_Q = gguf.GGMLQuantizationType


# Byte offsets of each quantized type's fp16 scale fields (d, dmin) within its block.
FP16_FIELDS = {
    _Q.Q4_0: (0,),
    _Q.Q4_1: (0, 2),
    _Q.Q5_0: (0,),
    _Q.Q5_1: (0, 2),
    _Q.Q8_0: (0,),
    _Q.Q2_K: (80, 82),
    _Q.Q3_K: (108,),
    _Q.Q4_K: (0, 2),
    _Q.Q5_K: (0, 2),
    _Q.Q6_K: (208,),
}


def random_weight(qtype: int, n: int, k: int, seed: int = 0, scale: float = 0.01) -> GGMLWeight:
    """Random blocks of a quantized type (tests, benchmarks, synthetic files): random bytes
    are valid blocks of every type once the fp16 scale fields hold finite values, here
    normal with std `scale`."""
    elems, size = block_shape(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
    for offset in FP16_FIELDS[_Q(qtype)]:
        scales = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return GGMLWeight(torch.from_numpy(blocks.reshape(n, -1)), int(qtype), k)
