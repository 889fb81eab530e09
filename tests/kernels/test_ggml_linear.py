"""The GGML block-type kernels (kernels/ggml_linear.py, ggml_quants.c) against gguf-py's numpy
dequantize, on random blocks, for every instruction set this CPU runs.

Random bytes are valid blocks of every type once the fp16 d / dmin fields hold finite values
(`ggml_helpers.random_weight`).

Tolerances. The kernel quantizes each activation row to int8 per block of 32
(d = max|x| / 127, q = round(x / d)) and sums integer products, so it computes exactly
x_hat @ W.T with x_hat = q * d, up to fp32 rounding of the per-group sums (blocks of 256,
ggml's Q8_K, for Q4_K / Q5_K / Q6_K on AVX-512: `act_block`). Two checks:
  * against x_hat @ W.T (the activation rounding replayed in torch): within 1e-5 of
    |x_hat| @ |W|.T, fp32 summation-order noise;
  * against x @ W.T (gguf's reference, unquantized x): within |W| @ (d / 2).T, the bound of
    the rounding itself (|x_hat - x| <= d / 2 per element), plus that fp32 slack.
Dequantization and the embedding lookup agree with gguf's dequantize bit for bit.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from agentrt.kernels import ggml_linear as G
from agentrt.kernels.cpu_build import build_library
from agentrt.kernels.errors import KernelInputError
from agentrt.kernels.ggml_library import EXTRA_FLAGS, SOURCE
from tests.kernels.ggml_helpers import random_weight

Q = gguf.GGMLQuantizationType
TYPES = sorted(G.QUANTIZED_TYPES)
ISAS = G.available_isas()
N, K = 40, 512


@pytest.fixture(scope="module")
def weights():
    """qtype -> (weight (N, K), gguf's dequantized (N, K) fp32)."""
    out = {}
    for i, qtype in enumerate(TYPES):
        w = random_weight(qtype, N, K, seed=i)
        out[qtype] = (w, G.dequantize_ref(w))
    return out


@pytest.fixture(params=ISAS)
def kern(request):
    """Each build this CPU runs (AGENTRT_GGML_ISA picks one per process; see the last tests)."""
    return G.load_ggml_kernels(G.default_build_dir(), request.param)


def quantize_rows_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding in torch: (x_hat (T, K), d (T, K) per element)."""
    blocks = x.float().view(x.shape[0], -1, block)  # (T, K / block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    # A true division (a Python scalar over a tensor would be reciprocal-then-multiply).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    d = amax / 127.0
    x_hat = torch.round(blocks * inv) * d
    return x_hat.view_as(x), d.expand_as(blocks).reshape(x.shape)


def check_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, block: int) -> None:
    x_hat, d = quantize_rows_ref(x, block)
    slack = 1e-5 * (x_hat.abs() @ dense.abs().T) + 1e-30
    assert ((y - x_hat @ dense.T).abs() <= slack).all()
    bound = (d / 2) @ dense.abs().T + slack
    assert ((y - x.float() @ dense.T).abs() <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: Q(t).name)
def test_product_matches_gguf_reference(kern, weights, qtype):
    w, dense = weights[qtype]
    gen = torch.Generator().manual_seed(qtype)
    for rows in (1, 3, 16, 64):
        x = torch.randn(rows, K, generator=gen)
        check_product(G.ggml_linear(x, w, kernels=kern), x, dense, kern.act_block(qtype))
    # bf16 rows in, and the bf16-out variant (one more rounding, to bf16, of each sum)
    xb = torch.randn(5, K, generator=gen).bfloat16()
    check_product(G.ggml_linear(xb, w, kernels=kern), xb, dense, kern.act_block(qtype))
    y = G.ggml_linear_bf16(xb, w, kernels=kern)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, G.ggml_linear(xb, w, kernels=kern).bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: Q(t).name)
def test_dequantize_and_embedding_are_gguf_exactly(kern, weights, qtype):
    w, dense = weights[qtype]
    assert torch.equal(w.dequantize(kernels=kern), dense)
    assert torch.equal(w.dequantize(torch.bfloat16, kernels=kern), dense.bfloat16())
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(G.ggml_embedding(ids, w, kernels=kern), dense[ids])
    # the fast decoders: scale * u + bias, an fp32 rounding or two from gguf's order
    fast = w.dequantize(kernels=kern, exact=False)
    torch.testing.assert_close(fast, dense, atol=1e-6 * dense.abs().max().item(), rtol=1e-6)
    assert torch.equal(w.dequantize(torch.bfloat16, kern, exact=False), fast.bfloat16())


def test_ggml_linear_ref_is_x_times_dequantized(weights):
    w, dense = weights[Q.Q4_K]
    x = torch.randn(2, K)
    torch.testing.assert_close(G.ggml_linear_ref(x, w), x @ dense.T)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q5_0], ids=lambda t: Q(t).name)
def test_long_step_over_several_activation_tiles(kern, qtype):
    """A step of more rows than one activation tile holds (~256 KiB quantized) gives each row
    what it gives alone: a row's numbers do not depend on its step."""
    w = random_weight(qtype, 24, K, seed=7)
    x = torch.randn(520, K)
    y = G.ggml_linear(x, w, kernels=kern)
    check_product(y, x, G.dequantize_ref(w), kern.act_block(qtype))
    for t in (0, 257, 519):
        assert torch.equal(G.ggml_linear(x[t : t + 1], w, kernels=kern)[0], y[t])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: Q(t).name)
