"""Input validation shared by the Triton wrappers and the torch references.

Every check raises `KernelInputError` naming the argument, what it got and what it needs.
Checks read only shapes, dtypes, strides and devices: they never synchronise with a GPU.
"""

from __future__ import annotations

import torch

from .errors import KernelInputError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def version(t: torch.Tensor) -> int:
    """The tensor's version counter (it moves on with each in-place write), -1 for an
    inference tensor, which has none: callers that cache a check by tensor identity compare
    it to see whether the tensor was written since."""
    return -1 if t.is_inference() else t._version


class CheckedOnce:
    """The tensors a check last passed, held (so no other tensor can take their ids), with a
    key of what else it depended on (their version counters, layouts, bounds). A kernel
    that every layer of a step calls with the same tensors checks them once per step."""

    __slots__ = ("_key", "_tensors")

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._key: object = None

    def passed(self, tensors: tuple[torch.Tensor, ...], key: object) -> bool:
        """These very tensors passed the check last, with this key."""
        return (
            bool(self._tensors)
            and self._key == key
            and len(tensors) == len(self._tensors)
            and all(a is b for a, b in zip(tensors, self._tensors, strict=True))
        )

    def remember(self, tensors: tuple[torch.Tensor, ...], key: object) -> None:
        self._tensors, self._key = tensors, key


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelInputError(
            f"{name} has dtype {t.dtype}; expected one of {names}. Convert it with .to(...).",
            arg=name,
        )


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise KernelInputError(
            f"{name} has shape {tuple(t.shape)}; expected {ndim} dims {layout}.", arg=name
        )


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, meaning: str) -> None:
    if t.shape[dim] != size:
        raise KernelInputError(
            f"{name}.shape[{dim}] is {t.shape[dim]}; expected {size} ({meaning}).", arg=name
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """The named tensors, None ones (absent optional arguments) skipped, share one device."""
    given = {name: t for name, t in tensors.items() if t is not None}
    if len({t.device for t in given.values()}) > 1:
        got = ", ".join(f"{name}={t.device}" for name, t in given.items())
        raise KernelInputError(f"tensors are on different devices ({got}); move them to one.")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelInputError(
            f"{name} has stride {t.stride(-1)} in its last dim; the kernel needs stride 1. "
            "Call .contiguous() first.",
            arg=name,
        )


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], head_dim stride 1."""
    check_ndim("kv_cache", kv_cache, 5, "[num_blocks, 2, block_size, num_kv_heads, head_dim]")
    check_dim("kv_cache", kv_cache, 1, 2, "index 0 holds K, index 1 holds V")
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
    check_last_dim_contiguous("kv_cache", kv_cache)


def check_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_kv_cache(kv_cache)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        check_ndim(name, t, 3, "[num_tokens, num_kv_heads, head_dim]")
        check_dim(name, t, 1, num_kv_heads, "num_kv_heads of kv_cache")
        check_dim(name, t, 2, head_dim, "head_dim of kv_cache")
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_dim_contiguous(name, t)
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    num_tokens = slot_mapping.shape[0]
    check_dim("key", key, 0, num_tokens, "num_tokens = len(slot_mapping)")
    check_dim("value", value, 0, num_tokens, "num_tokens = len(slot_mapping)")
    check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` must have `ref`'s shape and dtype, with a contiguous last dim."""
    if t.shape != ref.shape or t.dtype != ref.dtype:
        raise KernelInputError(
            f"{name} is {t.dtype} {tuple(t.shape)}; expected {ref.dtype} "
            f"{tuple(ref.shape)} like {ref_name}.",
            arg=name,
        )
    check_last_dim_contiguous(name, t)


def check_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_kv_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_dtype("query", query, FLOAT_DTYPES)
    check_last_dim_contiguous("query", query)
    check_dim("query", query, 2, head_dim, "head_dim of kv_cache")
    if query.dtype != kv_cache.dtype:
        raise KernelInputError(
            f"query is {query.dtype} but kv_cache is {kv_cache.dtype}; they must match.",
            arg="query",
        )
    if query.shape[1] % num_kv_heads != 0:
        raise KernelInputError(
            f"query has {query.shape[1]} heads, not a multiple of the cache's {num_kv_heads} "
            "KV heads (GQA needs num_heads % num_kv_heads == 0).",
            arg="query",
        )
    check_ndim("query_start_loc", query_start_loc, 1, "[num_reqs + 1]")
    check_ndim("seq_lens", seq_lens, 1, "[num_reqs]")
    check_ndim("block_tables", block_tables, 2, "[num_reqs, max_blocks_per_req]")
    num_reqs = seq_lens.shape[0]
    check_dim("query_start_loc", query_start_loc, 0, num_reqs + 1, "num_reqs + 1")
    check_dim("block_tables", block_tables, 0, num_reqs, "num_reqs")
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        check_dtype(name, t, INDEX_DTYPES)
    check_last_dim_contiguous("block_tables", block_tables)
    if out is not None:
        check_like("out", out, "query", query)
    check_same_device(
        query=query,
        kv_cache=kv_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        out=out,
    )


def check_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None
) -> None:
    check_ndim("logits", logits, 2, "[batch, vocab]")
    check_dtype("logits", logits, FLOAT_DTYPES)
    check_last_dim_contiguous("logits", logits)
    check_ndim("bitmask", bitmask, 2, "[batch, ceil(vocab / 32)]")
    check_dtype("bitmask", bitmask, (torch.int32,))
    check_last_dim_contiguous("bitmask", bitmask)
    if indices is None:
        check_dim("bitmask", bitmask, 0, logits.shape[0], "one mask row per logits row")
    else:
        check_ndim("indices", indices, 1, "[num_rows]")
        check_dtype("indices", indices, INDEX_DTYPES)
    check_same_device(logits=logits, bitmask=bitmask, indices=indices)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise KernelInputError("x must have at least one dim [..., hidden_size].", arg="x")
    check_last_dim_contiguous("x", x)
    check_ndim("weight", weight, 1, "[hidden_size]")
    check_dim("weight", weight, 0, x.shape[-1], "hidden_size = x.shape[-1]")
    check_dtype("weight", weight, FLOAT_DTYPES)
    if residual is not None:
        check_like("residual", residual, "x", x)
    check_same_device(x=x, weight=weight, residual=residual)


def check_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_dtype("positions", positions, INDEX_DTYPES)
    num_tokens = positions.shape[0]
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]")
    check_dtype("cos_sin_cache", cos_sin_cache, FLOAT_DTYPES)
    check_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 != 0 or rot_dim > head_size:
        raise KernelInputError(
            f"cos_sin_cache has rot_dim {rot_dim}; expected an even number <= head_size "
            f"{head_size} (cos in the first half, sin in the second).",
            arg="cos_sin_cache",
        )
    for name, t in (("query", query), ("key", key)):
        if t is None:
            continue
        check_dtype(name, t, FLOAT_DTYPES)
        check_last_dim_contiguous(name, t)
        if t.dim() not in (2, 3) or t.shape[0] != num_tokens or t.shape[-1] % head_size != 0:
            raise KernelInputError(
                f"{name} has shape {tuple(t.shape)}; expected [{num_tokens}, num_heads * "
                f"{head_size}] or [{num_tokens}, num_heads, {head_size}].",
                arg=name,
            )
        if t.dim() == 3 and t.shape[2] != head_size:
            raise KernelInputError(
                f"{name}.shape[2] is {t.shape[2]}; expected head_size {head_size}.", arg=name
            )
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
