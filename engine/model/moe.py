"""A sparse mixture-of-experts MLP (Qwen3-MoE, the Mixtral layout): a router scores every
expert per token, each token runs its top k experts' gated MLPs, and their outputs are
summed with the router's weights (softmax over all experts, the top k renormalised to
sum to one when `norm_topk_prob`), as transformers computes it.

A step's tokens are grouped by expert: each chosen expert runs once over all the tokens
that chose it, so its weights are read once per step, not once per token, and a decode
of one request reads only its k experts. Each expert's projections are the loader's (a
GGMLLinear over the GGUF's own blocks: a 3-D `ffn_*_exps` tensor is one expert's rows
after another, engine/loader/gguf_loader.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        logits = self.gate(hidden)  # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(hidden)
        for expert_id in chosen.unique().tolist():  # ascending, as transformers sums them
            token_idx, slot = torch.where(chosen == expert_id)
            expert = self.experts[expert_id]
            gate, up = expert.gate_up_proj(hidden[token_idx]).chunk(2, dim=-1)
            y = expert.down_proj(self.act(gate) * up) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out
