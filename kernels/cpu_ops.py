"""The glue between a quantized layer's matrix products on the CPU, fused: a C library
(cpu_ops.c) built on first use (cpu_build.py). Get one with `load_cpu_ops(build_dir)`.

torch's int4 and int8 kernels take and give bf16 rows; between them a decoder layer runs ~40
small torch calls (norms, RoPE, the KV write, SiLU, dtype casts) that cost more than the
products themselves for one decoded token. These functions do that work in three calls,
in fp32, and hand the next product its bf16 input (a family's variants as arguments: a
branch's output norm and no input norm in add_rms_norm, q/k norms over all heads in rope_qkv,
GeGLU's gelu_tanh_mul for silu_mul). Each checks what it takes (cheap
comparisons: they run 90 times a token), since a wrong shape would read out of bounds.
References: `add_rms_norm_ref`, `rope_qkv_ref`, `silu_mul_ref`, `gelu_tanh_mul_ref` (torch
ops, the model's own arithmetic), which the tests hold the kernels to.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from .checks import CheckedOnce, version
from .cpu_build import build_library
from .errors import KernelInputError

SOURCE = Path(__file__).with_name("cpu_ops.c")
_F32, _BF16, _I64 = torch.float32, torch.bfloat16, torch.int64


def _bad(name: str, t: torch.Tensor, expected: str) -> KernelInputError:
    return KernelInputError(
        f"{name}: got {t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()}, "
        f"on {t.device}); expected {expected}, contiguous, on the CPU.",
        arg=name,
    )


def _ok(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.dtype == dtype and t.shape == shape and t.is_contiguous() and not t.is_cuda


class CpuOps:
    """The loaded library; the methods' tensors are CPU tensors, contiguous."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        ptr, i64, f32, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, f32, cint]
        lib.rope_qkv.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        lib.rope_qkv.argtypes += [ptr, ptr, ptr, cint, f32, cint]
        lib.silu_mul.argtypes = [ptr, ptr, i64, i64, cint]
        lib.gelu_tanh_mul.argtypes = [ptr, ptr, i64, i64, cint]
        for fn in (lib.add_rms_norm, lib.rope_qkv, lib.silu_mul, lib.gelu_tanh_mul):
            fn.restype = None
        # A whole decoder in one call: cpu_decoder.py's CpuDecoder builds its arguments.
        lib.decoder_forward.argtypes = [ptr, ptr, i64]
        lib.decoder_forward.restype = cint
        self.decoder_forward = lib.decoder_forward
        self._lib = lib
        # The positions and key rows last checked, with their bounds and version counters:
        # every layer of a step passes the same ones.
        self._checked = CheckedOnce()

    def add_rms_norm(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        x_scale: float = 1.0,
        x_norm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual (T, D) fp32 += x ((T, D) bf16, or None) * x_scale (Granite's residual
        multiplier), in place, or with `x_norm` (D,) fp32 the RMSNorm of x * x_scale times
        x_norm (a branch's output norm: Gemma's, OLMo 2's); returns RMSNorm of the sum times
        `weight` (D,) fp32 (None: the sum itself, OLMo 2's), as bf16 (T, D)."""
        rows, dim = residual.shape
        if not _ok(residual, _F32, (rows, dim)):
            raise _bad("residual", residual, "float32 (T, D)")
        for name, norm in (("weight", weight), ("x_norm", x_norm)):
            if norm is not None and not _ok(norm, _F32, (dim,)):
                raise _bad(name, norm, f"float32 ({dim},)")
        if x is not None and not _ok(x, _BF16, (rows, dim)):
            raise _bad("x", x, f"bfloat16 ({rows}, {dim})")
        out = torch.empty((rows, dim), dtype=_BF16)
        self._lib.add_rms_norm(
            None if x is None else x.data_ptr(),
            None if x_norm is None else x_norm.data_ptr(),
            residual.data_ptr(),
            None if weight is None else weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            x_scale,
            torch.get_num_threads(),
        )
        return out

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        key_rows: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        num_heads: int,
        bias: torch.Tensor | None = None,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 0.0,
        rotate: bool = True,
        norm_all_heads: bool = False,
    ) -> torch.Tensor:
        """qkv (T, (H + 2 KVH) D) bf16 -> the rotated query (T, H, D) fp32; the rotated key and
        the value of token t are written into `kv_cache` (NB, 2, BS, KVH, D) fp32 at its row
        key_rows[t] (the cache viewed as (NB * 2 * BS, KVH, D) rows) and that row plus BS.
        positions (T,) int64 index the rows of cos_sin (P, R) fp32 (each angle's cos, then
        its sin): the first R dims of each head turn, R = D or fewer (partial rotary,
        Phi-4-mini's; the other D - R pass through). `bias` ((H + 2 KVH) D,) fp32 is added
        to q, k and v first (Qwen2's);
        `q_norm` / `k_norm` (D,) fp32, both or neither, RMSNorm each query / key head with
        `eps` before it turns (Qwen3's); with `norm_all_heads` they are (H D,) / (KVH D,) and
        normalise a token's whole query / key at once (OLMo 2's). `rotate` False: q and k do
        not turn (a NoPE layer, SmolLM3's)."""
        _, _, block_size, kv_heads, dim = kv_cache.shape
        tokens, width = qkv.shape[0], (num_heads + 2 * kv_heads) * dim
        if not _ok(qkv, _BF16, (tokens, width)):
            raise _bad("qkv", qkv, f"bfloat16 (T, {width})")
        sizes = (num_heads * dim, kv_heads * dim) if norm_all_heads else (dim, dim)
        check_qkv_extras(width, sizes, bias, q_norm, k_norm)
        self.check_rope(kv_cache, key_rows, positions, cos_sin, tokens)
        query = torch.empty((tokens, num_heads, dim), dtype=_F32)
        self._lib.rope_qkv(
            qkv.data_ptr(),
            query.data_ptr(),
            kv_cache.data_ptr(),
            key_rows.data_ptr(),
            positions.data_ptr(),
            cos_sin.data_ptr() if rotate else None,
            tokens,
            num_heads,
            kv_heads,
            dim,
            cos_sin.shape[1],
            block_size,
            *(None if t is None else t.data_ptr() for t in (bias, q_norm, k_norm)),
            int(norm_all_heads),
            eps,
            torch.get_num_threads(),
        )
        return query

    def check_rope(
        self,
        kv_cache: torch.Tensor,
        key_rows: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        tokens: int,
    ) -> None:
        """Raise KernelInputError unless rope_qkv can read `positions` of `cos_sin` and write
        `key_rows` of `kv_cache` (the ranges once for a step's tensors: see `_checked`)."""
        num_blocks, _, block_size, _, dim = kv_cache.shape
        if not _ok(kv_cache, _F32, kv_cache.shape):
            raise _bad("kv_cache", kv_cache, "float32 (NB, 2, BS, KVH, D)")
        rot_dim = cos_sin.shape[-1]
        if not (_ok(cos_sin, _F32, (cos_sin.shape[0], rot_dim)) and 0 < rot_dim <= dim):
            raise _bad("cos_sin", cos_sin, f"float32 (P, R), R <= {dim}")
        if rot_dim % 2:
            raise KernelInputError(f"cos_sin: {rot_dim} columns; expected an even number.")
        for name, t in (("key_rows", key_rows), ("positions", positions)):
            if not _ok(t, _I64, (tokens,)):
                raise _bad(name, t, f"int64 ({tokens},)")
        # Out-of-range rows or positions would write or read outside the tensors.
        limits = (cos_sin.shape[0], num_blocks * 2 * block_size - block_size)
        key = (limits, version(positions), version(key_rows))
        if not self._checked.passed((positions, key_rows), key):
            if tokens and (
                int(positions.min()) < 0
                or int(positions.max()) >= limits[0]
                or int(key_rows.min()) < 0
                or int(key_rows.max()) >= limits[1]
            ):
                raise KernelInputError(
                    "positions or key_rows out of range of cos_sin / kv_cache.", arg="key_rows"
                )
            self._checked.remember((positions, key_rows), key)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2 I) bf16 (gate, then up) -> silu(gate) * up (T, I) bf16."""
        return self._gated(self._lib.silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up (T, 2 I) bf16 (gate, then up) -> gelu_tanh(gate) * up (T, I) bf16
        (Gemma's GeGLU, the tanh-approximated GELU)."""
        return self._gated(self._lib.gelu_tanh_mul, gate_up)

    def _gated(self, fn, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        if width % 2 or not _ok(gate_up, _BF16, (rows, width)):
            raise _bad("gate_up", gate_up, "bfloat16 (T, 2 I)")
        out = torch.empty((rows, width // 2), dtype=_BF16)
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out


def check_qkv_extras(
    width: int,
    sizes: tuple[int, int],
    bias: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
) -> None:
    """Raise KernelInputError unless rope_qkv can read `bias` ((width,) fp32, or None) and
    `q_norm` / `k_norm` ((sizes[0],) / (sizes[1],) fp32, both or neither)."""
    if bias is not None and not _ok(bias, _F32, (width,)):
        raise _bad("bias", bias, f"float32 ({width},)")
    if (q_norm is None) != (k_norm is None):
        raise KernelInputError("q_norm and k_norm: both or neither.", arg="q_norm")
    for name, norm, size in (("q_norm", q_norm, sizes[0]), ("k_norm", k_norm, sizes[1])):
        if norm is not None and not _ok(norm, _F32, (size,)):
            raise _bad(name, norm, f"float32 ({size},)")


@functools.cache
def load_cpu_ops(build_dir: Path) -> CpuOps:
    """Build (once per source, flags and CPU) and load the library. Raises KernelBuildError
    with the compiler's message when it cannot be built."""
    return CpuOps(build_library(SOURCE, Path(build_dir)))


def add_rms_norm_ref(x, residual, weight, eps, x_scale=1.0, x_norm=None):
    """What CpuOps.add_rms_norm computes, in torch ops (residual updated in place)."""

    def norm(h, w):
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    if x is not None:
        residual += x.float() * x_scale if x_norm is None else norm(x.float() * x_scale, x_norm)
    return (residual if weight is None else norm(residual, weight)).to(_BF16)


def rope_qkv_ref(
    qkv,
    kv_cache,
    key_rows,
    positions,
    cos_sin,
    num_heads,
    bias=None,
    q_norm=None,
    k_norm=None,
    eps=0.0,
    norm_all_heads=False,
):
    """What CpuOps.rope_qkv computes, in torch ops (the cache written in place); the q/k norms
    as HF's RMSNorm in fp32, per head or over all heads."""
    kv_heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    x = qkv.float()
    if bias is not None:
        x = x + bias
    x = x.view(qkv.shape[0], -1, dim)  # (T, H + 2 KVH, D)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # (T, R / 2) each
    cos, sin = cos.repeat(1, 2)[:, None], sin.repeat(1, 2)[:, None]
    rot_dim = cos_sin.shape[1]
    half = rot_dim // 2
    qk = x[:, : num_heads + kv_heads]
    if q_norm is not None:
        q, k = qk.split((num_heads, kv_heads), dim=1)

        def norm(h, weight):
            if norm_all_heads:
                flat = h.flatten(1)
                flat = weight * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps))
                return flat.view(h.shape)
            return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

        qk = torch.cat((norm(q, q_norm), norm(k, k_norm)), dim=1)
    turn, rest = qk[..., :rot_dim], qk[..., rot_dim:]  # partial rotary: R < D
    turned = turn * cos + torch.cat((-turn[..., half:], turn[..., :half]), dim=-1) * sin
    qk = torch.cat((turned, rest), dim=-1)
    rows = kv_cache.view(-1, kv_heads, dim)
    rows[key_rows] = qk[:, num_heads:]
    rows[key_rows + kv_cache.shape[2]] = x[:, num_heads + kv_heads :]
    return qk[:, :num_heads].contiguous()


def silu_mul_ref(gate_up):
    """What CpuOps.silu_mul computes, in torch ops."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(_BF16)


def gelu_tanh_mul_ref(gate_up):
    """What CpuOps.gelu_tanh_mul computes, in torch ops."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(_BF16)
