"""The weight loaders (engine/loader/): GGUF files run in their own block formats, close to
the fp32 model of their dequantized weights; tensor-parallel slices; safetensors in their
own dtype; the fit check; memory and bytes written when loading a ~300M-parameter file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import ModelTooLargeError
from agentrt.engine.loader.checkpoint import load_hf_config, load_state_dict
from agentrt.engine.loader.fit import GiB, MemoryEstimate, check_fit, weight_bytes
from agentrt.engine.loader.gguf_file import metadata_dir
from agentrt.engine.loader.gguf_loader import GGUFLoader
from agentrt.engine.loader.safetensors_loader import SafetensorsLoader
from agentrt.engine.loader.weights import Shard, Split
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.ggml_linear import GGMLEmbedding, GGMLLinear
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.worker.model_runner import ModelRunner
from agentrt.kernels.ggml_linear import GGMLWeight, default_kernels

from .gguf_files import BLOCK_TYPES, Q, write_tiny_gguf

CPU = torch.device("cpu")
PROMPT = list(range(5, 45))  # 40 tokens of the tiny vocabulary
# Logits of a block-format model vs the fp32 model of its dequantized weights: the kernels
# quantize activations to int8 per block of 32 and the fused glue rounds rows to bf16
# between products; measured max |difference| / max |logit| 0.4-3% over the types.
LOGITS_TOLERANCE = 0.06


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-files")


def tiny_file(gguf_dir: Path, arch: str, qtype: int, **kwargs) -> Path:
    path = gguf_dir / f"{arch}-{Q(qtype).name}-{len(kwargs)}.gguf"
    if not path.exists():
        write_tiny_gguf(path, arch=arch, projection_type=qtype, **kwargs)
    return path


def runner(path: Path, quantization: str, num_blocks: int = 4, max_len: int = 64) -> ModelRunner:
    return ModelRunner(
        ModelArchConfig.from_hf_dict(load_hf_config(path)),
        GGUFLoader(path),
        dtype=torch.float32,
        device=CPU,
        block_size=16,
        num_blocks=num_blocks,
        max_model_len=max_len,
        quantization=quantization,
    )


def prompt_logits(r: ModelRunner) -> torch.Tensor:
    chunk = ScheduledChunk("a", PROMPT, 0, [0, 1, 2], sample=True, num_draft_tokens=7)
    return r.execute(SchedulerOutput([chunk], len(PROMPT)))  # (8, vocab)


CASES = [("llama", t, {}) for t in BLOCK_TYPES] + [
    ("qwen2", Q.Q4_K, {"v_type": Q.Q6_K, "tied": False}),  # Q4_K_M's mixture, qkv biases
    ("qwen2", Q.Q5_0, {"vocab_type": Q.Q6_K, "tied": False}),
]


@pytest.mark.parametrize(
    ("arch", "qtype", "extra"), CASES, ids=[f"{a}-{Q(t).name}" for a, t, _ in CASES]
)
def test_block_types_run_close_to_the_dequantized_fp32_model(gguf_dir, arch, qtype, extra):
    path = tiny_file(gguf_dir, arch, qtype, **extra)
    quantized, dense = runner(path, "gguf"), runner(path, "none")
    layer = quantized.model.layers[0]
    assert isinstance(layer.qkv_proj, GGMLLinear) and isinstance(layer.down_proj, GGMLLinear)
    assert {w.qtype for w in layer.qkv_proj.weights} == {qtype, extra.get("v_type", qtype)}
    assert isinstance(quantized.model.embed_tokens, GGMLEmbedding)
    assert isinstance(quantized.model.logits_proj, GGMLLinear)
    if extra.get("tied", True):  # the output projection runs the embedding's own blocks
        assert quantized.model.logits_proj.weights[0] is quantized.model.embed_tokens.weight
    # Q4_0 / Q4_1 / Q8_0 projections held once, interleaved by 16 rows on AVX-512 builds
    interleaves = default_kernels().interleaves(qtype)
    assert {w.interleaved for w in layer.down_proj.weights} == {interleaves}
    assert quantized.model.cpu_ops is not None  # the fused glue (qwen2: rope_qkv adds the bias)
    assert dense.model.layers[0].qkv_proj.weight.dtype == torch.float32
    got, want = prompt_logits(quantized), prompt_logits(dense)
    error = (got - want).abs().max()
    assert error < LOGITS_TOLERANCE * want.abs().max(), f"relative error {error:.4f}"
    # Greedy tokens agree wherever the fp32 model's top two differ by more than the error
    # can move them (random weights give near-ties elsewhere).
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * error
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_greedy_generation_of_a_q4_k_m_style_file_equals_its_fp32_model(gguf_dir):
    """The default (quantization auto -> the file's own blocks on the CPU) against a named
    dtype="float32" (the weights dequantized at load): the same greedy tokens."""
    path = tiny_file(gguf_dir, "llama", Q.Q4_K, v_type=Q.Q6_K)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    default = LLM(str(path), num_kv_blocks=8)
    exact = LLM(str(path), dtype="float32", num_kv_blocks=8)
    assert default.engine.model_config.quantization == "gguf"
    assert exact.engine.model_config.quantization == "none"
    prompts = [PROMPT[:9], PROMPT[20:]]
    got = [o.outputs[0].token_ids for o in default.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in exact.generate(prompts, params)]
    assert got == want


# --- tensor parallelism: each rank reads its slice ------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_rank_slices_equal_slices_of_the_dequantized_tensor(gguf_dir, qtype):
    """Column-parallel rows (llama Q/K un-permuted per head) and row-parallel whole blocks
    stay in the file's format; a row-parallel slice that is not whole blocks (attn_output's
    128 of 256 columns in K-quant blocks of 256) is dequantized for that rank."""
    loader = GGUFLoader(tiny_file(gguf_dir, "llama", qtype))
    for name, split in [
        ("model.layers.0.self_attn.q_proj.weight", Split.COLUMN),
        ("model.layers.0.self_attn.k_proj.weight", Split.COLUMN),
        ("model.layers.1.mlp.up_proj.weight", Split.COLUMN),
        ("model.layers.0.mlp.down_proj.weight", Split.ROW),
        ("model.layers.1.self_attn.o_proj.weight", Split.ROW),
    ]:
        whole = loader.read(name, Split.NONE, Shard(0, 1)).dequantize()
        for rank in range(2):
            part = loader.read(name, split, Shard(rank, 2))
            dim = 0 if split is Split.COLUMN else 1
            expected = whole.chunk(2, dim)[rank]
            block_aligned = (
                split is Split.COLUMN
                or expected.shape[1] % 256 == 0
                or qtype
                in (
                    Q.Q4_0,
                    Q.Q8_0,
                )
            )
            assert isinstance(part, GGMLWeight) == block_aligned, name
            values = part.dequantize() if isinstance(part, GGMLWeight) else part
            assert torch.equal(values, expected), (name, rank)


def test_gguf_weights_equal_transformers_own_read_of_the_file(gguf_dir):
    """Q/K rows un-permuted as transformers does (F32 projections: exact; the Q8_0 embedding
    dequantized bit for bit as gguf-py does), for a Llama and a Qwen2 file."""
    from transformers import AutoModelForCausalLM, GgufConfig

    for arch in ("llama", "qwen2"):
        path = tiny_file(gguf_dir, arch, Q.F32)
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        reference = hf.state_dict()
        ours = load_state_dict(path)
        assert set(ours) <= set(reference)
        for name, tensor in ours.items():
            assert torch.equal(tensor, reference[name]), (arch, name)


# --- safetensors: own dtype, per-rank slices --------------------------------------------------


def test_safetensors_are_read_in_their_dtype_and_by_slices(tiny_checkpoint, tmp_path):
    from agentrt.engine.model.tiny import make_tiny_checkpoint

    source = tiny_checkpoint("qwen2")
    state = {k: v.to(torch.bfloat16) for k, v in load_state_dict(source).items()}
    from safetensors.torch import save_file

    bf16 = make_tiny_checkpoint("qwen2", tmp_path / "bf16", tokenizer_from=source)
    save_file(state, str(bf16 / "model.safetensors"))
    loader = SafetensorsLoader(bf16)
    name = "model.layers.0.mlp.down_proj.weight"
    assert loader.read(name, Split.NONE, Shard(0, 1)).dtype == torch.bfloat16
    assert torch.equal(loader.read(name, Split.ROW, Shard(1, 2)), state[name][:, 64:])
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(loader.read(bias, Split.COLUMN, Shard(1, 2)), state[bias][16:])
    llm = LLM(str(bf16), dtype="bfloat16", num_kv_blocks=8)
    params = list(llm.engine.runner.model.parameters())
    assert params and all(p.dtype == torch.bfloat16 for p in params)


def test_a_tied_checkpoint_that_stores_lm_head_loads_and_ignores_it(tiny_checkpoint, tmp_path):
    """A tied checkpoint may store lm_head.weight beside the embedding (transformers ignores
    it: the embedding projects). It loads, and even a different stored copy changes nothing.
    It failed before: the copy was installed into the tied model's missing lm_head."""
    from safetensors.torch import save_file

    from agentrt.engine.model.tiny import make_tiny_checkpoint

    source = tiny_checkpoint("llama")  # tied
    state = load_state_dict(source)
    assert "lm_head.weight" not in state
    stored = make_tiny_checkpoint("llama", tmp_path / "stored", tokenizer_from=source)
    wrong = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state | {"lm_head.weight": wrong}, str(stored / "model.safetensors"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [PROMPT[:9]]
    expected = LLM(str(source), dtype="float32", num_kv_blocks=8).generate(prompt, params)
    got = LLM(str(stored), dtype="float32", num_kv_blocks=8).generate(prompt, params)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


# --- fit check ------------------------------------------------------------------------------


def test_fit_check_refuses_a_model_too_big_for_a_stated_budget(smollm2_dir):
    arch = ModelArchConfig.from_hf_dict(load_hf_config(smollm2_dir))
    table = GGUFLoader(smollm2_dir).tensor_table()
    own = weight_bytes(table, arch, torch.float32, "gguf", 1)
    dense = weight_bytes(table, arch, torch.float32, "none", 1)
    assert 80e6 < own < smollm2_dir.stat().st_size  # the file's blocks, not more
    assert dense == pytest.approx(4 * 134.5e6, rel=0.01)  # 134.5M parameters in fp32
    budget = dense + GiB  # fp32 weights + 0.5 GiB of KV + 0.5 GiB overhead: just fits
    check_fit(MemoryEstimate(dense, GiB // 2, budget), quantization="none", device=CPU)
    with pytest.raises(ModelTooLargeError) as info:
        check_fit(MemoryEstimate(dense, 2 * GiB, budget), quantization="none", device=CPU)
    message = str(info.value)
    assert "KV pool 2.00 GiB" in message and f"{budget / GiB:.2f} GiB available" in message
    assert "--kv-cache-memory-gb 0.45" in message and "quantization 'gguf'" in message
    assert info.value.kv_bytes == 2 * GiB and info.value.weight_bytes == dense


def test_engine_refuses_before_allocating_a_pool_that_cannot_fit(gguf_dir):
    path = tiny_file(gguf_dir, "llama", Q.Q8_0)
    with pytest.raises(ModelTooLargeError, match=r"KV pool 100000\.00 GiB"):
        LLM(str(path), kv_cache_memory_gb=100_000)


# --- memory and disk ------------------------------------------------------------------------


def mapped_rss(path: Path) -> int:
    """Bytes of this process's RSS in mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_lookup_only_embedding_reads_its_rows_from_the_file(gguf_dir):
    """An untied embedding's lookups read its rows from the file (pread), not through the
    map: the same rows, and none of the map's pages in RSS. Gathered through the map, the
    same lookups put the embedding's pages there (whole page-cache folios a row)."""
    path = tiny_file(gguf_dir, "llama", Q.Q8_0, tied=False, hidden=2048, heads=16, kv_heads=4)
    r = runner(path, "gguf")
    embedding = r.model.embed_tokens
    assert isinstance(embedding, GGMLEmbedding) and embedding.read_rows is not None
    size = embedding.weight.nbytes  # 1024 rows of 2,176 bytes
    ids = torch.cat([torch.arange(1024), torch.tensor([7, 7, 1023, 0])])
    before = mapped_rss(path.resolve())
    rows = embedding(ids)
    prompt_logits(r)  # a whole step too
    assert mapped_rss(path.resolve()) - before < size // 8
    through_map = embedding.weight.select_rows(ids).dequantize()
    assert torch.equal(rows, through_map)
    assert mapped_rss(path.resolve()) - before > size // 2  # what the reads kept out
    with pytest.raises(IndexError):
        embedding.read_rows(torch.tensor([1024]))


MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch
    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams

    def written():
        with open("/proc/self/io") as f:
            return dict(line.split(": ") for line in f.read().splitlines())["write_bytes"]

    # What any model pays for, loaded before the baseline so the growth is the model's: the
    # first ops on the meta device (the model is built there) import torch's meta kernels,
    # ~150 MB of modules.
    from agentrt.engine.model.rope import RotaryEmbedding
    with torch.device("meta"):
        RotaryEmbedding(64, 8, 10000.0, None)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before_io = int(written())
    llm = LLM(sys.argv[1], num_kv_blocks=16, max_num_batched_tokens=32)
    out = llm.generate([list(range(5, 21))],
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    print(json.dumps({
        "before_rss": before_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "written": int(written()) - before_io,
        "kv_bytes": sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches),
        "quantization": llm.engine.model_config.quantization,
        "tokens": len(out[0].outputs[0].token_ids),
    }))
    """
)


@pytest.mark.slow
def test_loading_a_300m_q4_k_file_maps_it_and_writes_only_metadata(tmp_path_factory):
    """A ~300M-parameter Q4_K GGUF, loaded and run for two tokens in a fresh process: peak
    RSS grows by less than 1.3x the file plus the KV pool (the weights stay the file's
    pages; llama's un-permuted Q/K rows and the stacked gate_up are copies whose pages of
    the map are released), and the bytes the process writes (its config and tokenizer
    metadata) are under 1% of the file."""
    root = tmp_path_factory.mktemp("big-gguf")
    path = write_tiny_gguf(
        root / "q4k-300m.gguf",
        projection_type=Q.Q4_K,
        vocab_type=Q.Q4_K,
        hidden=1024,
        intermediate=2816,
        layers=24,
        heads=16,
        kv_heads=16,
    )
    size = path.stat().st_size
    entry = metadata_dir(path)  # in the user's cache, beside the built kernels
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["quantization"] == "gguf" and report["tokens"] == 2
    grown = report["peak_rss"] - report["before_rss"]
    assert grown < 1.3 * size + report["kv_bytes"], (grown, size)
    assert report["written"] < 0.01 * size, report
    try:
        assert sum(f.stat().st_size for f in entry.iterdir()) < 0.01 * size
    finally:
        shutil.rmtree(entry, ignore_errors=True)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_repack_on_the_loaders_threads_equals_interleave(num_threads: int) -> None:
    """The loader's repack (deferred to `run`: its own threads, each one C call taking shares
    of row groups) writes the bytes `ggml_linear.interleave` writes, for every type this build
    interleaves; shares of unequal size (200 row groups: 64, 64, 64, 8). `run` calls
    `alongside` on the calling thread meanwhile."""
    from agentrt.engine.loader.load import _Repacker
    from agentrt.engine.loader.safetensors_loader import StateDictLoader
    from agentrt.kernels.ggml_linear import block_shape, interleave, interleaved_row_bytes

    kernels = default_kernels()
    types = [q for q in Q if kernels.interleaves(q)]
    assert types  # Q4_0 ... Q8_0 on every build that has an interleaved layout
    generator = torch.Generator().manual_seed(0)
    repack = _Repacker(StateDictLoader({}), num_threads)
    filled = []  # (expected, into a new buffer, into a given one)
    for qtype in types:
        elems, size = block_shape(qtype)
        k, rows = 256, 200 * 16
        data = torch.randint(0, 256, (rows, k // elems * size), generator=generator)
        weight = GGMLWeight(data.to(torch.uint8), qtype, k)
        out = torch.zeros(rows // 16, interleaved_row_bytes(qtype, k), dtype=torch.uint8)
        given = repack.interleave(weight, out)
        assert given.data is out and given.interleaved
        filled.append((interleave(weight), repack.interleave(weight), out))
    callers = []
    repack.run(alongside=lambda: callers.append(threading.get_ident()))
    assert callers == [threading.get_ident()]
    for expected, new, given in filled:
        assert torch.equal(new.data, expected.data) and torch.equal(given, expected.data)
