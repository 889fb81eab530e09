"""A sparse mixture-of-experts MLP (Qwen3-MoE, the Mixtral layout): a router scores every
expert per token, each token runs its top k experts' gated MLPs, and their outputs are
summed with the router's weights (softmax over all experts, the top k renormalised to
sum to one when `norm_topk_prob`), as transformers computes it.

Expert-batched: a step's T * k (token, expert) pairs are sorted by expert (`ExpertGroups`),
the tokens' rows gathered in that order, and each chosen expert runs once over its
contiguous run of rows, writing into one shared buffer: so each expert's weights are read
once per step, not once per token, a decode of one request reads only its k experts, and
the glue between the products (activation, routing weights, the sum) is one op each over
all rows, not one per expert. Each expert's projections are the loader's (a GGMLLinear
over the GGUF's own blocks: a 3-D `ffn_*_exps` tensor is one expert's rows after another,
engine/loader/gguf_loader.py; or dense `nn.Linear`s of an HF checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.engine.model.ggml_linear import GGMLLinear

GatedAct = Callable[[torch.Tensor], torch.Tensor]  # (R, 2 I) gate then up -> (R, I)


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A step's (token, expert) choices sorted by expert, stably over the choices taken slot
    by slot (all tokens' first expert, then all their second ...): sorted row r is choice
    `order[r]` of that (k, T) order, of token `token_ids[r]`. `spans` lists each chosen
    expert's run of rows (expert, start, stop), experts ascending: transformers' order, both
    of an expert's rows (its product's rows, which a BLAS may round by position) and of the
    sum over a token's experts."""

    order: torch.Tensor  # (k * T,) int64
    token_ids: torch.Tensor  # (k * T,) int64
    spans: list[tuple[int, int, int]]

    @staticmethod
    def of(chosen: torch.Tensor, num_experts: int) -> ExpertGroups:
        """`chosen` (T, k) int64: each token's experts."""
        flat = chosen.t().reshape(-1)  # (k * T,), slot-major
        order = torch.argsort(flat, stable=True)
        spans, start = [], 0
        for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
            if count:
                spans.append((expert, start, start + count))
                start += count
        return ExpertGroups(order, order % chosen.shape[0], spans)


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size) for _ in range(num_experts)
        )
        self.top_k, self.norm_topk_prob, self.act = top_k, norm_topk_prob, act
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden) -> (weights (T, k) in the router's dtype, chosen (T, k))."""
        logits = F.linear(hidden.to(self.gate.weight.dtype), self.gate.weight)  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def forward(self, hidden: torch.Tensor, gated: GatedAct | None = None) -> torch.Tensor:
        """hidden (T, hidden) fp32 or bf16 -> (T, hidden), same dtype. `gated`: the
        activation of the gate times up over the (rows, 2 I) products (the fused CPU glue's
        silu_mul on bf16), instead of `act(gate) * up` by torch ops."""
        weights, chosen = self.route(hidden)
        groups = ExpertGroups.of(chosen, len(self.experts))
        rows = hidden.index_select(0, groups.token_ids)  # (k * T, hidden), by expert
        gate_up = self._products(rows, groups, 2 * self.intermediate_size, up=True)
        if gated is None:
            gate, up = gate_up.chunk(2, dim=-1)
            gated_rows = self.act(gate) * up  # (k * T, I)
        else:
            gated_rows = gated(gate_up)
        out = self._products(gated_rows, groups, self.hidden_size, up=False)
        out = out * weights.t().reshape(-1, 1)[groups.order]  # (k * T, hidden) in the router's
        total = torch.zeros(hidden.shape, dtype=out.dtype)  # dtype: summed there, not in bf16
        return total.index_add_(0, groups.token_ids, out).to(hidden.dtype)

    def _products(
        self, rows: torch.Tensor, groups: ExpertGroups, width: int, up: bool
    ) -> torch.Tensor:
        """rows (R, K) by expert -> (R, width): each expert's gate_up (`up`) or down
        projection of its run of rows, written into one buffer of the rows' dtype."""
        out = torch.empty(rows.shape[0], width, dtype=rows.dtype)
        for expert, start, stop in groups.spans:
            proj = self.experts[expert].gate_up_proj if up else self.experts[expert].down_proj
            if isinstance(proj, GGMLLinear):
                proj.product_into(rows[start:stop], out[start:stop])
            else:
                out[start:stop] = F.linear(rows[start:stop], proj.weight)
        return out
