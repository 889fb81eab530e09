"""The one-call MoE layer (kernels/ggml_experts.c) against the per-expert path: for the same
routing, bit for bit the products of ggml_linear_bf16 token by token (every instruction set
this CPU runs) and engine/model/moe.py's expert-batched path; with its own router (fp32
sums in another order than torch's), within a rounding of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.engine import envs
from agentrt.engine.model.ggml_linear import GGMLLinear
from agentrt.engine.model.moe import SparseMoE
from agentrt.kernels import KernelInputError, load_cpu_ops
from agentrt.kernels.ggml_experts import ExpertKernel, gated_address, load_ggml_experts
from agentrt.kernels.ggml_linear import (
    GGMLType,
    available_isas,
    default_build_dir,
    ggml_linear_bf16,
    interleave,
    load_ggml_kernels,
    selected_isa,
)
from tests.kernels.ggml_helpers import random_weight

Q = GGMLType
HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 8, 2
# (gate_up types: one fused part or gate and up, down type, interleaved by 16)
CASES = [
    ((Q.Q4_K,), Q.Q6_K, True),  # Q4_K_M's experts as the loader lays them out on AVX-512
    ((Q.Q4_K,), Q.Q6_K, False),
    ((Q.Q8_0,), Q.Q4_0, True),
    ((Q.Q5_K,), Q.Q3_K, False),
    ((Q.Q2_K, Q.Q5_0), Q.Q5_1, False),  # gate and up of two types: two parts
    ((Q.Q4_K, Q.Q8_0), Q.Q6_K, True),
]


@pytest.fixture(scope="module")
def ops():
    return load_cpu_ops(envs.cache_dir() / "kernels")


def _moe(up_types, down_type, interleaved: bool, seed: int = 0) -> SparseMoE:
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, True, F.silu)
    with torch.no_grad():
        router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed))
        moe.gate.weight.copy_(router * 0.1)
    layout = interleave if interleaved else (lambda w: w)
    rows = 2 * INTER // len(up_types)
    for e, expert in enumerate(moe.experts):
        parts = [
            layout(random_weight(q, rows, HIDDEN, 10 * e + i + seed, 0.002))
            for i, q in enumerate(up_types)
        ]
        expert.gate_up_proj = GGMLLinear(parts)
        down = random_weight(down_type, HIDDEN, INTER, 500 + e + seed, 0.002)
        expert.down_proj = GGMLLinear([layout(down)])
    return moe


def _tokens(num_tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(num_tokens)
    return torch.randn(num_tokens, HIDDEN, generator=g).bfloat16()


def _per_token(moe, x, weights, chosen, ops, kernels):
    """The MoE token by token, expert by expert (ascending), by ggml_linear_bf16."""
    out = []
    for t in range(x.shape[0]):
        total = torch.zeros(HIDDEN)
        for j in chosen[t].argsort().tolist():
            expert = moe.experts[int(chosen[t, j])]
            gate_up = torch.cat(
                [
                    ggml_linear_bf16(x[t : t + 1], w, kernels=kernels)
                    for w in expert.gate_up_proj.weights
                ],
                dim=1,
            )
            down = ggml_linear_bf16(
                ops.silu_mul(gate_up), expert.down_proj.weights[0], kernels=kernels
            )
            total = total + down[0].float() * weights[t, j]  # fp32, as index_add_ sums
        out.append(total.bfloat16())
    return torch.stack(out)


def _kernel(moe, ops, library=None) -> ExpertKernel:
    return ExpertKernel(
        moe.gate.weight.data,
        [e.gate_up_proj.weights for e in moe.experts],
        [e.down_proj.weights[0] for e in moe.experts],
        TOP_K,
        True,
        gated_address(ops.silu_mul),
        library,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(q.name for q in (*c[0], c[1])))
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_equals_the_per_expert_path_bit_for_bit(ops, case, num_tokens):
    up_types, down_type, interleaved = case
    moe = _moe(up_types, down_type, interleaved)
    x = _tokens(num_tokens)
    with torch.inference_mode():
        weights, chosen = moe.route(x)
        # A Python callable for `gated`: moe.py's expert-batched path with the same glue.
        expected = moe(x, gated=lambda gate_up: ops.silu_mul(gate_up))
        kernel = moe.expert_kernel(ops.silu_mul)
        assert kernel is not None  # the fused path takes the one-call kernel
        assert torch.equal(kernel.forward(x, weights, chosen), expected)
        # Its own router: the same experts here, weights within fp32 rounding.
        got = moe(x, gated=ops.silu_mul)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("isa", available_isas())
def test_each_instruction_set_equals_its_products_token_by_token(ops, isa):
    interleaved = isa == "avx512"  # the layouts each build runs (the legacy types on AVX2 too)
    moe = _moe((Q.Q4_K,) if interleaved else (Q.Q4_K, Q.Q8_0), Q.Q6_K, interleaved, seed=7)
    library = load_ggml_experts(default_build_dir(), isa)
    kernels = load_ggml_kernels(default_build_dir(), isa)
    x = _tokens(9)
    with torch.inference_mode():
        weights, chosen = moe.route(x)
        got = _kernel(moe, ops, library).forward(x, weights, chosen)
        expected = _per_token(moe, x, weights, chosen, ops, kernels)
    assert torch.equal(got, expected)


def test_router_picks_the_top_k_and_renormalises(ops):
    """The C router's choice and weights give the output torch's top k gives (within the
    fp32 rounding of the router's sums), and the routing matters to the output."""
    moe = _moe((Q.Q4_K,), Q.Q6_K, selected_isa() == "avx512", seed=3)
    kernel = _kernel(moe, ops)
    x = _tokens(6)
    with torch.inference_mode():
        weights, chosen = moe.route(x)
        routed = kernel.forward(x)
        given = kernel.forward(x, weights, chosen)
        # A different routing gives a different output: the router is really used.
        other = kernel.forward(x, weights, (chosen + 1) % EXPERTS)
    torch.testing.assert_close(routed.float(), given.float(), rtol=2**-7, atol=1e-6)
    assert not torch.equal(other, given)


def test_experts_the_kernel_cannot_run_as_one_take_the_per_expert_path(ops):
    moe = _moe((Q.Q4_K,), Q.Q6_K, False)
    moe.experts[3].down_proj = GGMLLinear([random_weight(Q.Q8_0, HIDDEN, INTER, 9, 0.002)])
    x = _tokens(4)
    with torch.inference_mode():
        assert moe.expert_kernel(ops.silu_mul) is None
        got = moe(x, gated=ops.silu_mul)
        expected = moe(x, gated=lambda gate_up: ops.silu_mul(gate_up))
    assert torch.equal(got, expected)
    assert gated_address(lambda gate_up: gate_up) is None


def test_bad_input_is_refused(ops):
    kernel = _kernel(_moe((Q.Q4_K,), Q.Q6_K, False), ops)
    x = _tokens(2)
    with pytest.raises(KernelInputError, match="bfloat16"):
        kernel.forward(x.float())
    weights = torch.full((2, TOP_K), 0.5)
    with pytest.raises(KernelInputError, match="out of range"):
        kernel.forward(x, weights, torch.tensor([[0, 1], [2, EXPERTS]]))
    with pytest.raises(KernelInputError, match="expected"):
        kernel.forward(x, weights[:1], torch.tensor([[0, 1]]))