def test_threads_split_the_rows_with_one_threads_bits(kern, qtype):
    """A product large enough for the team (N K >= ggml_quants.c's PARALLEL_WORK): one row (a
    decode, quantized before the team starts) and a step of several activation tiles give on
    2 and 3 threads the bits one thread gives, in the layout the build holds the type in."""
    w = random_weight(qtype, 256, K, seed=qtype)
    dense = G.dequantize_ref(w)
    if kern.interleaves(qtype):
        w = G.interleave(w, kern)
    x = torch.randn(520, K, generator=torch.Generator().manual_seed(qtype))
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got[threads] = (
                G.ggml_linear(x[:1], w, kernels=kern),
                G.ggml_linear(x, w, kernels=kern),
            )
    finally:
        torch.set_num_threads(before)
    check_product(got[1][1], x, dense, kern.act_block(qtype))
    assert torch.equal(got[1][0][0], got[1][1][0])
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(got[threads], got[1], strict=True))


def test_out_as_a_column_slice_of_a_wider_tensor(kern, weights):
    """Fused projections of mixed types (Q4_K_M's Q4_K and Q6_K) write side by side."""
    (w1, d1), (w2, d2) = weights[Q.Q4_K], weights[Q.Q6_K]
    for rows in (1, 7, 40):
        x = torch.randn(rows, K)
        out = torch.full((rows, 2 * N + 3), float("nan"))
        assert G.ggml_linear(x, w1, out[:, :N], kern).data_ptr() == out.data_ptr()
        G.ggml_linear(x, w2, out[:, N : 2 * N], kern)
        check_product(out[:, :N], x, d1, kern.act_block(Q.Q4_K))
        check_product(out[:, N : 2 * N], x, d2, kern.act_block(Q.Q6_K))
        assert out[:, 2 * N :].isnan().all()  # nothing written past the slices


# --- Rows interleaved by 16 (AVX-512: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q6_K; AVX2: the first five) ---

INTERLEAVED = sorted(G.INTERLEAVED_TYPES)


