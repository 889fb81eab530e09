"""EngineArgs: every engine option, defined once (vLLM's `EngineArgs`).

`LLM`, `LLMEngine`, `AsyncEngine`, `Runtime` and `agentrt serve` take these options by name,
and every `agentrt` command derives its engine flags from the fields below (flag name, type,
default, choices and help), so an option, its flag and its default cannot drift apart.
`EngineArgs` itself only collects the values: each is validated by the config record that
owns it (`CacheConfig`, `SchedulerConfig`, ...) when `EngineArgs` is created, before
anything loads; `create_engine_config()` then resolves them once (the checkpoint's path and
config, "auto" made concrete, the KV pool sized) into the frozen `EngineConfig` the engine
and its tensor-parallel ranks take their parts of.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from agentrt.engine import envs
from agentrt.engine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CONNECTORS,
    KV_ROLES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_model_options,
    check_option_names,
    resolve_dtype,
)
from agentrt.engine.core.kv_cache_groups import check_kv_cache_layout
from agentrt.engine.errors import ConfigError
from agentrt.engine.loader.checkpoint import load_hf_config, resolve_model
from agentrt.engine.loader.gguf_file import is_gguf
from agentrt.engine.loader.quantization import resolve_quantization
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.parallel import check_tensor_parallel, shard_arch
from agentrt.engine.spec_decode.draft_model import resolve_draft_model
from agentrt.engine.worker.model_runner import kv_pool_blocks

# The storage connector's default cap on its directory, in GiB.
DEFAULT_KV_STORAGE_MAX_GB = 20.0


def _option(default: Any, help_text: str, *, choices: tuple[str, ...] | None = None) -> Any:
    metadata: dict[str, Any] = {"help": help_text}
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Every option of the engine, with its default and its help text."""

    # -- model -------------------------------------------------------------------------------
    model: str | None = _option(
        None,
        "local HF checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    dtype: str | torch.dtype = _option(
        "auto",
        "weights and activations: 'auto' is float32 on the CPU, bfloat16 on CUDA",
        choices=("auto", *DTYPES),
    )
    quantization: str = _option(
        "auto",
        "weight format on the CPU: gguf (a GGUF's own block formats, Q4_K_M ... Q8_0), "
        "int8 / int4 (a checkpoint quantized to Q8_0 / Q4_1 blocks at load), none (dense in "
        "dtype; a GGUF dequantized in memory); activations stay in dtype. 'auto' is gguf for "
        "a GGUF (the embedded model) on the CPU when dtype is 'auto' too, else none",
        choices=QUANTIZATIONS,
    )
    device: str = _option("cpu", "'cpu' or 'cuda[:N]'")
    max_model_len: int | None = _option(
        None, "context length in tokens (default: the model's max_position_embeddings)"
    )
    seed: int = _option(0, "seed of torch's generator (requests without their own seed use it)")
    # -- KV cache ----------------------------------------------------------------------------
    block_size: int = _option(16, "tokens per KV cache block")
    kv_cache_memory_gb: float = _option(2.0, "GiB of KV cache (unless --num-kv-blocks is set)")
    num_kv_blocks: int | None = _option(None, "KV cache blocks (overrides kv_cache_memory_gb)")
    enable_prefix_caching: bool = _option(True, "reuse the KV cache of shared prompt prefixes")
    # -- scheduler ---------------------------------------------------------------------------
    max_num_seqs: int = _option(128, "requests that run at once")
    max_num_batched_tokens: int = _option(2048, "tokens computed per engine step")
    scheduling_policy: str = _option(
        "fcfs", "order of admission (priority: lower value first)", choices=SCHEDULING_POLICIES
    )
    long_prefill_token_threshold: int | None = _option(
        None,
        "cap on one request's prefill tokens per step while other requests run (alone it "
        "gets the whole step budget); default 64 on the CPU, 512 on a GPU; 0: no cap",
    )
    jump_forward: bool = _option(
        True,
        "append the tokens a grammar forces at once instead of sampling them (off with "
        "speculative method 'grammar', whose drafts are those tokens, verified)",
    )
    max_waiting_requests: int = _option(
        256,
        "requests that may wait beyond max_num_seqs; past it new ones are refused "
        "(EngineOverloadedError; the server answers 429)",
    )
    # -- execution ---------------------------------------------------------------------------
    attention_backend: str = _option(
        "auto",
        "'auto' is the C kernel on the CPU and Triton on CUDA; 'torch' is the reference",
        choices=ATTENTION_BACKENDS,
    )
    grammar_timeout_s: float = _option(10.0, "seconds one grammar may take to compile")
    # -- speculative decoding ----------------------------------------------------------------
    speculative_config: str | dict | SpeculativeConfig | None = _option(
        None,
        "speculative decoding, as a dict or JSON object: method (ngram, suffix, draft_model "
        "or grammar), num_speculative_tokens, prompt_lookup_min/max, model (the draft "
        "model), adaptive, ... (see SpeculativeConfig; default: off)",
    )

    # -- parallelism -------------------------------------------------------------------------
    tensor_parallel_size: int = _option(
        1,
        "ranks the model is split across (heads and MLP columns; gloo on the CPU, NCCL on "
        "CUDA); query and KV heads must divide by it",
    )
    data_parallel_size: int = _option(
        1, "engine-core processes behind one front end, routed by load and prefix affinity"
    )
    engine_process: bool = _option(
        False,
        "run the engine core in its own process behind a client (always so when "
        "data_parallel_size > 1)",
    )

    # -- KV transfer -------------------------------------------------------------------------
    kv_connector: str | None = _option(
        None,
        "move KV blocks: 'storage' saves full blocks to --kv-storage-path and loads them back "
        "(offload, sharing a prefix cache between instances); 'p2p' sends a finished "
        "prefill to another instance (disaggregated prefill/decode; default: none)",
        choices=KV_CONNECTORS,
    )
    kv_role: str = _option(
        "both",
        "producer (save / serve prefills), consumer (load) or both",
        choices=KV_ROLES,
    )
    kv_storage_path: str | None = _option(
        None, "the storage connector's directory (default: <cache dir>/kv)"
    )
    kv_host: str = _option("127.0.0.1", "p2p: the address peers reach this instance's blocks at")
    kv_port: int = _option(0, "p2p: the port a producer serves its blocks on (0: a free one)")
    kv_transfer_timeout_s: float = _option(
        30.0, "a KV transfer not done by then fails; the request computes its prefill itself"
    )
    kv_hold_timeout_s: float = _option(
        120.0, "p2p: how long a producer keeps a finished prefill's blocks for its consumer"
    )
    kv_max_held_fraction: float = _option(
        0.5,
        "p2p: the share of the KV pool a producer may hold for consumers at once; a "
        "do_remote_decode request whose blocks would pass it is refused (the server answers "
        "429 with Retry-After)",
    )
    kv_secret: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "the secret shared by instances that exchange KV: signs the params a "
            "producer hands out, authenticates p2p messages and storage files (required "
            "for p2p; default: the AGENTRT_KV_SECRET environment variable, which unlike a "
            "flag no other user sees in the process list)"
        },
    )
    kv_allowed_producers: str | None = _option(
        None,
        "p2p: comma-separated host:port list a consumer fetches KV from (default: any "
        "producer that signed its params with the shared secret)",
    )
    kv_storage_max_gb: float | None = _option(
        DEFAULT_KV_STORAGE_MAX_GB,
        "storage: GiB the directory may hold; past it the least recently used blocks are "
        f"deleted (default: {DEFAULT_KV_STORAGE_MAX_GB:g}: every client's prompts add blocks, "
        "so without a cap any client could fill the disk)",
    )

    def __post_init__(self) -> None:
        self._option_configs()  # every value is checked (by the record that owns it) first

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineArgs:
        """`EngineArgs(model=model, **options)`, with an error that names the closest option
        when one is misspelt (instead of Python's bare "unexpected keyword argument")."""
        check_option_names(
            options,
            {f.name for f in fields(cls)},
            "an engine option",
            "The options are the fields of agentrt.engine.EngineArgs.",
        )
        return cls(model=model, **options)

    @staticmethod
    def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
        """Engine options from a JSON file: an object of `EngineArgs` fields, or one whose
        "engine_args" member is that object (what `agentrt tune` writes, with its figures
        beside it). Unknown names raise a ConfigError naming the closest option."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the config file {str(path)!r}: {exc}") from None
        if isinstance(data, dict) and isinstance(data.get("engine_args"), dict):
            data = data["engine_args"]
        if not isinstance(data, dict):
            raise ConfigError(
                f"the config file {str(path)!r} holds {type(data).__name__}: expected a JSON "
                "object of engine options."
            )
        check_option_names(
            data,
            {f.name for f in fields(EngineArgs)},
            f"an engine option (in {path})",
            "The options are the fields of agentrt.engine.EngineArgs.",
        )
        return data

    def create_engine_config(self) -> EngineConfig:
        """Every option resolved, once, into the frozen record the engine's components take
        their parts of: the checkpoint found (`resolve_model`; its config read, never its
        weights), "auto" made concrete (dtype, quantization), the context length capped at
        the model's, the KV pool sized. Raises `ConfigError` naming a bad value,
        `ModelLoadError` when the model cannot be found."""
        options = self._option_configs()
        model = self._resolve_model()
        parallel: ParallelConfig = options["parallel"]
        check_tensor_parallel(model.arch, parallel.tensor_parallel_size)
        speculative: SpeculativeConfig | None = options["speculative"]
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = resolve_draft_model(speculative, model)  # one pool holds both models' KV
        kv_transfer: KVTransferConfig | None = options["kv_transfer"]
        check_kv_cache_layout(
            model.arch,
            kv_connector=kv_transfer.connector if kv_transfer is not None else None,
            draft_arch=draft.arch if draft is not None else None,
        )
        cache: CacheConfig = options.pop("cache")
        # Under tensor parallelism a block holds one rank's KV heads (a draft model runs
        # whole on rank 0): the pool's budget is per rank.
        num_blocks = kv_pool_blocks(
            shard_arch(model.arch, parallel.tensor_parallel_size),
            cache,
            model.dtype,
            draft.arch if draft is not None else None,
        )
        return EngineConfig(
            **options,
            model=model,
            draft_model=draft,
            cache=dataclasses.replace(cache, num_blocks=num_blocks),
        )

    def _resolve_model(self) -> ModelConfig:
        path = resolve_model(self.model)
        hf_config = load_hf_config(path)
        arch = ModelArchConfig.from_hf_dict(hf_config)
        return ModelConfig(
            model=None if self.model is None else str(self.model),
            path=path,
            hf_config=hf_config,
            arch=arch,
            dtype=resolve_dtype(
                self.dtype,
                self.device,
                None if is_gguf(path) else hf_config.get("torch_dtype", hf_config.get("dtype")),
            ),
            device=self.device,
            max_model_len=min(
                self.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
            ),
            seed=self.seed,
            attention_backend=self.attention_backend,
            quantization=resolve_quantization(
                self.quantization, self.dtype, self.device, is_gguf(path)
            ),
        )

    def resolved_long_prefill_token_threshold(self) -> int:
        """The prefill cap while others run. On 2 CPU cores (the embedded model under
        load) a 5,500-token prompt in 2,048-token chunks held each step for tens of seconds
        and victims' 2-token completions timed out; capped at 64 they took 2.4 s (median).
        A GPU computes 512 prompt tokens in about one decode step's time."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return 512 if self.device.startswith("cuda") else 64

    def create_parallel_config(self) -> ParallelConfig:
        """Where the engine core runs (needs no model: a front end decides with it whether
        to start core processes)."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            engine_process=self.engine_process,
        )

    def _option_configs(self) -> dict[str, Any]:
        """The records that need no model, by `EngineConfig` field; each validates its
        values, and the model options are checked too (nothing is read)."""
        resolve_dtype(self.dtype, self.device)
        check_model_options(
            device=self.device,
            quantization=self.quantization,
            attention_backend=self.attention_backend,
            max_model_len=self.max_model_len,
        )
        speculative = SpeculativeConfig.parse(self.speculative_config)
        # Grammar drafts are the tokens jump-forward would append unverified: one replaces
        # the other.
        grammar_drafts = speculative is not None and speculative.method == "grammar"
        if self.kv_connector == "p2p" and self.kv_port and self.data_parallel_size > 1:
            raise ConfigError(
                f"kv_port={self.kv_port} with data_parallel_size={self.data_parallel_size}: "
                "each replica serves its own blocks, on a port of its own; leave kv_port=0."
            )
        if self.kv_connector == "p2p" and self.tensor_parallel_size > 1:  # before any rank starts
            raise ConfigError(
                "kv_connector='p2p' runs with tensor_parallel_size=1 only: a consumer pulls "
                "whole blocks from one producer socket, and under tensor parallelism each "
                "rank holds its own KV heads; use data_parallel_size for more engines, or "
                "kv_connector='storage' (each rank stores its own heads)."
            )
        return dict(
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_gb=self.kv_cache_memory_gb,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,
                long_prefill_token_threshold=self.resolved_long_prefill_token_threshold(),
                jump_forward=self.jump_forward and not grammar_drafts,
                max_waiting_requests=self.max_waiting_requests,
            ),
            structured_outputs=StructuredOutputsConfig(grammar_timeout_s=self.grammar_timeout_s),
            speculative=speculative,
            parallel=self.create_parallel_config(),
            kv_transfer=None
            if self.kv_connector is None
            else KVTransferConfig(
                connector=self.kv_connector,
                role=self.kv_role,
                storage_path=self.kv_storage_path or str(envs.cache_dir() / "kv"),
                host=self.kv_host,
                port=self.kv_port,
                timeout_s=self.kv_transfer_timeout_s,
                hold_timeout_s=self.kv_hold_timeout_s,
                max_held_fraction=self.kv_max_held_fraction,
                secret=self.kv_secret or envs.kv_secret(),
                allowed_producers=tuple(
                    a.strip() for a in (self.kv_allowed_producers or "").split(",") if a.strip()
                ),
                storage_max_gb=self.kv_storage_max_gb,
            ),
        )

    # -- command line ------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | Any) -> None:
        """One flag per field: `--max-num-seqs` for `max_num_seqs`; booleans take
        `--jump-forward` / `--no-jump-forward`. And `--config FILE`: options from a JSON file
        (`read_config_file`), which the flags given with it override. A flag not given sets
        nothing (argparse's SUPPRESS): `from_cli_args` then takes the file's value, else the
        field's default."""
        parser.add_argument(
            "--config",
            default=None,
            metavar="FILE",
            help="engine options from a JSON file (e.g. written by `agentrt tune`); flags "
            "given as well override it",
        )
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"]
            if f.default is not None and "default" not in help_text:
                help_text += f" (default: {f.default})"
            kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
            kind = _cli_type(f.name)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = kind
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "config", None):
            given = {**cls.read_config_file(args.config), **given}
        return cls(**given)


def _cli_type(name: str) -> type:
    """The command-line type of a field: its annotation without `None` (a `str | torch.dtype`
    field is given as a string)."""
    hint = typing.get_type_hints(EngineArgs)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint
