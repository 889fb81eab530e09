"""All of a quantized model's layers in one C call (kernels/cpu_decoder.py) against the same
layers run one fused call at a time from Python (llama.py's forward_fused): the same bits
for every step, prefills, chunks and decodes mixed, on one and two threads, for Llama's
layer and for Qwen2's (a qkv bias), Qwen3's (q/k RMSNorm per head) and the sparse MoE
layers of Qwen3-MoE and Mixtral (their MLP one moe_forward call); its checks before the
call; and the fallback when a projection is dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.worker.model_runner import ModelRunner
from agentrt.kernels import KernelInputError
from tests.engine.gguf_files import Q, write_tiny_gguf
from tests.engine.hf_gguf import write_family_gguf
from tests.engine.test_loader import runner as loader_runner

PROMPTS = [list(range(5, 45)), list(range(100, 109)), list(range(300, 320))]


def runner(path: Path, quantization: str = "gguf") -> ModelRunner:
    return loader_runner(path, quantization, num_blocks=12, max_len=128)


def steps() -> list[SchedulerOutput]:
    """Two prefills (the first in two chunks); then the first's second chunk beside a decode
    of the second and the third's whole prompt; then three decodes."""
    a, b, c = PROMPTS
    blocks = {"a": [0, 1, 2], "b": [3], "c": [4, 5]}

    def chunk(req, tokens, start, sample=True):
        return ScheduledChunk(req, tokens, start, blocks[req], sample=sample)

    plan = [
        [chunk("a", a[:24], 0, sample=False), chunk("b", b, 0)],
        [chunk("a", a[24:], 24), chunk("b", [7], 9), chunk("c", c, 0)],
        [chunk("a", [8], 40), chunk("b", [9], 10), chunk("c", [10], 20)],
    ]
    return [SchedulerOutput(chunks, sum(len(c.token_ids) for c in chunks)) for chunks in plan]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder-gguf")
    kinds = {
        "Q4_0": {"projection_type": Q.Q4_0},  # interleaved on AVX2 and AVX-512 builds
        "Q4_K+Q6_K": {"projection_type": Q.Q4_K, "v_type": Q.Q6_K},  # qkv of two types
        "Q5_0": {"projection_type": Q.Q5_0},  # the file's layout
        "qwen2": {"arch": "qwen2", "projection_type": Q.Q4_K, "v_type": Q.Q6_K},  # qkv bias
        "qwen3": {"arch": "qwen3", "projection_type": Q.Q5_0},  # q/k norms per head
    }
    return {name: write_tiny_gguf(root / f"{name}.gguf", **kw) for name, kw in kinds.items()}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K+Q6_K", "Q5_0", "qwen2", "qwen3"])
def test_one_call_equals_the_layer_by_layer_path_bit_for_bit(files, kind, threads):
    one_call, by_layer = runner(files[kind]), runner(files[kind])
    assert one_call.model.cpu_decoder is not None
    layer = one_call.model.layers[0]
    assert (layer.qkv_proj.bias is not None) == (kind == "qwen2")
    assert (layer.q_norm is not None) == (kind == "qwen3")
    by_layer.model.cpu_decoder = None
    _assert_same_steps(one_call, by_layer, threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_moe_one_call_equals_the_layer_by_layer_path_bit_for_bit(tmp_path, family, threads):
    """A MoE layer's MLP in the one-call decoder is moe_forward called from C with the
    arguments forward_fused's expert kernel passes from Python: the same bits (prefills,
    chunks and decodes; Q4_0 experts, interleaved on AVX2 and AVX-512 builds)."""
    path, _ = write_family_gguf(family, tmp_path / f"{family}.gguf", qtype=Q.Q4_0)
    one_call, by_layer = runner(path), runner(path)
    decoder = one_call.model.cpu_decoder
    assert decoder is not None and all(w.experts for w in decoder._layer_weights)
    by_layer.model.cpu_decoder = None
    for layer in by_layer.model.layers:  # forward_fused runs the layer's kernel
        assert layer.mlp.expert_kernel(by_layer.model.cpu_ops.silu_mul) is not None
    _assert_same_steps(one_call, by_layer, threads)


def _assert_same_steps(one_call: ModelRunner, by_layer: ModelRunner, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in steps():
            got, want = one_call.execute(step), by_layer.execute(step)
            assert torch.equal(got, want)
        for got, want in zip(one_call.kv_caches, by_layer.kv_caches, strict=True):
            assert torch.equal(got, want)  # every layer wrote the same K/V
        assert any(cache.abs().sum() > 0 for cache in one_call.kv_caches)
    finally:
        torch.set_num_threads(before)


def test_bad_step_input_is_refused_before_anything_is_written(files):
    r = runner(files["Q4_0"])
    decoder = r.model.cpu_decoder
    hidden = decoder.hidden
    residual = torch.randn(1, hidden)
    positions = torch.tensor([3])
    start, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    table, rows = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3])

    def call(residual=residual, key_rows=rows, table=table):
        return decoder.forward(residual, positions, key_rows, start, lens, table)

    with pytest.raises(KernelInputError, match="residual"):
        call(residual=residual.double())
    with pytest.raises(KernelInputError, match="residual"):
        call(residual=torch.randn(hidden, 2).T)  # not contiguous
    num_rows = r.kv_caches[0].shape[0] * 2 * 16
    with pytest.raises(KernelInputError, match="out of range"):
        call(key_rows=torch.tensor([num_rows]))  # would write past the cache
    with pytest.raises(KernelInputError, match="block_tables"):
        call(table=torch.tensor([[12]], dtype=torch.int32))  # a block the cache lacks
    assert all(not cache.any() for cache in r.kv_caches)
    out = call()  # the same step, well formed, runs
    assert out.shape == (1, hidden) and out.dtype == torch.bfloat16 and out.isfinite().all()
    assert any(cache.any() for cache in r.kv_caches)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_dense_part_keeps_the_layer_by_layer_path(tmp_path, arch):
    """An F32 attn_v beside Q4_0 q and k: the fused qkv holds an fp32 matrix part, which the
    one-call loop does not take, so the layers run forward_fused (that part through torch),
    as close to the dequantized fp32 model as the all-block file is. (Qwen2: the bias is
    added once, by rope_qkv, not by the torch product too.)"""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", arch=arch, projection_type=Q.Q4_0, v_type=Q.F32)
    r = runner(path)
    assert r.model.cpu_ops is not None and r.model.cpu_decoder is None
    assert any(isinstance(w, torch.Tensor) for w in r.model.layers[0].qkv_proj.weights)
    dense = runner(path, "none")
    for step in steps():
        got, want = r.execute(step), dense.execute(step)
        assert (got - want).abs().max() < 0.06 * want.abs().max()


def test_a_file_of_dense_projections_runs_without_the_fused_glue(tmp_path):
    """An F32 file: nn.Linear layers, which the fused glue cannot run (it did try, and failed
    on the first step), so they run the model's torch path, as the file dequantized does."""
    path = write_tiny_gguf(tmp_path / "f32.gguf", projection_type=Q.F32, vocab_type=Q.F32)
    r, dense = runner(path), runner(path, "none")
    assert r.model.cpu_ops is None and r.model.cpu_decoder is None
    for step in steps():
        assert torch.equal(r.execute(step), dense.execute(step))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_fused_paths_apply_the_bias_and_the_qk_norms(files, kind):
    """Qwen2's bias and Qwen3's norms are in the fused path's arithmetic: with them it stays
    as close to the dequantized fp32 model's layer-by-layer torch path as Llama's file does
    (the other tests' bound); without them (the bias zeroed, the norm weights made ones)
    its logits move."""
    fused, dense = runner(files[kind]), runner(files[kind], "none")
    assert fused.model.cpu_ops is not None and fused.model.cpu_decoder is not None
    for step in steps():
        got, want = fused.execute(step), dense.execute(step)
        assert (got - want).abs().max() < 0.06 * want.abs().max()
    # New tensors (the file's are views of its memory map, shared by both runners), and the
    # one-call decoder rebuilt over them.
    without = runner(files[kind])
    model = without.model
    for layer in model.layers:
        if kind == "qwen2":
            layer.qkv_proj.bias = torch.nn.Parameter(torch.zeros_like(layer.qkv_proj.bias))
        else:
            layer.q_norm.weight = torch.nn.Parameter(torch.ones_like(layer.q_norm.weight))
            layer.k_norm.weight = torch.nn.Parameter(torch.ones_like(layer.k_norm.weight))
    model.cpu_decoder = model.build_cpu_decoder(without.attention, without.kv_caches)
    first = steps()[0]
    got, want = without.execute(first), runner(files[kind]).execute(first)
    # (The step runs bit for bit the same twice, so any difference is theirs; the tiny
    # qwen2's biases, N(0, 0.1), move the logits by ~1% of their range.)
    assert (got - want).abs().max() > 1e-3 * want.abs().max()