def check_layout_at_one_place(x16: G.GGMLWeight, w: G.GGMLWeight, qtype: int) -> None:
    """The layout of `interleave`'s docstring, read at group 0, row 5, block 1."""
    size = G.block_shape(qtype)[1]
    at = G.interleaved_row_bytes(qtype, K) // (K // G.block_shape(qtype)[0])  # block 1
    blk, place = w.data[5, size : 2 * size], x16.data[0, at:]  # the file's; the group's
    if qtype == Q.Q6_K:  # d, sub-block 3's scale, then steps of ql / qh / ql columns
        assert torch.equal(place[10:12], blk[208:210])
        assert place[32 + 16 * 3 + 5] == blk[192 + 3]
        # ql[64 + 20]: n 1, the first column set, l 20 (h 1, i 1, j 0): step 3
        assert place[288 + 768 * 3 + 64 + 20] == blk[64 + 20]
        # ql[64 + 32 + 20]: n 1, the second column set (after qh's), l 20: step 3
        assert place[288 + 768 * 3 + 512 + 64 + 20] == blk[64 + 32 + 20]
        # qh[7]: n 0, l 7 (h 0, i 1, j 3): step 0
        assert place[288 + 256 + 64 + 20 + 3] == blk[128 + 7]
        return
    assert torch.equal(place[10:12], blk[:2])  # d
    if qtype == Q.Q4_K:  # dmin; sub-block 2's 6-bit scale and min, unpacked; then columns
        assert torch.equal(place[42:44], blk[2:4])
        assert place[64 + 32 + 5] == blk[4 + 2] & 63 and place[192 + 32 + 10] == blk[8 + 2] & 63
        columns, quants = 320, blk[16:]
    else:
        head = 4 if qtype in (Q.Q4_1, Q.Q5_1) else 2
        columns, quants = 16 * head, blk[head:]
        if qtype in (Q.Q5_0, Q.Q5_1):  # mask c's bits 20 .. 23 (row 5): qh's bits 4c .. 4c + 3
            qh = int.from_bytes(bytes(quants[:4].tolist()), "little")
            for c in range(8):
                assert (place[columns + 8 * c + 2] >> 4) == (qh >> (4 * c)) & 15
            columns, quants = columns + 64, quants[4:]
    column = place[columns + 64 + 20 : columns + 64 + 24]  # column 1, lane 5
    assert torch.equal(column, quants[4:8] ^ 0x80 if qtype == Q.Q8_0 else quants[4:8])


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: Q(t).name)
def test_interleaved_layout_is_the_documented_one_and_gives_back_its_rows(qtype):
    w = random_weight(qtype, 48, K, seed=qtype)
    x16 = G.interleave(w)
    assert x16.interleaved and x16.out_features == 48
    grown = (2368, 16 * 144) if qtype == Q.Q4_K else (1, 1)  # Q4_K: its scales unpacked
    assert x16.nbytes * grown[1] == w.nbytes * grown[0]
    check_layout_at_one_place(x16, w, qtype)
    assert torch.equal(G.deinterleave(x16).data, w.data)
    assert torch.equal(x16.dequantize(), w.dequantize())
    ids = torch.tensor([47, 0, 16, 5, 5])
    assert torch.equal(x16.select_rows(ids).data, w.data[ids])
    assert torch.equal(G.ggml_embedding(ids, x16), G.ggml_embedding(ids, w))
    part = x16.select_rows(slice(16, 48))  # whole groups: still interleaved, a view
    assert part.interleaved and part.data.data_ptr() == x16.data[1].data_ptr()
    assert torch.equal(part.dequantize(), w.dequantize()[16:48])
    assert torch.equal(x16.select_rows(slice(3, 40, 2)).data, w.data[3:40:2])
    assert torch.equal(pickle.loads(pickle.dumps(x16)).data, x16.data)


@pytest.mark.parametrize("qtype", INTERLEAVED, ids=lambda t: Q(t).name)
def test_interleaved_product_matches_gguf_reference(kern, qtype):
    """Each build that runs the type interleaved (AVX-512: all seven; AVX2: the legacy five); the
    others refuse the layout rather than misread it."""
    w = random_weight(qtype, 48, K, seed=qtype)
    dense, x16 = G.dequantize_ref(w), G.interleave(w, kern)
    if not kern.interleaves(qtype):
        assert (kern.isa, qtype) not in {("avx512", t) for t in INTERLEAVED}
        with pytest.raises(KernelInputError, match="refused"):
            G.ggml_linear(torch.randn(2, K), x16, kernels=kern)
        return
    gen = torch.Generator().manual_seed(qtype)
    for rows in (1, 3, 16, 64):
        x = torch.randn(rows, K, generator=gen)
        y = G.ggml_linear(x, x16, kernels=kern)
        check_product(y, x, dense, kern.act_block(qtype))
        # the file's layout through the other kernel: the same sums in another order
        other = G.ggml_linear(x, w, kernels=kern)
        torch.testing.assert_close(y, other, rtol=1e-5, atol=1e-5 * other.abs().max().item())
    xb = torch.randn(5, K, generator=gen).bfloat16()
    y = G.ggml_linear_bf16(xb, x16, kernels=kern)
    torch.testing.assert_close(y, G.ggml_linear(xb, x16, kernels=kern).bfloat16(), atol=0, rtol=0)
    # a row's numbers do not depend on its step (tiles of activations, passes of 4 rows)
    x = torch.randn(520, K, generator=gen)
    y = G.ggml_linear(x, x16, kernels=kern)
    for t in (0, 3, 257, 519):
        assert torch.equal(G.ggml_linear(x[t : t + 1], x16, kernels=kern)[0], y[t])


