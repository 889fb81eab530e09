"""The model's CUDA path on the CPU: with the 'triton' attention backend the model runs its
RMSNorm and RoPE through the kernels package too. Its logits over a few engine steps
(chunked prefill, decodes, a q/k-norm model) must match the default CPU path, first with the
kernels' torch references (what the CPU dispatch picks), then with every Triton kernel under
Triton's interpreter (dispatch forced to Triton, as on CUDA)."""

from __future__ import annotations

import importlib

import pytest
import torch

import agentrt.kernels as kernels
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.llama import LlamaForCausalLM, RMSNorm
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.worker.model_runner import ModelRunner
from agentrt.kernels import dispatch

BLOCK_SIZE = 4
TRITON_MODULE = {
    "reshape_and_cache": "triton_reshape_and_cache",
    "paged_attention": "triton_paged_attention",
    "rms_norm": "triton_rms_norm",
    "rotary_embedding": "triton_rotary",
}


def make_runner(path, attention_backend: str) -> ModelRunner:
    return ModelRunner(
        ModelArchConfig.from_hf_dict(load_hf_config(path)),
        load_state_dict(path),
        dtype=torch.float32,
        device=torch.device("cpu"),
        block_size=BLOCK_SIZE,
        num_blocks=16,
        max_model_len=64,
        attention_backend=attention_backend,
    )


def engine_steps() -> list[SchedulerOutput]:
    """Request a: 13-token prompt, then two decodes. Request b: a 10-token prompt in chunks
    of 6 and 4 (the first not sampled), then a decode. Blocks are scattered."""
    a_blocks, b_blocks = [3, 7, 1, 9], [2, 11, 5]
    a, b = list(range(100, 113)), list(range(200, 210))
    steps = [
        [ScheduledChunk("a", a, 0, a_blocks, True), ScheduledChunk("b", b[:6], 0, b_blocks[:2], False)],
        [ScheduledChunk("a", [42], 13, a_blocks, True), ScheduledChunk("b", b[6:], 6, b_blocks, True)],
        [ScheduledChunk("a", [43], 14, a_blocks, True), ScheduledChunk("b", [44], 10, b_blocks, True)],
    ]  # fmt: skip
    return [SchedulerOutput(chunks, sum(len(c.token_ids) for c in chunks)) for chunks in steps]


def run(runner: ModelRunner) -> list[torch.Tensor]:
    return [runner.execute(step) for step in engine_steps()]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the model's calls of the kernels package's rms_norm and rotary_embedding."""
    counts = {"rms_norm": 0, "rotary_embedding": 0}
    for name in counts:
        fn = getattr(kernels, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_runs_norms_and_rope_through_the_kernels(
    tiny_checkpoint, kernel_calls, arch
):
    path = tiny_checkpoint(arch)
    expected = run(make_runner(path, "cpu"))
    assert kernel_calls == {"rms_norm": 0, "rotary_embedding": 0}
    runner = make_runner(path, "triton")
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert all(m.kernel_ops for m in norms) and runner.model.rotary.kernel_ops
    got = run(runner)
    for logits, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # Each of the 3 steps: every norm once (q/k norms and the final norm included), and one
    # rotation of q and k per layer.
    num_layers = runner.arch.num_layers
    assert kernel_calls == {"rms_norm": 3 * len(norms), "rotary_embedding": 3 * num_layers}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the compiled kernels run (test_kernels_gpu.py)"
)
def test_model_cuda_path_under_the_triton_interpreter(tiny_checkpoint, tk, monkeypatch):
    """Every kernel of the CUDA path (reshape_and_cache, paged attention, fused add +
    RMSNorm, RoPE in place on strided q/k views) interpreted, against the CPU path."""
    path = tiny_checkpoint("qwen3")  # q/k norms: every kernel runs
    expected = run(make_runner(path, "cpu"))
    called = set()
    for name in TRITON_MODULE:
        # Already loaded, in interpreted mode, by the tk fixture.
        module = importlib.import_module(f"agentrt.kernels.{TRITON_MODULE[name]}")
        kernel = getattr(module, f"{name}_triton")

        def spy(*args, _kernel=kernel, _name=name, **kwargs):
            called.add(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, f"{name}_triton", spy)
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)
    got = run(make_runner(path, "triton"))
    assert called == set(TRITON_MODULE)
    for logits, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_weights_fill_a_model_built_on_the_meta_device(tiny_checkpoint):
    """A model built on the meta device (as ModelRunner builds it) is filled by the loader
    with real tensors (fused q/k/v with biases): the checkpoint's values, on the CPU."""
    path = tiny_checkpoint("qwen2")
    with torch.device("meta"):
        model = LlamaForCausalLM(ModelArchConfig.from_hf_dict(load_hf_config(path)), 1)
    state = load_state_dict(path)
    model.load_hf_state_dict(state)
    bias = model.layers[0].qkv_proj.bias
    assert bias.device.type == "cpu"
    expected = torch.cat([state[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(bias.float(), expected.float())
