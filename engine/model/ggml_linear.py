"""Layers over GGML block-format weights (kernels/ggml_linear.py runs them).

`GGMLLinear` is a projection whose weight is the concatenation, along the output rows, of
one or more parts: a fused qkv or gate_up whose parts may have different block types
(Q4_K_M stores attn_q / attn_k as Q4_K and attn_v as Q6_K), so each part keeps its own
`GGMLWeight` (a view of the file's memory map) and writes its columns of the output. A part
may also be dense (an F16 tensor of the file, a rank's dequantized slice): an fp32 matrix.
`GGMLEmbedding` looks rows of a block-format embedding up; a tied output projection runs the
same `GGMLWeight` through `GGMLLinear`, so the vocabulary is held once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.kernels.ggml_linear import GGMLWeight, ggml_embedding, ggml_linear, ggml_linear_bf16

Part = torch.Tensor | GGMLWeight


class GGMLLinear(nn.Module):
    """y = x @ W.T (+ bias), W = cat(parts) (N, K). Output fp32 (forward: cast back to the
    input's dtype) or bf16 (`forward_bf16`, the fused CPU glue's products)."""

    def __init__(self, parts: list[Part], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weights = [p if isinstance(p, GGMLWeight) else p.float().contiguous() for p in parts]
        sizes = [p.out_features if isinstance(p, GGMLWeight) else p.shape[0] for p in parts]
        self.spans = []
        start = 0
        for size in sizes:
            self.spans.append((start, start + size))
            start += size
        self.out_features = start
        self.in_features = (
            parts[0].in_features if isinstance(parts[0], GGMLWeight) else (parts[0].shape[1])
        )
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (T, K)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        self.product_into(flat.contiguous(), out)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) bf16, contiguous -> (T, N) bf16, without the bias (the fused CPU path,
        llama.py, adds a qkv bias in fp32 in rope_qkv)."""
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        self.product_into(x, out)
        return out

    def product_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out (T, N) = x (T, K) @ W.T, without the bias. x fp32 or bf16, contiguous; out
        fp32, or bf16 for bf16 x (each sum rounded once from fp32), its rows contiguous (a
        row range of a wider buffer: the MoE's experts write their runs of rows so)."""
        bf16 = out.dtype == torch.bfloat16
        product = ggml_linear_bf16 if bf16 else ggml_linear
        if len(self.weights) == 1 and not isinstance(self.weights[0], torch.Tensor):
            product(x, self.weights[0], out=out)
            return
        for w, (start, stop) in zip(self.weights, self.spans, strict=True):
            if isinstance(w, torch.Tensor):
                out[:, start:stop] = F.linear(x.float(), w)
            else:
                product(x, w, out=out[:, start:stop])  # each part writes its columns


class GGMLEmbedding(nn.Module):
    """Rows of a block-format embedding (vocab, hidden), dequantized to `dtype` on lookup.
    `read_rows` (the loader's `row_reader`, for a lookup-only embedding in a file) reads
    the rows from the file instead of gathering them from `weight`'s memory."""

    def __init__(self, part: GGMLWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = part
        self.dtype = dtype
        self.read_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ggml_embedding(ids, self.weight, read_rows=self.read_rows).to(self.dtype)