@pytest.mark.skipif("avx512" not in ISAS, reason="no AVX-512 VNNI build on this CPU")
def test_interleaved_q6k_without_gfni_gives_the_same_sums():
    """Q6_K's interleaved kernel places its high bits by GFNI where the CPU has it, by a
    shift and a mask otherwise (AVX-512 VNNI CPUs without GFNI, e.g. Cascade Lake): that
    build, compiled here with -mno-gfni, gives the same sums bit for bit."""
    flags = G.ISAS["avx512"][1] + EXTRA_FLAGS + ("-mno-gfni",)
    plain = G.GGMLKernels(build_library(SOURCE, G.default_build_dir(), flags), "avx512")
    w = random_weight(Q.Q6_K, 48, K, seed=7)
    x16 = G.interleave(w)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(7))
    y = G.ggml_linear(x, x16, kernels=plain)
    assert torch.equal(
        y, G.ggml_linear(x, x16, kernels=G.load_ggml_kernels(G.default_build_dir(), "avx512"))
    )
    check_product(y, x, G.dequantize_ref(w), plain.act_block(Q.Q6_K))


def test_interleaving_is_refused_where_there_is_no_such_layout_or_kernel():
    for qtype, rows in ((Q.Q3_K, 48), (Q.Q5_K, 48), (Q.Q4_0, 40)):
        with pytest.raises(KernelInputError, match="no interleaved layout"):
            G.interleave(random_weight(qtype, rows, K))
    x16 = G.interleave(random_weight(Q.Q4_0, 48, K))
    with pytest.raises(KernelInputError, match="expected uint8"):
        G.GGMLWeight(x16.data[:, :-18], Q.Q4_0, K, interleaved=True)
    with pytest.raises(KernelInputError, match="no interleaved layout"):
        G.GGMLWeight(random_weight(Q.Q5_K, 16, K).data.reshape(1, -1), Q.Q5_K, K, True)
    for isa in ISAS:  # which build runs which type interleaved
        kern = G.load_ggml_kernels(G.default_build_dir(), isa)
        for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
            assert kern.interleaves(qtype) == (isa != "scalar")
        assert kern.interleaves(Q.Q4_K) == kern.interleaves(Q.Q6_K) == (isa == "avx512")
        assert not kern.interleaves(Q.Q5_K)


def test_select_rows(weights):
    w, dense = weights[Q.Q5_0]
    part = w.select_rows(slice(8, 24))
    assert part.data.data_ptr() == w.data.data_ptr() + 8 * w.data.stride(0)  # a view
    assert part.out_features == 16 and part.nbytes == 16 * w.data.shape[1]
    assert torch.equal(part.dequantize(), dense[8:24])
    perm = torch.randperm(N)
    assert torch.equal(w.select_rows(perm).dequantize(), dense[perm])
    x = torch.randn(3, K)
    check_product(G.ggml_linear(x, part), x, dense[8:24], G.default_kernels().act_block(Q.Q5_0))


def test_pickled_or_copied_weight_reads_its_own_bytes(weights):
    """The copy's kernel arguments point at the copy's tensor, not the original's."""
    w, dense = weights[Q.Q6_K]
    x = torch.randn(2, K)
    for other in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w)):
        assert other.data.data_ptr() != w.data.data_ptr()
        assert other._c_args[0] == other.data.data_ptr()
        assert torch.equal(G.ggml_linear(x, other), G.ggml_linear(x, w))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda t: Q(t).name)
