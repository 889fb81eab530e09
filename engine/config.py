"""Engine configuration: small frozen dataclasses, validated on creation.

Each error names the field, the value and what was expected. The records have no defaults:
`EngineArgs` (args.py) holds every default once and builds them. Values that depend on the
model (context length, vocabulary) are resolved when the engine loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrt.engine.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}.")


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """`"auto"` picks fp32 on the CPU (exact, deterministic) and bf16 on CUDA: by the device
    the model runs on, not by whether this machine has a GPU."""
    if isinstance(dtype, torch.dtype):
        _check(dtype in DTYPES.values(), "dtype", dtype, "float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    _check(dtype in DTYPES, "dtype", dtype, f"'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to run and how. `model=None` is the embedded SmolLM2-135M-Instruct."""

    model: str | None
    dtype: torch.dtype
    device: str
    max_model_len: int | None  # None: the model's max_position_embeddings
    seed: int
    attention_backend: str

    def __post_init__(self) -> None:
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            self.attention_backend,
            f"one of {ATTENTION_BACKENDS}",
        )
        _check(
            self.device in ("cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            self.device,
            "'cpu' or 'cuda[:N]'",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            self.max_model_len,
            "a positive integer or None",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache. `num_blocks=None` sizes the pool from `kv_cache_memory_gb`."""

    block_size: int
    kv_cache_memory_gb: float
    num_blocks: int | None
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        _check(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "one of 8, 16, 32, 64, 128",
        )
        _check(
            self.kv_cache_memory_gb > 0,
            "kv_cache_memory_gb",
            self.kv_cache_memory_gb,
            "a positive number of GiB",
        )
        _check(
            self.num_blocks is None or self.num_blocks >= 1,
            "num_blocks",
            self.num_blocks,
            "a positive integer or None",
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    `max_num_batched_tokens` is the per-step token budget shared by prefill chunks and
    decodes; `max_num_seqs` caps the running requests. A prompt longer than the budget is
    prefilled in chunks.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    # Cap on one request's prefill tokens per step (0 = only the step budget caps it).
    long_prefill_token_threshold: int
    # Jump-forward decoding: tokens a grammar forces after a sampled token (a JSON object's
    # next key, say) are appended at once and computed with the request's next chunk.
    jump_forward: bool
    # Requests that may wait beyond the `max_num_seqs` that run; past it the front end
    # refuses new ones (EngineOverloadedError).
    max_waiting_requests: int

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "at least 1")
        _check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            "at least 1",
        )
        _check(self.policy in SCHEDULING_POLICIES, "policy", self.policy, "'fcfs' or 'priority'")
        _check(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            ">= 0 (0 disables the cap)",
        )
        _check(
            self.max_waiting_requests >= 0,
            "max_waiting_requests",
            self.max_waiting_requests,
            ">= 0",
        )


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Grammar compilation: each grammar compiles off the engine thread within a time budget."""

    grammar_timeout_s: float

    def __post_init__(self) -> None:
        _check(
            self.grammar_timeout_s > 0,
            "grammar_timeout_s",
            self.grammar_timeout_s,
            "a positive number of seconds",
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every config record of one engine (built by `EngineArgs.create_configs`)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    structured_outputs: StructuredOutputsConfig
