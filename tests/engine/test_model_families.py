"""Model families (engine/model/registry.py): each family's tiny random model, written as a
llama.cpp-style GGUF (tests/engine/hf_gguf.py), runs greedy token for token as HF
transformers' fp32 model on the same (dequantized) weights; an unsupported architecture
still fails at load naming the supported ones."""

from __future__ import annotations

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.registry import FAMILIES, GGUF_ARCHITECTURES, family_for_hf
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.sampling_params import SamplingParams
from tests.engine.conftest import hf_greedy_batch

from .gguf_files import Q
from .hf_gguf import family_of, hf_state, write_family_gguf

NUM_TOKENS = 12
# Prompt lengths around Gemma's tiny window (8) and the block size (8): inside one window,
# past it, and past it by several blocks (whose local KV then lies wholly outside it).
PROMPT_LENGTHS = (5, 13, 30)


def _prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _hf_reference(path, config) -> torch.nn.Module:
    """transformers' model of `config` with the file's weights as agentrt reads them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    keys = model.load_state_dict(hf_state(load_state_dict(path), config), strict=False)
    assert not keys.unexpected_keys
    assert keys.missing_keys in ([], ["lm_head.weight"])
    return model.eval()


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """family name -> (GGUF path, HF config), each written once."""
    out = tmp_path_factory.mktemp("families")
    return {
        (family, qtype): write_family_gguf(family, out / f"{family}-{qtype}.gguf", qtype=qtype)
        for family, qtype in (
            ("llama", Q.Q8_0),
            ("llama3", Q.F32),
            ("qwen2", Q.Q8_0),
            ("qwen3", Q.Q8_0),
            ("phi3", Q.Q8_0),
            ("phi4", Q.Q8_0),
            ("smollm3", Q.Q8_0),
            ("granite", Q.Q8_0),
            ("olmo2", Q.Q8_0),
            ("gemma2", Q.F32),
            ("gemma2", Q.Q8_0),
            ("qwen3moe", Q.Q8_0),
            ("mixtral", Q.Q8_0),
            ("gemma3", Q.Q8_0),
            ("gemma3", Q.F32),
        )
    }


@pytest.mark.parametrize(
    ("family", "qtype", "engine"),
    [
        ("llama", Q.Q8_0, {}),
        ("llama3", Q.F32, {}),  # the GGUF's rope_freqs for the config's llama3 scaling
        ("qwen2", Q.Q8_0, {}),  # q/k/v biases
        ("qwen3", Q.Q8_0, {}),  # q/k norms per head
        ("phi3", Q.Q8_0, {}),  # fused qkv and gate_up; LongRoPE factors as tensors
        ("phi4", Q.Q8_0, {}),  # Phi-4-mini's partial rotary: 12 of 16 dims turn; tied
        ("smollm3", Q.Q8_0, {}),  # NoPE layers
        ("granite", Q.Q8_0, {}),  # embedding, residual, attention and logit multipliers
        ("olmo2", Q.Q8_0, {}),  # norms after attention and the MLP only; q/k norms over heads
        ("gemma2", Q.F32, {}),  # alternating windows; soft-capped scores and logits
        ("qwen3moe", Q.Q8_0, {}),  # 3-D expert tensors, top-2 routing
        ("mixtral", Q.Q8_0, {}),  # the same experts in a llama GGUF
        ("gemma3", Q.Q8_0, {}),
        ("gemma3", Q.F32, {"attention_backend": "torch"}),
        ("gemma3", Q.F32, {"max_num_batched_tokens": 7}),  # chunks across the window
    ],
)
def test_family_gguf_greedy_equals_hf(family_files, family, qtype, engine):
    path, config = family_files[(family, qtype)]
    arch = ModelArchConfig.from_hf_dict(load_hf_config(path))
    assert arch.family == family_of(family)
    hf = _hf_reference(path, config)
    prompts = _prompts()
    expected = hf_greedy_batch(hf, prompts, NUM_TOKENS)
    options = {"kv_cache_memory_gb": 0.02, "block_size": 8, "max_num_batched_tokens": 64}
    llm = LLM(str(path), dtype="float32", **(options | engine))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    llm.kv_manager.check_invariants()


def test_gemma3_reads_the_family_settings(family_files):
    path, config = family_files[("gemma3", Q.F32)]
    arch = ModelArchConfig.from_hf_dict(load_hf_config(path))
    assert arch.layer_types == tuple(config.layer_types)
    assert (arch.sliding_window, arch.local_rope_theta, arch.rope_theta) == (8, 1e4, 1e6)
    assert arch.attention_scale == 16**-0.5 and arch.norm_offset == 1.0
    assert arch.embedding_scale == 64**0.5 and arch.activation == "gelu_tanh"
    # An HF config of the same model reads the same, but for what a GGUF drops.
    hf_arch = ModelArchConfig.from_hf_dict(
        {**config.to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    )
    assert hf_arch.layer_types == arch.layer_types
    assert hf_arch.attention_scale == arch.attention_scale


def _teacher_forced(llm: LLM, text: list[int]) -> torch.Tensor:
    """Logits (len(text) - 1, vocab) of one chunk of `text`, a row per position."""
    blocks = list(range(-(-len(text) // llm.engine.cache_config.block_size)))
    chunk = ScheduledChunk("text", text, 0, blocks, True, num_draft_tokens=len(text) - 1)
    return llm.engine.runner.execute(SchedulerOutput([chunk], len(text)))[:-1].float()


def test_block_formats_run_close_to_fp32_on_the_fused_paths(family_files):
    """Each family's Q8_0 file in its own blocks (the default for a GGUF: every projection
    a GGMLLinear, a MoE's experts too) agrees with its fp32 model as the Llama file does
    (int8 activations move near-ties only). The one-call C decoder and the fused glue
    compute every dense family's layer: a qkv bias (Qwen2), q/k norms per head (Qwen3,
    Gemma 3) or over all heads (OLMo 2), Gemma's 1 + w sandwich norms, GeGLU, windows and
    rope tables per layer, soft-caps (Gemma 2), OLMo 2's post-norms, and the MoEs'
    (Qwen3-MoE, Mixtral) MLPs as one kernel call a layer (kernels/ggml_experts.py). (Measured, mean error / argmax agreement over the text's 29
    positions, fused vs by torch ops: Qwen2 3.1% / 97% vs 2.8% / 86%; Qwen3 2.5% / 90% (26)
    vs 2.2% / 93% (27); Llama 3.1% / 93%: one near-tie either way, so the floor is 85%;
    SmolLM3, its NoPE layers on the same paths, 7.3% / 86%.)"""
    decoder = ("llama", "phi3", "phi4", "qwen2", "qwen3", "smollm3", "granite")
    decoder += ("gemma3", "gemma2", "olmo2", "qwen3moe", "mixtral")
    glue = decoder
    for family in glue:
        path = str(family_files[(family, Q.Q8_0)][0])
        quantized, exact = LLM(path, kv_cache_memory_gb=0.02), LLM(path, dtype="float32")
        model = quantized.engine.runner.model
        assert quantized.engine.model_config.quantization == "gguf"
        assert model.quantized_layers()
        assert (model.cpu_ops is not None) == (family in glue)  # Llama's math
        assert (model.cpu_decoder is not None) == (family in decoder)
        text = _prompts(1)[2]
        got, want = _teacher_forced(quantized, text), _teacher_forced(exact, text)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85
        # int8 activations; SmolLM3's tiny file moves more on either path (measured: 6.4%
        # through torch's glue, 7.3% fused).
        bound = 0.08 if family == "smollm3" else 0.05
        assert (got - want).abs().mean() < bound * want.abs().mean()


@pytest.mark.parametrize(
    "family", ["smollm3", "granite", "gemma3", "gemma2", "olmo2", "qwen3moe", "phi4"]
)
def test_one_call_decoder_gives_the_layer_by_layer_bits(family_files, family):
    """SmolLM3's NoPE layers (rope_qkv without a table: q and k not rotated), Phi-4-mini's
    partial rotary (a table of fewer columns than the head's dims), Granite's
    multipliers (each branch scaled as add_rms_norm adds it), Gemma 3's sliding-window
    layers (their own rope table and KV cache group: the prompts run past the window by
    several blocks, whose local KV is freed), Gemma 2's soft-caps, OLMo 2's post-norms and
    Qwen3-MoE's experts (one moe_forward a layer) on the one-call C decoder give the
    layer-by-layer fused path's bits, prefill and decode."""
    path = str(family_files[(family, Q.Q8_0)][0])
    one_call, by_layer = LLM(path, kv_cache_memory_gb=0.02), LLM(path, kv_cache_memory_gb=0.02)
    model = one_call.engine.runner.model
    assert model.cpu_decoder is not None
    if family == "smollm3":
        assert not all(layer.use_rope for layer in model.layers)
    elif family == "granite":
        assert model.cfg.residual_scale != 1.0 and model.cfg.embedding_scale != 1.0
    elif family == "olmo2":
        assert model.cfg.norm_layout == "post" and not model.cfg.qk_norm_per_head
    elif family == "qwen3moe":
        assert all(layer.mlp is not None for layer in model.layers)
    elif family == "phi4":
        assert model.cfg.rotary_dim == 12 and model.rotary.cos_sin_cache.shape[1] == 12
    else:  # Gemma: sliding layers in their own KV cache groups
        assert model.cfg.has_sliding_layers and model.cpu_decoder.num_groups > 1
    by_layer.engine.runner.model.cpu_decoder = None
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = _prompts()
    got = [o.outputs[0].token_ids for o in one_call.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in by_layer.generate(prompts, params)]
    text = _prompts(1)[2]
    assert torch.equal(_teacher_forced(one_call, text), _teacher_forced(by_layer, text))


def test_registry_names_every_family_once():
    hf_names = [a for f in FAMILIES for a in f.hf_architectures]
    assert len(hf_names) == len(set(hf_names))
    assert len(GGUF_ARCHITECTURES) == len(set(GGUF_ARCHITECTURES))
    for family in FAMILIES:
        module = family.load()
        assert callable(module.arch_config) and isinstance(module.MODEL_CLASS, type)
        assert family_for_hf({"architectures": list(family.hf_architectures)}) is family


def test_fused_projections_refuse_tensor_parallel_with_a_config_error(family_files):
    from agentrt.engine.errors import ConfigError
    from agentrt.engine.model.parallel import check_tensor_parallel

    arch = ModelArchConfig.from_hf_dict(load_hf_config(family_files[("phi3", Q.Q8_0)][0]))
    assert arch.fused_projections and arch.rope_scaling is None  # LongRoPE: in the tensors
    with pytest.raises(ConfigError, match="one matrix each"):
        check_tensor_parallel(arch, 2)
