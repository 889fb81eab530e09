"""The C paged-attention kernel (kernels/cpu_attention.c) against naive dense attention, its
input checks, and its build (cache, compiler errors)."""

from __future__ import annotations

import platform

import pytest
import torch

from agentrt.kernels import KernelBuildError, KernelInputError, load_cpu_attention
from agentrt.kernels.cpu_attention import SOURCE, CpuAttention
from agentrt.kernels.cpu_build import build_library
from agentrt.kernels.ggml_library import default_build_dir

# (seq_lens, query_lens): decodes; decodes and short chunks (jump-forward); prefills with and
# without cached context, longer than a work item's tile of query tokens.
BATCHES = [
    ([1], [1]),
    ([37, 5, 70], [1, 1, 1]),
    ([200, 16, 17, 33, 1, 96], [1, 4, 1, 16, 1, 7]),
    ([130, 61, 9], [130, 40, 2]),
]


# The builds below live in the engine's kernel folder, as its own build does: a library is
# keyed by the source, its headers, the flags and the CPU, so a cached one is the compile of
# this source. Each compiled afresh cost 6-14 s of CPU every run (the native one is the
# engine's own); test_build_is_cached_per_source_and_cpu still builds from scratch.


def build_with_flags(flags: str) -> CpuAttention:
    """The kernel built with $AGENTRT_CPU_KERNEL_CFLAGS set to `flags`, not through
    load_cpu_attention: its per-folder cache would hand this process's engines the build."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("AGENTRT_CPU_KERNEL_CFLAGS", flags)
        return CpuAttention(build_library(SOURCE, default_build_dir()))


@pytest.fixture(scope="module")
def kernel() -> CpuAttention:
    return load_cpu_attention(default_build_dir())


@pytest.fixture(scope="module")
def portable() -> CpuAttention:
    """The kernel built for a CPU without AVX-512 (so also without its bf16 dot products):
    one build for both dtypes' tests."""
    return build_with_flags("-mno-avx512f")


@pytest.fixture
def cpu_batch(make_paged_batch):
    """make_paged_batch, on the CPU whatever the test device."""

    def build(*args):
        batch = make_paged_batch(*args)
        for name in ("query", "kv_cache", "query_start_loc", "seq_lens", "block_tables"):
            setattr(batch, name, getattr(batch, name).cpu())
        return batch

    return build


def attend(kernel, batch, scale, out=None):
    out = torch.empty_like(batch.query) if out is None else out
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens)
    return kernel.paged_attention(*args, batch.block_tables, scale, out)


