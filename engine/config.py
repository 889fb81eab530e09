"""Engine configuration: small frozen dataclasses, validated on creation.

Each error names the field, the value and what was expected. The records have no defaults:
`EngineArgs` (args.py) holds every default once and builds them. Values that depend on the
model (its path, architecture, weight format, context length, the KV pool's size) are
resolved once, by `EngineArgs.create_engine_config`, into the `EngineConfig` every component
takes its part of.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from agentrt.engine.errors import ConfigError
from agentrt.engine.model.arch import ModelArchConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# Weight formats (activations stay in `dtype`; engine/loader/quantization.py): "gguf" runs a
# GGUF's own block formats through the GGML kernels, "int8" / "int4" quantize a checkpoint
# to Q8_0 / Q4_1 blocks at load, "none" holds every weight dense in `dtype` (a GGUF
# dequantized in memory at load). "auto": gguf for a GGUF on the CPU with dtype "auto", else
# none; resolved with the model (EngineArgs.create_engine_config). The GGML kernels are
# CPU ones.
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
SCHEDULING_POLICIES = ("fcfs", "priority")
# KV transfer (engine/kv_transfer/): "storage" saves full blocks to a directory and loads
# them back; "p2p" moves a finished prefill's blocks to another running instance.
KV_CONNECTORS = ("storage", "p2p")
KV_ROLES = ("producer", "consumer", "both")


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}.")


def check_option_names(names, known: set[str], what: str, where: str) -> None:
    """A `ConfigError` naming the closest known option for the first unknown name (instead
    of Python's bare "unexpected keyword argument")."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{name!r} is not {what}.{hint} {where}")


def resolve_dtype(dtype: str | torch.dtype, device: str, stored: str | None = None) -> torch.dtype:
    """`"auto"` picks bf16 on CUDA; on the CPU, a checkpoint stored in bf16 (`stored`, its
    config's torch_dtype) stays bf16 and anything else runs in fp32 (a GGUF's activations;
    fp16, whose CPU matmuls torch runs 4x slower than fp32's: docs/engine.md). By the
    device the model runs on, not by whether this machine has a GPU."""
    if isinstance(dtype, torch.dtype):
        _check(dtype in DTYPES.values(), "dtype", dtype, "float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        if device.startswith("cuda") or stored == "bfloat16":
            return torch.bfloat16
        return torch.float32
    _check(dtype in DTYPES, "dtype", dtype, f"'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a resolved dtype ("float32", "bfloat16", "float16"): its form
    in JSON (the config tensor-parallel ranks receive), a key of DTYPES."""
    return str(dtype).removeprefix("torch.")


def check_model_options(
    *, device: str, quantization: str, attention_backend: str, max_model_len: int | None
) -> None:
    """The model options' values, before anything is read (`EngineArgs` checks them on
    creation; `ModelConfig` then holds what they resolve to)."""
    _check(quantization in QUANTIZATIONS, "quantization", quantization, f"one of {QUANTIZATIONS}")
    _check(
        quantization in ("auto", "none") or device == "cpu",
        "quantization",
        quantization,
        "'auto' or 'none' on CUDA (the GGML kernels are CPU ones; a GGUF runs dequantized "
        "to the dtype there)",
    )
    _check(
        attention_backend in ATTENTION_BACKENDS,
        "attention_backend",
        attention_backend,
        f"one of {ATTENTION_BACKENDS}",
    )
    _check(
        device in ("cpu", "cuda") or device.startswith("cuda:"),
        "device",
        device,
        "'cpu' or 'cuda[:N]'",
    )
    _check(
        max_model_len is None or max_model_len >= 1,
        "max_model_len",
        max_model_len,
        "a positive integer or None",
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights run and how, resolved once (`EngineArgs.create_engine_config`): the
    checkpoint's path, its config and architecture, the dtype, the weight format and the
    context length as they will be used. Nothing below reads the user's strings again."""

    model: str | None  # as the user gave it (None: the embedded SmolLM2-135M-Instruct)
    path: Path  # the local checkpoint it resolved to (checkpoint.resolve_model)
    hf_config: dict  # its config.json (a GGUF's: from its metadata)
    arch: ModelArchConfig  # read from hf_config
    dtype: torch.dtype
    device: str
    max_model_len: int  # the option, capped at the model's max_position_embeddings
    seed: int
    attention_backend: str
    quantization: str  # "none", "gguf", "int8" or "int4" ("auto" resolved)

    def to_json_dict(self) -> dict:
        """Plain JSON values (the path as a string, the dtype by its canonical name); the
        architecture is not sent: `from_json_dict` reads it from `hf_config` again."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arch"}
        return {**data, "path": str(self.path), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_json_dict(cls, data: dict) -> ModelConfig:
        return cls(
            **{
                **data,
                "path": Path(data["path"]),
                "dtype": DTYPES[data["dtype"]],
                "arch": ModelArchConfig.from_hf_dict(data["hf_config"]),
            }
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache. `num_blocks=None` (an option) sizes the pool from
    `kv_cache_memory_gb`; in an `EngineConfig` it is the pool's size."""

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
    # Cap on one request's prefill tokens per step while other requests run (0 = only the
    # step budget caps it); a request alone always gets the whole budget.
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


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "grammar")
# Drafts per step when `num_speculative_tokens` is not given. Lookup drafts cost nothing to
# propose and copied spans run long (a value, a key and the next value's start), so they
# get 8; a draft model pays a forward pass per draft token. Grammar drafts are usually long
# (a whole forced key), so they get a longer window.
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 8, "suffix": 8, "draft_model": 4, "grammar": 16}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer drafts up to
    `num_speculative_tokens` tokens per request and step, the model verifies them all in one
    forward pass, and a rejection sampler keeps the output distribution exactly the model's.

    Unlike the engine records above, this one has defaults: users give it as a dict naming
    only what they change (`{"method": "ngram", "num_speculative_tokens": 4}`), as in vLLM.
    """

    method: str
    num_speculative_tokens: int | None = None  # None: DEFAULT_NUM_SPECULATIVE_TOKENS[method]
    # n-gram prompt lookup (and the suffix cache's shortest match): the last n tokens, for n
    # from max down to min, are looked up in the request's own tokens.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: a smaller model with the same tokenizer (a local checkpoint or .gguf).
    model: str | None = None
    # suffix: finished outputs remembered per schema / prompt head, oldest forgotten first.
    suffix_cache_max_requests: int = 1024
    # Adaptive drafting: in a batch (where every row costs compute) each request drafts at
    # most 4 tokens, fewer while its acceptance is low; any request pauses while its
    # acceptance stays below `adaptive_min_acceptance`, retrying now and then; nobody drafts
    # while more than `disable_by_batch_size` requests run (0: no limit).
    adaptive: bool = True
    adaptive_min_acceptance: float = 0.1
    disable_by_batch_size: int = 16

    def __post_init__(self) -> None:
        _check(
            self.method in SPECULATIVE_METHODS,
            "speculative_config.method",
            self.method,
            f"one of {SPECULATIVE_METHODS}",
        )
        if self.num_speculative_tokens is None:
            object.__setattr__(
                self, "num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS[self.method]
            )
        _check(
            1 <= self.num_speculative_tokens <= 64,
            "speculative_config.num_speculative_tokens",
            self.num_speculative_tokens,
            "an integer in [1, 64]",
        )
        _check(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "speculative_config.prompt_lookup_min",
            (self.prompt_lookup_min, self.prompt_lookup_max),
            "1 <= prompt_lookup_min <= prompt_lookup_max",
        )
        _check(
            (self.model is not None) == (self.method == "draft_model"),
            "speculative_config.model",
            self.model,
            "a draft model path with method 'draft_model' (and only then)",
        )
        _check(
            self.suffix_cache_max_requests >= 1,
            "speculative_config.suffix_cache_max_requests",
            self.suffix_cache_max_requests,
            "at least 1",
        )
        _check(
            0.0 <= self.adaptive_min_acceptance < 1.0,
            "speculative_config.adaptive_min_acceptance",
            self.adaptive_min_acceptance,
            "a fraction in [0, 1)",
        )
        _check(
            self.disable_by_batch_size >= 0,
            "speculative_config.disable_by_batch_size",
            self.disable_by_batch_size,
            ">= 0 (0: no limit)",
        )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The config from what a user gives: the record, a dict or a JSON object (the
        command line's `--speculative-config '{"method": "ngram"}'`), or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}.") from None
        _check(isinstance(value, dict), "speculative_config", value, "a dict, JSON or None")
        check_option_names(
            value,
            {f.name for f in fields(cls)},
            "a speculative_config option",
            "The options are the fields of agentrt.engine.SpeculativeConfig.",
        )
        if "method" not in value:
            raise ConfigError(f"speculative_config needs a 'method', one of {SPECULATIVE_METHODS}.")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Where the engine core runs and how it is split.

    `engine_process`: the core (scheduler, model, sampler) in its own process behind a
    client, instead of a thread of the caller's process. `tensor_parallel_size`: the model's
    layers split across that many ranks (torch.distributed: gloo on the CPU, NCCL on CUDA);
    the scheduler runs once, on rank 0. `data_parallel_size`: that many engine-core
    processes behind one front end (so more than 1 always runs core processes). Whether the
    model's heads divide by `tensor_parallel_size` is checked when the model loads.
    """

    tensor_parallel_size: int
    data_parallel_size: int
    engine_process: bool

    def __post_init__(self) -> None:
        _check(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "a positive integer",
        )
        _check(
            self.data_parallel_size >= 1,
            "data_parallel_size",
            self.data_parallel_size,
            "a positive integer",
        )

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (its tensor-parallel group)."""
        return self.tensor_parallel_size

    @property
    def uses_engine_process(self) -> bool:
        return self.engine_process or self.data_parallel_size > 1


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """A KV connector (vLLM's `kv_transfer_config`). `role`: a "producer" saves (storage) or
    serves its finished prefills (p2p), a "consumer" loads, "both" does both.

    `storage_path`: the storage connector's directory. `host`/`port`: where a p2p producer
    serves its blocks (port 0: a free one) and the address its peers are told. `timeout_s`:
    a transfer that has not arrived by then fails, and the request computes its prefill
    itself. `hold_timeout_s`: how long a p2p producer keeps a finished prefill's blocks for
    a consumer that does not come. `max_held_fraction`: the share of the pool a p2p
    producer may hold for consumers at once (past it a do_remote_decode request is refused
    at admission, and a prefill that still does not fit is not held). `secret`: what
    instances that exchange KV share (kv_transfer/auth.py; required for p2p; never shown
    in a repr). `allowed_producers`: the "host:port"s a p2p consumer fetches from (empty:
    any producer that signed its params with the secret). `storage_max_gb`: the storage
    connector's size cap (least recently used files go first; None: no cap)."""

    connector: str
    role: str
    storage_path: str
    host: str
    port: int
    timeout_s: float
    hold_timeout_s: float
    max_held_fraction: float
    secret: str | None = field(repr=False)
    allowed_producers: tuple[str, ...]
    storage_max_gb: float | None

    def __post_init__(self) -> None:
        _check(
            self.connector in KV_CONNECTORS,
            "kv_connector",
            self.connector,
            f"one of {KV_CONNECTORS}",
        )
        _check(self.role in KV_ROLES, "kv_role", self.role, f"one of {KV_ROLES}")
        _check(0 <= self.port < 65536, "kv_port", self.port, "a TCP port (0: a free one)")
        _check(
            self.timeout_s > 0,
            "kv_transfer_timeout_s",
            self.timeout_s,
            "a positive number of seconds",
        )
        _check(
            self.hold_timeout_s > 0,
            "kv_hold_timeout_s",
            self.hold_timeout_s,
            "a positive number of seconds",
        )
        _check(
            0 < self.max_held_fraction <= 1,
            "kv_max_held_fraction",
            self.max_held_fraction,
            "a share of the KV pool in (0, 1]",
        )
        if self.connector == "p2p" and not self.secret:
            raise ConfigError(
                "kv_connector='p2p' needs a shared secret: set kv_secret (--kv-secret) or the "
                "AGENTRT_KV_SECRET environment variable to the same value on every instance "
                "that exchanges KV (e.g. `python -c 'import secrets; print(secrets.token_hex())'`)."
            )
        for address in self.allowed_producers:
            host, _, port = address.rpartition(":")
            _check(
                bool(host) and port.isdigit() and 0 < int(port) < 65536,
                "kv_allowed_producers",
                address,
                "host:port entries",
            )
        _check(
            self.storage_max_gb is None or self.storage_max_gb > 0,
            "kv_storage_max_gb",
            self.storage_max_gb,
            "a positive number of GiB, or None",
        )

    @property
    def loads(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def saves(self) -> bool:
        return self.role in ("producer", "both")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine's configuration, resolved once (`EngineArgs.create_engine_config`) and
    frozen: the model as it will run, the KV pool sized, and the parts each component takes
    (the scheduler its `scheduler`, a tensor-parallel rank its `model` and `cache`, ...)."""

    model: ModelConfig
    cache: CacheConfig  # num_blocks sized (never None here)
    scheduler: SchedulerConfig
    structured_outputs: StructuredOutputsConfig
    speculative: SpeculativeConfig | None  # None: no speculative decoding
    # speculative method "draft_model": the draft checkpoint, resolved as `model` is (its
    # dtype, device and context length are the target's).
    draft_model: ModelConfig | None
    parallel: ParallelConfig
    kv_transfer: KVTransferConfig | None  # None: no KV connector
