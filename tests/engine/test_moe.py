"""The sparse MoE MLP (engine/model/moe.py): expert-batched, it computes transformers' MoE
blocks bit for bit on dense weights; on block-format experts each chosen expert runs once a
step over all its tokens, unchosen experts not at all, and a token's output does not depend
on the tokens batched with it (beyond the router's fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.engine.model.ggml_linear import GGMLLinear
from agentrt.engine.model.moe import ExpertGroups, SparseMoE
from tests.kernels.ggml_helpers import random_weight

from .gguf_files import Q

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 32, 8, 2


def _hf_block(family: str):
    import transformers

    common = dict(
        hidden_size=HIDDEN,
        num_experts_per_tok=TOP_K,
        initializer_range=0.2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if family == "qwen3moe":
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=EXPERTS, moe_intermediate_size=INTERMEDIATE, norm_topk_prob=True
        )
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    else:
        config = transformers.MixtralConfig(
            **common, num_local_experts=EXPERTS, intermediate_size=INTERMEDIATE
        )
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return block.eval()


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_moe_equals_transformers_block_bit_for_bit(family, num_tokens):
    hf = _hf_block(family)
    ours = SparseMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, True, F.silu)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])  # (2 I, hidden)
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])  # (hidden, I)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(hidden[None])[0]
        got = ours(hidden)
    assert torch.equal(got, want)


def test_each_chosen_expert_runs_once_a_step_over_all_its_tokens(monkeypatch):
    # Experts in block formats (Q8_0 gate_up, Q4_K down: an intermediate size of whole Q4_K
    # blocks, 256), as a GGUF's are loaded.
    intermediate = 256
    moe = SparseMoE(HIDDEN, intermediate, EXPERTS, TOP_K, True, F.silu)
    with torch.no_grad():
        moe.gate.weight.copy_(
            torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.5
        )
    for e, expert in enumerate(moe.experts):
        expert.gate_up_proj = GGMLLinear([random_weight(Q.Q8_0, 2 * intermediate, HIDDEN, e)])
        expert.down_proj = GGMLLinear([random_weight(Q.Q4_K, HIDDEN, intermediate, 100 + e)])
    calls: list[tuple[int, str, int]] = []
    for e, expert in enumerate(moe.experts):
        for name in ("gate_up_proj", "down_proj"):
            proj = getattr(expert, name)

            def spy(x, out, e=e, name=name, inner=proj.product_into):
                calls.append((e, name, x.shape[0]))
                inner(x, out)

            monkeypatch.setattr(proj, "product_into", spy)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, chosen = moe.route(hidden)
        batched = moe(hidden)
        step_calls = list(calls)
        calls.clear()
        alone = torch.cat([moe(hidden[t : t + 1]) for t in range(len(hidden))])
    # One product of each kind per chosen expert, over all the tokens that chose it.
    tokens_of = {e: int((chosen == e).any(-1).sum()) for e in chosen.unique().tolist()}
    assert sorted(step_calls) == sorted(
        (e, name, n) for e, n in tokens_of.items() for name in ("gate_up_proj", "down_proj")
    )
    # One request's decode step reads its k experts only.
    assert len(calls) == 2 * TOP_K * len(hidden)
    assert all(n == 1 for _, _, n in calls)
    # Batching does not change a token's output: the kernels' rows do not interact, only the
    # router's fp32 product (BLAS) rounds differently for 9 rows than for 1.
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


def test_expert_groups_sort_choices_by_expert_then_slot_then_token():
    chosen = torch.tensor([[3, 1], [1, 0], [3, 0]])  # (T 3, k 2)
    groups = ExpertGroups.of(chosen, 5)
    assert groups.spans == [(0, 0, 2), (1, 2, 4), (3, 4, 6)]
    # Expert 1: token 1's first choice before token 0's second (transformers' order).
    assert groups.token_ids.tolist() == [1, 2, 1, 0, 0, 2]
    assert chosen.t().reshape(-1)[groups.order].tolist() == [0, 0, 1, 1, 3, 3]


@pytest.mark.parametrize("layout", ["mixtral_released", "fused_3d"])
def test_hf_moe_checkpoint_layouts_run_greedy_as_transformers(tiny_checkpoint, tmp_path, layout):
    """An HF MoE checkpoint directory in either layout the engine reads besides per-expert
    names (engine/loader/hf_experts.py): Mixtral's released `block_sparse_moe.experts.{e}.w1 /
    w2 / w3` (what save_pretrained writes for it) and transformers 5's fused 3-D
    `mlp.experts.gate_up_proj` / `down_proj` (its state dict as it is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams

    from .conftest import hf_greedy_batch
    from .hf_gguf import hf_config

    config = hf_config("mixtral" if layout == "mixtral_released" else "qwen3moe")
    config.vocab_size = 49152  # the tiny checkpoints' SmolLM2 tokenizer, copied beside it
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for file in tiny_checkpoint("llama").iterdir():
        if "tokenizer" in file.name or file.name == "special_tokens_map.json":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    if layout == "mixtral_released":
        model.save_pretrained(tmp_path)
        expected_name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    else:
        save_file(model.state_dict(), tmp_path / "model.safetensors")
        config.to_json_file(tmp_path / "config.json")
        expected_name = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as stored:
        assert expected_name in stored.keys()
    prompts = [[5, 9, 200, 31, 7], [1000, 42, 17]]
    expected = hf_greedy_batch(model, prompts, 8)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_gb=0.02)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_fused_path_one_call_kernel_decodes_as_the_per_expert_path(tmp_path, family, monkeypatch):
    """A tiny Q8_0 MoE file on the fused CPU glue (its default): the whole decoder is one C
    call, each layer's MLP in it one moe_forward (kernels/ggml_experts.py); layer by layer
    the same kernel is called from Python; and greedy decoding gives the tokens of the
    per-expert path (the kernel's router sums in its own fp32 order; the experts and the glue
    are the same operations)."""
    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams
    from agentrt.kernels.ggml_experts import ExpertKernel

    from .hf_gguf import write_family_gguf

    path, _ = write_family_gguf(family, tmp_path / f"{family}.gguf", qtype=Q.Q8_0)
    prompts = [[5, 9, 200, 31, 7], [1000, 42, 17, 3, 3, 8, 400, 12, 77]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    llm = LLM(str(path), kv_cache_memory_gb=0.02)
    model = llm.engine.runner.model
    assert model.cpu_ops is not None and model.cpu_decoder is not None  # one call a step
    one_call = generate()
    model.cpu_decoder = None  # forward_fused, layer by layer
    calls = []
    forward = ExpertKernel.forward
    monkeypatch.setattr(ExpertKernel, "forward", lambda k, x: calls.append(1) or forward(k, x))
    by_layer = generate()
    assert calls  # every MoE layer of every step went through the kernel
    monkeypatch.setattr(SparseMoE, "expert_kernel", lambda self, gated: None)
    per_expert = generate()
    assert one_call == by_layer == per_expert