@pytest.mark.parametrize("seq_lens,query_lens", BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(
    kernel, cpu_batch, dense, tol, seq_lens, query_lens, num_heads, num_kv_heads, dtype
):
    # make_paged_batch fills unwritten slots and spare blocks with NaN: any read past a
    # context would show in the output.
    batch = cpu_batch(seq_lens, query_lens, num_heads, num_kv_heads, 64, 16, dtype)
    out = torch.empty_like(batch.query)
    assert attend(kernel, batch, 0.125, out) is out
    assert not out.isnan().any()
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(out.double(), dense(batch, scale=0.125), **accuracy)


@pytest.mark.parametrize("head_dim,block_size", [(32, 8), (128, 32), (80, 16), (64, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_other_head_dims_and_block_sizes(
    kernel, cpu_batch, dense, tol, head_dim, block_size, dtype
):
    # bf16 with head_dim 80 (not a multiple of 32) takes the portable path on every CPU.
    batch = cpu_batch([150, 3, 64], [20, 1, 3], 6, 2, head_dim, block_size, dtype)
    out = attend(kernel, batch, head_dim**-0.5)
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(out.double(), dense(batch), **accuracy)


def test_paged_attention_writes_only_the_requests_rows(kernel, cpu_batch, dense):
    """Rows of `out` that belong to no request (here 2 before and 3 after) are untouched."""
    batch = cpu_batch([40, 21, 9], [5, 1, 1], 4, 2, 64, 16, torch.float32)
    expected = dense(batch, scale=0.125)
    batch.query = torch.cat([torch.zeros(2, 4, 64), batch.query, torch.zeros(3, 4, 64)])
    batch.query_start_loc += 2
    out = attend(kernel, batch, 0.125, torch.full_like(batch.query, 7.0))
    assert (out[:2] == 7.0).all() and (out[-3:] == 7.0).all()
    torch.testing.assert_close(out[2:-3].double(), expected, atol=1e-5, rtol=0)


def windowed_dense(batch, scale: float, window: int | None, softcap: float | None):
    """dense_attention with transformers' sliding window (position p sees keys
    p - window < j <= p) and Gemma 2's soft-capped scores (float64, no paging)."""
    q_all = batch.query.double()
    out = torch.empty_like(q_all)
    cu = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        k, v = batch.keys[i].double(), batch.values[i].double()
        group = q_all.shape[1] // k.shape[1]
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(q_all.shape[1]):
                scores = k[first : pos + 1, h // group] @ q_all[cu[i] + j, h] * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[cu[i] + j, h] = scores.softmax(0) @ v[first : pos + 1, h // group]
    return out


@pytest.mark.parametrize("window,softcap", [(24, None), (7, None), (None, 2.0), (40, 5.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_window_and_softcap(kernel, cpu_batch, tol, window, softcap, dtype):
    """A sliding window and soft-capped scores as transformers computes them; the table
    entries of blocks wholly before a request's windows point at a NaN block (a freed one's
    id), so reading one would show."""
    batch = cpu_batch([200, 16, 17, 33, 1, 96, 130], [1, 4, 1, 16, 1, 7, 60], 9, 3, 64, 16, dtype)
    if window is not None:
        spare = batch.block_tables[0, -1].item()  # never written: NaN
        cu = batch.query_start_loc.tolist()
        for i, seq_len in enumerate(batch.seq_lens.tolist()):
            first = max(0, seq_len - (cu[i + 1] - cu[i]) - window + 1)
            batch.block_tables[i, : first // 16] = spare
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens)
    kernel.paged_attention(*args, batch.block_tables, 0.3, out, window, softcap)
    assert not out.isnan().any()
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    expected = windowed_dense(batch, 0.3, window, softcap)
    torch.testing.assert_close(out.double(), expected, **accuracy)


def test_paged_attention_rejects_bad_input(kernel, cpu_batch):
    batch = cpu_batch([20, 7], [3, 1], 4, 2, 64, 16, torch.float32)
    names = ("query", "kv_cache", "query_start_loc", "seq_lens", "block_tables")
    args = {name: getattr(batch, name) for name in names}
    query, tables = batch.query, batch.block_tables
    out = torch.empty_like(query)

    def call(**changes):
        return kernel.paged_attention(**(args | {"scale": 0.125, "out": out} | changes))

    with pytest.raises(KernelInputError, match="float32 or bfloat16"):
        call(query=query.half(), kv_cache=batch.kv_cache.half(), out=out.half())
    with pytest.raises(KernelInputError, match="query is torch.bfloat16 but kv_cache is"):
        call(query=query.bfloat16(), out=out.bfloat16())
    with pytest.raises(KernelInputError, match="seq_lens must hold"):
        call(seq_lens=torch.tensor([20, 10_000], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="seq_lens must hold"):
        call(seq_lens=torch.tensor([2, 7], dtype=torch.int32))  # fewer than 3 query tokens
    with pytest.raises(KernelInputError, match="block_tables holds ids outside"):
        call(block_tables=tables + 1_000)
    with pytest.raises(KernelInputError, match="past query's 4 rows"):
        call(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="non-decreasing"):
        call(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="seq_lens has dtype"):
        call(seq_lens=batch.seq_lens.long())
    with pytest.raises(KernelInputError, match="block_tables has stride 2 in its last dim"):
        call(block_tables=torch.cat([tables, tables], dim=1)[:, ::2])
    with pytest.raises(KernelInputError, match="block_tables must be a contiguous"):
        call(block_tables=torch.cat([tables, tables], dim=1)[:, : tables.shape[1]])
    with pytest.raises(KernelInputError, match="each is None or positive"):
        call(window=0)
    with pytest.raises(KernelInputError, match="GQA groups"):
        call(query=torch.randn(4, 34, 64), out=torch.empty(4, 34, 64))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 compiler flags")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_path_without_avx512(portable, kernel, cpu_batch, dense, tol, dtype):
    """Built for a CPU without AVX-512, the kernel's portable vector code gives the same
    results."""
    assert portable.path.name != kernel.path.name  # built with other flags, not the native one
    batch = cpu_batch(*BATCHES[2], 9, 3, 64, 16, dtype)
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    out = attend(portable, batch, 0.125)
    torch.testing.assert_close(out.double(), dense(batch, scale=0.125), **accuracy)


# Real models' attention shapes: (query heads, KV heads, head_dim, sliding window).
MODEL_SHAPES = {
    "smollm2-135m": (9, 3, 64, None),
    "llama-3.2-1b": (32, 8, 64, None),
    "qwen2.5-0.5b": (14, 2, 64, None),
    "qwen2.5-1.5b": (12, 2, 128, None),
    "qwen3-0.6b": (16, 8, 128, None),
    "phi-3.5-mini": (32, 32, 96, None),
    "gemma3-1b-local": (4, 1, 256, 24),
}
# Prompt lengths around the work items' tiles, each alone and after 45 cached tokens (a later
# chunk of a chunked prefill, at a position offset).
PROMPTS = [1, 7, 31, 32, 33, 100, 511]
PREFIX = 45


def reference(batch, scale: float, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) attention of each request over its dense context, in
    float64, one batched product per request."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    cu = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.query[cu[i] : cu[i + 1]].double()  # (L, H, D)
        group = q.shape[1] // batch.keys[i].shape[1]
        k, v = (
            x.double().repeat_interleave(group, dim=1) for x in (batch.keys[i], batch.values[i])
        )
        scores = torch.einsum("lhd,shd->hls", q, k) * scale  # (H, L, S)
        pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]  # each query's position
        key = torch.arange(seq_len)[None, :]
        seen = (key <= pos) & (key > pos - window if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
    return out


def as_decodes(batch):
    """(query_start_loc, seq_lens, block_tables) that make each query row of batch's requests
    a decode of its own (one query token at its position, through its request's blocks)."""
    cu = batch.query_start_loc.tolist()
    seq_lens, tables = [], []
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        n = cu[i + 1] - cu[i]
        seq_lens += range(seq_len - n + 1, seq_len + 1)
        tables += [batch.block_tables[i]] * n
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return starts, torch.tensor(seq_lens, dtype=torch.int32), torch.stack(tables).contiguous()


@pytest.mark.parametrize(
    "model,block_size",
    [(model, 16) for model in MODEL_SHAPES] + [("smollm2-135m", 8), ("qwen2.5-1.5b", 8)],
)
def test_prefills_match_dense_at_model_shapes(kernel, cpu_batch, model, block_size):
    """Prompts of every length around the tiles, alone and after cached tokens, at each
    model's heads: within fp32 rounding of float64 attention (unwritten slots are NaN).
    Blocks of 8 make every key group a short one."""
    heads, kv_heads, dim, window = MODEL_SHAPES[model]
    query_lens = PROMPTS * 2
    seq_lens = PROMPTS + [PREFIX + n for n in PROMPTS]
    batch = cpu_batch(seq_lens, query_lens, heads, kv_heads, dim, block_size, torch.float32)
    out = torch.empty_like(batch.query)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens)
    kernel.paged_attention(*args, batch.block_tables, dim**-0.5, out, window)
    expected = reference(batch, dim**-0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# x86 builds of the kernel without AVX-512: AVX2 with FMA (the portable fixture), and SSE
# without FMA (every product rounded before its sum).
NO_FMA_FLAGS = "-mno-avx512f -mno-avx2 -mno-fma -mno-avx"


@pytest.fixture(scope="module")
def no_fma() -> CpuAttention:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 compiler flags")
    return build_with_flags(NO_FMA_FLAGS)


@pytest.mark.parametrize(
    "model,block_size",
    [
        ("smollm2-135m", 16),
        ("llama-3.2-1b", 8),
        ("qwen3-0.6b", 16),
        ("phi-3.5-mini", 16),
        ("gemma3-1b-local", 32),
    ],
)
@pytest.mark.parametrize("build", ["native", "avx2", "sse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_equal_their_decodes(request, cpu_batch, model, block_size, build, dtype):
    """A prompt's rows (wide items, 16 rows a vector) have the bits each row gets as a decode
    (row items): the key groups and every sum's rounding order are the same, so the wide
    items change no model's output. 8a42614's wide items summed the scores in another order:
    within fp32 rounding, yet the embedded SmolLM2's greedy reply changed at token 6. Blocks
    of 8: short key groups; Gemma's window with blocks of 32: items that start at other rows
    still group the keys alike."""
    if build == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 compiler flags")
    kernel = request.getfixturevalue(
        {"native": "kernel", "avx2": "portable", "sse": "no_fma"}[build]
    )
    heads, kv_heads, dim, window = MODEL_SHAPES[model]
    softcap = 30.0 if window else None  # soft-capped scores (Gemma 2's) too
    batch = cpu_batch([33, PREFIX + 100], [33, 100], heads, kv_heads, dim, block_size, dtype)

    def attend_rows(*metadata):
        out = torch.empty_like(batch.query)
        return kernel.paged_attention(
            batch.query, batch.kv_cache, *metadata, 0.1, out, window, softcap
        )

    prefill = attend_rows(batch.query_start_loc, batch.seq_lens, batch.block_tables)
    decodes = attend_rows(*as_decodes(batch))
    assert not prefill.isnan().any()
    assert torch.equal(prefill, decodes), (prefill != decodes).float().mean().item()


def test_build_is_cached_per_source_and_cpu(tmp_path):
    first = load_cpu_attention(tmp_path)
    assert first.path.parent == tmp_path and first.path.suffix == ".so"
    mtime = first.path.stat().st_mtime_ns
    load_cpu_attention.cache_clear()
    again = load_cpu_attention(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary left


def test_build_errors_name_the_compiler(tmp_path, monkeypatch):
    load_cpu_attention.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(KernelBuildError, match="no C compiler 'no-such-compiler-xyz'"):
        load_cpu_attention(tmp_path / "a")
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(KernelBuildError, match="compiling cpu_attention.c with 'false' failed"):
        load_cpu_attention(tmp_path / "b")
    assert not any((tmp_path / "b").iterdir())  # the failed build left nothing behind


def test_metadata_is_checked_once_per_step_and_again_when_it_changes(kernel, cpu_batch):
    """Every layer of a step passes the same metadata tensors: they are validated on the
    first call only. Changed in place (their version moves on), or replaced by new tensors,
    they are validated again."""
    batch = cpu_batch([20, 7], [3, 1], 4, 2, 64, 16, torch.float32)
    first = attend(kernel, batch, 0.125)
    torch.testing.assert_close(attend(kernel, batch, 0.125), first)  # the same again
    batch.block_tables += 1_000  # in place: same tensor, newer version
    with pytest.raises(KernelInputError, match="block_tables holds ids outside"):
        attend(kernel, batch, 0.125)
    batch.block_tables = batch.block_tables - 1_000
    batch.seq_lens = torch.tensor([20, 10_000], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="seq_lens must hold"):
        attend(kernel, batch, 0.125)


def test_inference_metadata_is_checked_per_new_tensor(kernel, cpu_batch):
    """The engine's metadata are inference tensors (no version counter): new tensors are
    checked, the same ones are not checked again."""
    with torch.inference_mode():
        batch = cpu_batch([20, 7], [3, 1], 4, 2, 64, 16, torch.float32)
        first = attend(kernel, batch, 0.125)
        torch.testing.assert_close(attend(kernel, batch, 0.125), first)
        batch.block_tables = batch.block_tables + 1_000
        with pytest.raises(KernelInputError, match="block_tables holds ids outside"):
            attend(kernel, batch, 0.125)


def test_tensors_laid_out_otherwise_are_checked_again(kernel, cpu_batch):
    """After a call, the same metadata with an `out` or a query of another layout (strides,
    dtype) than the call's is checked anew, not taken as checked."""
    batch = cpu_batch([20, 7], [3, 1], 4, 2, 64, 16, torch.float32)
    attend(kernel, batch, 0.125)
    args = (batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125)
    strided = torch.empty(64, 4, 4).transpose(0, 2)  # the query's shape, not contiguous
    with pytest.raises(KernelInputError, match="out"):
        kernel.paged_attention(batch.query, *args, strided)
    with pytest.raises(KernelInputError, match="query is torch.bfloat16"):
        query = batch.query.bfloat16()
        kernel.paged_attention(query, *args, torch.empty_like(query))
