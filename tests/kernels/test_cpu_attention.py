"""The C paged-decode kernel (kernels/cpu_attention.c) against naive dense attention, its
input checks, and its build (cache, compiler errors)."""

from __future__ import annotations

import pytest
import torch

from agentrt.kernels import KernelBuildError, KernelInputError, load_cpu_attention
from agentrt.kernels.cpu_attention import CpuAttention

SEQ_LENS = [[1], [37, 5, 70], [200, 16, 17, 33, 1, 96]]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> CpuAttention:
    return load_cpu_attention(tmp_path_factory.mktemp("kernels"))


@pytest.fixture
def cpu_batch(make_paged_batch):
    """make_paged_batch, on the CPU whatever the test device."""

    def build(*args):
        batch = make_paged_batch(*args)
        for name in ("query", "kv_cache", "query_start_loc", "seq_lens", "block_tables"):
            setattr(batch, name, getattr(batch, name).cpu())
        return batch

    return build


def decode_args(batch):
    """The kernel's arguments for a decode-only batch (one query row per request)."""
    num = batch.seq_lens.shape[0]
    return (
        batch.query,
        batch.kv_cache,
        torch.arange(num),
        batch.seq_lens,
        batch.block_tables.contiguous(),
    )


@pytest.mark.parametrize("seq_lens", SEQ_LENS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_dense(
    kernel, cpu_batch, dense, tol, seq_lens, num_heads, num_kv_heads, dtype
):
    # make_paged_batch fills unwritten slots and spare blocks with NaN: any read past a
    # context would show in the output.
    batch = cpu_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, 64, 16, dtype)
    out = torch.empty_like(batch.query)
    returned = kernel.paged_decode(*decode_args(batch), 0.125, out)
    assert returned is out
    assert not out.isnan().any()
    expected = dense(batch, scale=0.125)
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(out.double(), expected, **accuracy)


@pytest.mark.parametrize("head_dim,block_size", [(32, 8), (128, 32), (80, 16), (64, 128)])
def test_paged_decode_other_head_dims_and_block_sizes(
    kernel, cpu_batch, dense, head_dim, block_size
):
    batch = cpu_batch([150, 3, 64], [1, 1, 1], 6, 2, head_dim, block_size, torch.float32)
    out = kernel.paged_decode(*decode_args(batch), head_dim**-0.5, torch.empty_like(batch.query))
    torch.testing.assert_close(out.double(), dense(batch), atol=1e-5, rtol=1e-5)


def test_paged_decode_writes_only_the_decode_rows(kernel, cpu_batch, dense):
    """In a mixed step the prefill rows of `out` belong to another path: left untouched."""
    batch = cpu_batch([40, 21, 9], [5, 1, 1], 4, 2, 64, 16, torch.float32)
    out = torch.full_like(batch.query, 7.0)
    rows = torch.tensor([1, 2])
    kernel.paged_decode(
        batch.query,
        batch.kv_cache,
        torch.tensor([5, 6]),  # the flat rows of requests 1 and 2
        batch.seq_lens[rows].contiguous(),
        batch.block_tables[rows].contiguous(),
        0.125,
        out,
    )
    assert (out[:5] == 7.0).all()
    torch.testing.assert_close(out[5:].double(), dense(batch, scale=0.125)[5:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_state_continues_the_softmax_exactly(kernel, cpu_batch, dense, tol, dtype):
    """Rows with starts > 0 take the attention over their first positions from init_out /
    init_lse (here from dense float64 attention) and attend only the rest; row 1 starts
    past its whole context, row 2 at 0."""
    seq_lens = [70, 32, 45]
    batch = cpu_batch(seq_lens, [1, 1, 1], 6, 2, 64, 16, dtype)
    starts = torch.tensor([48, 32, 0], dtype=torch.int32)
    init_out = torch.zeros(3, 6, 64)
    init_lse = torch.zeros(3, 6)
    for i, start in enumerate(starts.tolist()):
        if start:
            k, v = batch.keys[i][:start].double(), batch.values[i][:start].double()
            q = batch.query[i].double().view(2, 3, 64)
            scores = torch.einsum("hgd,thd->hgt", q, k) * 0.125
            init_lse[i] = torch.logsumexp(scores, -1).reshape(6).float()
            init_out[i] = torch.einsum("hgt,thd->hgd", scores.softmax(-1), v).reshape(6, 64).float()
    out = kernel.paged_decode(
        *decode_args(batch), 0.125, torch.empty_like(batch.query), starts, init_out, init_lse
    )
    accuracy = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else tol(dtype)
    torch.testing.assert_close(out.double(), dense(batch, scale=0.125), **accuracy)


def test_paged_decode_rejects_bad_input(kernel, cpu_batch):
    batch = cpu_batch([20, 7], [1, 1], 4, 2, 64, 16, torch.float32)
    query, cache, index, lens, tables = decode_args(batch)
    out = torch.empty_like(query)

    def call(**changes):
        args = dict(
            query=query, kv_cache=cache, token_index=index, seq_lens=lens, block_tables=tables
        )
        return kernel.paged_decode(**(args | {"scale": 0.125, "out": out} | changes))

    with pytest.raises(KernelInputError, match="query has dtype torch.float16"):
        call(query=query.half(), out=out.half())
    with pytest.raises(KernelInputError, match="dtype and head_dim must match"):
        call(query=query.bfloat16(), out=out.bfloat16())
    with pytest.raises(KernelInputError, match="seq_lens must lie in"):
        call(seq_lens=torch.tensor([20, 10_000], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="block_tables holds ids outside"):
        call(block_tables=tables + 1_000)
    with pytest.raises(KernelInputError, match="token_index holds rows outside"):
        call(token_index=torch.tensor([0, 2]))
    with pytest.raises(KernelInputError, match="seq_lens has dtype"):
        call(seq_lens=lens.long())
    with pytest.raises(KernelInputError, match="block_tables must be a contiguous"):
        call(block_tables=torch.cat([tables, tables], dim=1)[:, ::2])
    with pytest.raises(KernelInputError, match="GQA groups"):
        call(query=torch.randn(2, 3, 64), out=torch.empty(2, 3, 64))
    starts = torch.tensor([16, 0], dtype=torch.int32)
    state = dict(init_out=torch.zeros(2, 4, 64), init_lse=torch.zeros(2, 4))
    with pytest.raises(KernelInputError, match="init_lse is None; a cascade needs"):
        call(starts=starts, init_out=state["init_out"])
    with pytest.raises(KernelInputError, match="starts must be multiples of block_size"):
        call(starts=torch.tensor([8, 0], dtype=torch.int32), **state)
    with pytest.raises(KernelInputError, match="starts must be multiples of block_size"):
        call(starts=torch.tensor([32, 0], dtype=torch.int32), **state)  # past seq_lens[0]


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