def test_dense_types(qtype):
    dtype = G.DENSE_DTYPES[qtype]
    dense = torch.randn(24, 64).to(dtype)
    w = G.GGMLWeight(dense.view(torch.uint8), int(qtype), 64)
    assert torch.equal(w.dequantize(), dense.float())
    x = torch.randn(3, 64)
    torch.testing.assert_close(G.ggml_linear(x, w), x @ dense.float().T)
    torch.testing.assert_close(G.ggml_linear_ref(x, w), x @ dense.float().T)
    assert torch.equal(G.ggml_embedding(torch.tensor([5, 1]), w), dense.float()[[5, 1]])


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0, Q.Q8_K], ids=lambda t: Q(t).name)
def test_unsupported_type_names_tensor_type_and_supported_list(qtype):
    with pytest.raises(G.UnsupportedGGMLType) as info:
        G.check_ggml_type(int(qtype), "blk.3.ffn_down.weight")
    message = str(info.value)
    assert "blk.3.ffn_down.weight" in message and Q(qtype).name in message
    assert "Q4_K" in message and "Q6_K" in message and "BF16" in message
    assert isinstance(info.value, KernelInputError)
    with pytest.raises(G.UnsupportedGGMLType):
        G.GGMLWeight(torch.zeros(2, 66, dtype=torch.uint8), int(qtype), 256)


def test_odd_shapes_refused(weights):
    w, _ = weights[Q.Q4_0]
    with pytest.raises(KernelInputError, match="multiple"):
        G.GGMLWeight(torch.zeros(4, 18, dtype=torch.uint8), int(Q.Q4_0), 48)
    with pytest.raises(KernelInputError, match="uint8"):
        G.GGMLWeight(torch.zeros(4, 17, dtype=torch.uint8), int(Q.Q4_0), 32)
    with pytest.raises(KernelInputError, match="uint8"):
        G.GGMLWeight(torch.zeros(4, 18, dtype=torch.int8), int(Q.Q4_0), 32)
    bad_x = [
        torch.randn(2, K).half(),  # dtype
        torch.randn(2, K + 32),  # K
        torch.randn(K, 2).T,  # not contiguous
        torch.randn(2, 2 * K)[:, ::2],  # strided
        torch.randn(K),  # 1-D
    ]
    for x in bad_x:
        with pytest.raises(KernelInputError) as info:
            G.ggml_linear(x, w)
        assert info.value.arg == "x"
    with pytest.raises(KernelInputError):
        G.ggml_linear_bf16(torch.randn(2, K), w)  # the bf16 variant takes bf16
    x = torch.randn(2, K)
    for out in (
        torch.empty(2, N + 1),  # shape
        torch.empty(3, N),
        torch.empty(2, N, dtype=torch.bfloat16),  # dtype
        torch.empty(N, 2).T,  # last stride not 1
        torch.empty(2, 2 * N)[:, ::2],
    ):
        with pytest.raises(KernelInputError) as info:
            G.ggml_linear(x, w, out)
        assert info.value.arg == "out"
    with pytest.raises(KernelInputError):
        G.ggml_embedding(torch.tensor([N]), w)  # out of range
    with pytest.raises(KernelInputError):
        G.ggml_embedding(torch.tensor([1], dtype=torch.int32), w)


def test_isa_flag_forces_the_path_in_a_fresh_process():
    """The portable build, forced where the CPU could run a faster one (one subprocess: each
    costs a torch import). Seeded: with Q8_K-quantized activations a random draw's worst
    output can pass 2% of the largest (2 of 40 seeds on any build), which made it flaky."""
    code = (
        "import torch; torch.manual_seed(0); from agentrt.kernels import ggml_linear as G;"
        "from tests.kernels.ggml_helpers import random_weight;"
        "w = random_weight(G.GGMLType.Q4_K, 8, 256); x = torch.randn(2, 256);"
        "y, r = G.ggml_linear(x, w), G.ggml_linear_ref(x, w);"
        "ok = (y - r).abs().max() < 0.02 * r.abs().max();"
        "print(G.default_kernels().isa, G.selected_isa(), bool(ok))"
    )
    env = {**os.environ, G.ISA_ENV: "scalar"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # the repository: tests.kernels imports
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == ["scalar", "scalar", "True"]


def test_isa_flag_refuses_what_the_cpu_cannot_run(monkeypatch):
    monkeypatch.setenv(G.ISA_ENV, "sse9")
    with pytest.raises(KernelInputError, match="sse9"):
        G.selected_isa()
