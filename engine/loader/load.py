"""Fill a model built on the meta device from a loader, one parameter at a time.

`load_weights(model, loader, ...)` walks `weights.parameter_specs`: each parameter's parts are
read already sliced for this rank, put in their format (quantization.py), and installed:
dense parts concatenated into the parameter (the only copy in memory: a tensor already in
the wanted dtype is not copied again), quantized projections as a `GGMLLinear` in place of
the `nn.Linear`, a quantized embedding as a `GGMLEmbedding` (tied: its weight also serves
the output projection). Every parameter must be filled and every checkpoint tensor used.

Interleaving (the CPU kernels' layout) runs on the loader's own threads, each taking a share of
a weight's row groups on one OpenMP thread: an OpenMP team waits for its slowest member at
every weight, spinning, and on a shared machine a member the OS has descheduled made the
repack 5-6x slower (Qwen2.5-0.5B Q4_K_M, 373 MiB, 2 threads, load average 21: 13-14 s wall,
1.5 s CPU). benchmarks/startup.py's weights stage, AMD EPYC, load average ~20, medians of 3
cached starts, OpenMP team -> own threads: that file 1.53 -> 0.56 s CPU (12.8 -> 3.9 s wall),
the embedded model 1.71 -> 0.70 s CPU (11.9 -> 4.0 s wall).

The interleaving runs after the walk, in one C call a thread that holds no GIL, so a caller's
`alongside` work runs on the calling thread meanwhile: the engine builds the tokenizer there
(`tokenizers` holds the GIL through its 0.4-0.5 s build of a 152k vocabulary, so a thread
beside the per-weight calls of before got about one call's worth of overlap).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

import torch
from torch import nn

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.gguf_file import is_gguf
from agentrt.engine.loader.quantization import convert, weight_format
from agentrt.engine.loader.weights import ParamSpec, Shard, WeightLoader, parameter_specs
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.ggml_linear import GGMLEmbedding, GGMLLinear
from agentrt.kernels.ggml_linear import (
    ROWS_INTERLEAVED,
    GGMLKernels,
    GGMLWeight,
    default_kernels,
    interleaved_row_bytes,
)

# Row groups (of ROWS_INTERLEAVED rows) a repack thread takes at a time, at least: a weight
# is cut in up to 4 shares a thread, so a late thread's share is taken by the others.
_MIN_GROUPS = 64


def get_loader(path: str | os.PathLike[str]) -> WeightLoader:
    """The loader of a resolved checkpoint (checkpoint.resolve_model): a .gguf file or an HF
    safetensors directory."""
    if is_gguf(path):
        from agentrt.engine.loader.gguf_loader import GGUFLoader

        return GGUFLoader(path)
    from agentrt.engine.loader.safetensors_loader import SafetensorsLoader

    return SafetensorsLoader(path)


def load_weights(
    model: nn.Module,
    loader: WeightLoader,
    arch: ModelArchConfig,
    *,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    alongside: Callable[[], object] | None = None,
) -> None:
    """Load every parameter of `model` (a LlamaForCausalLM of this rank's share of the full
    model `arch`) from `loader`, in place. `quantization` is concrete (not "auto").
    `alongside` (if given) runs on this thread while the weights are interleaved on the
    repack threads, once every parameter is in place; its error, or theirs, is raised once
    both are done."""
    repack = _Repacker(loader, torch.get_num_threads())
    _load(
        model,
        loader,
        arch,
        repack,
        shard=shard,
        dtype=dtype,
        device=device,
        quantization=quantization,
    )
    repack.run(alongside)


def _load(
    model: nn.Module,
    loader: WeightLoader,
    arch: ModelArchConfig,
    repack: _Repacker,
    *,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
) -> None:
    available = loader.names()
    used: set[str] = set()
    for spec in parameter_specs(arch):
        if spec.optional and not all(p in available for p in spec.parts):
            continue
        if spec.name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding projects; a stored copy is ignored, as HF does
        missing = [p for p in spec.parts if p not in available]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor {missing[0]!r}.")
        used.update(spec.parts)
        parts = [loader.read(p, spec.split, shard) for p in spec.parts]
        vocabulary = spec.name in ("embed_tokens.weight", "lm_head.weight")
        if spec.is_projection or vocabulary:
            parts = [
                convert(p, weight_format(p, quantization, vocabulary=vocabulary), dtype, n)
                for p, n in zip(parts, spec.parts, strict=True)
            ]
        else:
            parts = [convert(p, None, dtype, n) for p, n in zip(parts, spec.parts, strict=True)]
        interleaved = spec.name != "embed_tokens.weight" and device.type == "cpu"
        if len(parts) > 1 and _one_block_type(parts):
            # One kernel call instead of one per part: the rows of a fused qkv / gate_up
            # stacked into one weight (a copy; the map's pages of the parts are released).
            parts = [_fused(parts, loader, repack if interleaved else None)]
        elif interleaved:
            parts = _kernel_layout(parts, loader, repack)
        _install(model, spec, parts, dtype, device)
    embedding = model.embed_tokens
    if model.lm_head is None and model.logits_proj is None:
        if isinstance(embedding, GGMLEmbedding):  # tied: the same blocks project
            if device.type == "cpu":  # lookups gather their rows from the interleaved blocks
                embedding.weight = _kernel_layout([embedding.weight], loader, repack)[0]
            model.logits_proj = GGMLLinear([embedding.weight])
    elif isinstance(embedding, GGMLEmbedding):  # lookups only: rows read from the file
        embedding.read_rows = loader.row_reader(embedding.weight)
    unused = sorted(n for n in available - used if "rotary_emb" not in n)
    if model.lm_head is None and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")  # a tied checkpoint's stored copy (skipped above)
    if unused:
        raise ModelLoadError(f"checkpoint has tensors the model does not use: {unused[:5]}")
    factors, scaling = loader.rope_factors(), loader.rope_scaling()
    if factors is not None or scaling is not None:  # the rope the weights come with
        model.rope_factors, model.rope_scaling = factors, scaling
        model.build_rotary(model.rotary.cos_sin_cache.shape[0])
    left = [n for n, p in model.named_parameters() if p.is_meta]
    assert not left, f"parameters not loaded: {left[:5]}"


def _fused(parts: list[GGMLWeight], loader: WeightLoader, repack: _Repacker | None) -> GGMLWeight:
    """Parts of one block type stacked by rows into one weight: interleaved into one buffer
    part by part when the kernels take the type so (`repack` given), else concatenated; the
    map's pages of the parts released (by `repack` once interleaved)."""
    first = parts[0]
    if repack is not None and repack.kernels.interleaves(first.qtype):
        if all(p.out_features % ROWS_INTERLEAVED == 0 for p in parts):
            width = interleaved_row_bytes(first.qtype, first.in_features)
            rows = sum(p.out_features for p in parts)
            out = torch.empty(rows // ROWS_INTERLEAVED, width, dtype=torch.uint8)
            start = 0
            for p in parts:
                stop = start + p.out_features // ROWS_INTERLEAVED
                repack.interleave(p, out[start:stop])
                start = stop
            return GGMLWeight(out, first.qtype, first.in_features, interleaved=True)
    fused = GGMLWeight(torch.cat([p.data for p in parts]), first.qtype, first.in_features)
    loader.release(parts)
    return _kernel_layout([fused], loader, repack)[0] if repack is not None else fused


def _kernel_layout(parts: list, loader: WeightLoader, repack: _Repacker) -> list:
    """Each block part the CPU kernels run faster with its rows interleaved by 16
    (kernels/ggml_linear.py `interleave`; `GGMLKernels.interleaves` says which: Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q4_K and Q6_K on AVX-512, the same less the K-quants on AVX2), interleaved: a copy,
    the map's pages of the part released once copied (`_Repacker`), so one layout is held (a
    tied embedding's lookups gather their rows from it)."""
    out = []
    for part in parts:
        if (
            isinstance(part, GGMLWeight)
            and not part.interleaved
            and part.out_features % ROWS_INTERLEAVED == 0
            and repack.kernels.interleaves(part.qtype)
        ):
            part = repack.interleave(part)
        out.append(part)
    return out


class _Repacker:
    """Interleaves weights into the kernels' layout (kernels/ggml_linear.py `interleave`),
    deferred: `interleave` returns the interleaved weight at once, its buffer not yet filled,
    and `run` fills every buffer on `num_threads` threads of its own, each one C call
    (`GGMLKernels.interleave_jobs`, no GIL held) that takes the next share of row groups until
    none is left (module doc: no OpenMP team), and drops each share's pages of the map once
    copied. Nothing may read an interleaved weight before `run` returns. The C library is
    loaded at the first use (a load that interleaves nothing, as on a GPU, never loads it)."""

    def __init__(self, loader: WeightLoader, num_threads: int) -> None:
        self.loader = loader
        self.num_threads = max(1, num_threads)
        self._jobs: list[tuple[int, ...]] = []  # ggml_interleave_jobs' records
        self._buffers: list[torch.Tensor] = []  # the jobs' sources and outputs, held to `run`

    @functools.cached_property
    def kernels(self) -> GGMLKernels:
        return default_kernels()

    def interleave(self, part: GGMLWeight, out: torch.Tensor | None = None) -> GGMLWeight:
        """`part` (N rows, N a multiple of 16, a type the kernels interleave) as an
        interleaved weight in `out` (uint8 (N / 16, interleaved_row_bytes), contiguous;
        default a new one), which `run` fills with the bytes `ggml_linear.interleave(part)`
        has."""
        if out is None:
            width = interleaved_row_bytes(part.qtype, part.in_features)
            out = torch.empty(part.out_features // ROWS_INTERLEAVED, width, dtype=torch.uint8)
        groups = out.shape[0]
        step = max(_MIN_GROUPS, -(-groups // (4 * self.num_threads)))
        for start in range(0, groups, step):
            stop = min(start + step, groups)  # row groups: rows 16 * start .. 16 * stop
            rows = part.data[start * ROWS_INTERLEAVED : stop * ROWS_INTERLEAVED]
            share = GGMLWeight(rows, part.qtype, part.in_features)
            pages = self.loader.mapped_pages(share) or (0, 0)
            dst, src = out[start:stop], share.data
            self._jobs.append(
                (src.data_ptr(), src.stride(0), int(part.qtype), share.out_features)
                + (part.in_features, dst.data_ptr(), *pages)
            )
        self._buffers += [part.data, out]
        return GGMLWeight(out, part.qtype, part.in_features, interleaved=True)

    def run(self, alongside: Callable[[], object] | None = None) -> None:
        """Fill every buffer `interleave` returned while this thread runs `alongside`; raises
        the first error of either once both are done."""
        errors: list[BaseException] = []
        jobs = torch.tensor(self._jobs, dtype=torch.int64).reshape(-1, 8)
        next_job = torch.zeros(1, dtype=torch.int64)
        kernels = self.kernels if self._jobs else None  # loaded here, not by each thread

        def work() -> None:
            try:
                kernels.interleave_jobs(jobs, next_job)
            except BaseException as exc:  # re-raised on the calling thread
                errors.append(exc)

        count = min(self.num_threads, jobs.shape[0])
        threads = [threading.Thread(target=work, name="agentrt-repack") for _ in range(count)]
        for thread in threads:
            thread.start()
        try:
            if alongside is not None:
                alongside()
        finally:
            for thread in threads:
                thread.join()
            self._jobs, self._buffers = [], []
        if errors:
            raise errors[0]


def _one_block_type(parts: list) -> bool:
    return all(isinstance(p, GGMLWeight) for p in parts) and len({p.qtype for p in parts}) == 1


def _install(
    model: nn.Module, spec: ParamSpec, parts: list, dtype: torch.dtype, device: torch.device
) -> None:
    module_name, _, attr = spec.name.rpartition(".")
    owner_name, _, child = module_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    quantized = any(isinstance(p, GGMLWeight) for p in parts)
    if quantized and module_name == "embed_tokens":
        model.embed_tokens = GGMLEmbedding(parts[0], dtype)
    elif quantized and module_name == "lm_head":
        model.logits_proj = GGMLLinear(parts)
        model.lm_head = None
    elif quantized:
        setattr(owner, child, GGMLLinear(parts))
    else:
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        tensor = tensor.to(device=device, dtype=dtype)
        module = getattr(owner, child)
        if isinstance(module, GGMLLinear):  # a quantized projection's bias
            module.bias = nn.Parameter(tensor.float(), requires_grad=False)
        else:
            setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
