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

On the fused CPU glue with block-format experts the whole MLP is one C call instead
(kernels/ggml_experts.py, `SparseMoE.expert_kernel`): the same operations in the same order,
so the same bits for the same routing (its router sums in its own fp32 order), without the
~20 Python and torch calls between the products (1.5x a decode step's layer on one thread);
the one-call decoder (kernels/cpu_decoder.py) calls it from C, layer after layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.engine.model.ggml_linear import GGMLLinear
from agentrt.kernels.errors import KernelInputError
from agentrt.kernels.ggml_experts import ExpertKernel, gated_address
from agentrt.kernels.ggml_linear import GGMLWeight

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
        # The one-call C path (kernels/ggml_experts.py), made on the first fused step:
        # (the `gated` it was made for, the kernel or None where it cannot run).
        self._kernel: tuple[object, ExpertKernel | None] | None = None

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
        silu_mul on bf16), instead of `act(gate) * up` by torch ops. On that path, with
        block-format experts, the whole MLP is one C call (`expert_kernel`)."""
        if gated is not None and hidden.dtype == torch.bfloat16:
            kernel = self.expert_kernel(gated)
            if kernel is not None:
                return kernel.forward(hidden)
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

    def expert_kernel(self, gated: GatedAct) -> ExpertKernel | None:
        """The layer as one C call (kernels/ggml_experts.py: the router, the chosen experts'
        products and the glue, the same operations as `forward`'s), or None where it cannot
        run it: experts not all in block formats of one type and shape, a router not fp32,
        or a `gated` that is not the fused glue's C activation. Made once per `gated` (the
        weights' addresses read then: the loader does not replace experts after loading)."""
        if self._kernel is not None and self._kernel[0] == gated:
            return self._kernel[1]
        self._kernel = (gated, self._make_kernel(gated))
        return self._kernel[1]

    def _make_kernel(self, gated: GatedAct) -> ExpertKernel | None:
        address = gated_address(gated)
        projections = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        if address is None or self.gate.weight.dtype != torch.float32:
            return None
        for gate_up, down in projections:
            for proj in (gate_up, down):
                if not isinstance(proj, GGMLLinear) or proj.bias is not None:
                    return None
                if not all(isinstance(w, GGMLWeight) for w in proj.weights):
                    return None
            if len(down.weights) != 1:
                return None
        try:
            return ExpertKernel(
                self.gate.weight.data.contiguous(),
                [gate_up.weights for gate_up, _ in projections],
                [down.weights[0] for _, down in projections],
                self.top_k,
                self.norm_topk_prob,
                address,
            )
        except KernelInputError:
            return None  # experts of differing types or shapes: the per-expert path

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
