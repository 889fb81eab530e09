"""LLMEngine: the engine's components wired together, driven one step at a time.

`LLM` (synchronous, offline) and `AsyncEngine` (a background thread behind an async API) both
drive one of these. It is not thread-safe: exactly one thread calls its methods.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentrt.engine import envs
from agentrt.engine.args import EngineArgs
from agentrt.engine.client.outputs import OutputProcessor, RequestDelta
from agentrt.engine.client.processor import Processor
from agentrt.engine.config import EngineConfig, KVTransferConfig, SpeculativeConfig
from agentrt.engine.core.engine_core import EngineCore
from agentrt.engine.core.kv_cache_groups import kv_cache_layout
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.core.scheduler import Scheduler, SchedulerStats
from agentrt.engine.core.structured_output import StructuredOutputManager
from agentrt.engine.errors import ConfigError
from agentrt.engine.kv_transfer import (
    KVConnectorScheduler,
    KVLayout,
    create_connector_scheduler,
    engine_id,
)
from agentrt.engine.loader.fit import MemoryEstimate, available_memory, check_fit, weight_bytes
from agentrt.engine.loader.load import get_loader
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.model.parallel import shard_arch
from agentrt.engine.records import EngineCoreRequest
from agentrt.engine.spec_decode.draft_model import DraftModelProposer
from agentrt.engine.spec_decode.manager import SpecDecodeManager
from agentrt.engine.worker.executor import TensorParallelExecutor
from agentrt.engine.worker.model_runner import ModelRunner, kv_block_bytes
from agentrt.engine.worker.worker import build_runner


class LLMEngine:
    """`model=None` runs the embedded SmolLM2-135M-Instruct; otherwise a local HF checkpoint
    directory or a .gguf file. Every option is validated on creation (`ConfigError`); `args`
    holds them all, defaults included, and `config` what they resolved to, once
    (`EngineArgs.create_engine_config`), which every component takes its part of."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`options` are the fields of `EngineArgs` (`dtype`, `max_num_seqs`, ...)."""
        args = EngineArgs.from_options(model, **options)
        if args.create_parallel_config().uses_engine_process:
            raise ConfigError(
                "engine_process=True and data_parallel_size>1 are options of AsyncEngine, "
                "Runtime and `agentrt serve`, which then run engine cores in their own "
                "processes; an LLMEngine runs in this one: leave engine_process=False and "
                "data_parallel_size=1 here (tensor_parallel_size works)."
            )
        self._build(args, args.create_engine_config())

    @classmethod
    def from_engine_config(cls, args: EngineArgs, config: EngineConfig) -> LLMEngine:
        """The engine of a config already resolved from `args` (an engine-core process
        receives both from its front end, which resolved them)."""
        engine = cls.__new__(cls)
        engine._build(args, config)
        return engine

    def _build(self, args: EngineArgs, config: EngineConfig) -> None:
        assert not config.parallel.uses_engine_process, "a core process runs one LLMEngine"
        self.args = args
        self.config = config
        self.model_config = config.model
        self.cache_config = config.cache
        self.scheduler_config = config.scheduler
        self.model_path = config.model.path
        self.arch = config.model.arch
        self.max_model_len = config.model.max_model_len
        tp_size = config.parallel.tensor_parallel_size
        threads = envs.num_threads()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(config.model.seed)
        num_blocks = config.cache.num_blocks
        self._check_fit(tp_size, num_blocks)
        # The tokenizer is built while the weights are interleaved on the loader's threads
        # (loader/load.py): its build holds the GIL, their C calls do not.
        tokenizers: list = []
        self.runner = self._start_runner(
            tp_size, alongside=lambda: tokenizers.append(load_tokenizer(config.model.path))
        )
        self.tokenizer = tokenizers[0]
        self.kv_manager = KVCacheManager(
            num_blocks,
            config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            sliding_windows=kv_cache_layout(self.arch).sliding_windows,
        )
        self.connector = self._kv_connector(
            config.kv_transfer, config.model.path, config.model.hf_config, tp_size
        )
        spec_config = config.speculative
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.kv_manager,
            self.max_model_len,
            connector=self.connector,
        )
        self.processor = self.make_processor(self.tokenizer)
        self.eos_token_ids = self.processor.eos_token_ids
        structured = StructuredOutputManager(
            self.tokenizer,
            self.arch.vocab_size,
            sorted(self.eos_token_ids),
            config.structured_outputs.grammar_timeout_s,
            jump_forward=self.scheduler_config.jump_forward,
        )
        self.engine_core = EngineCore(
            self.scheduler,
            self.runner,
            self.arch.vocab_size,
            structured,
            overlap_grammar=self.runner.device.type == "cuda",
            spec=self._spec_decode(spec_config, structured),
            kv_connector=self.connector,
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def _check_fit(self, tp_size: int, num_blocks: int) -> None:
        """Weights (from the checkpoint's tensor table) + KV pool against free memory, before
        anything is allocated (loader/fit.py); raises ModelTooLargeError."""
        model, block_size = self.config.model, self.config.cache.block_size
        # Under tensor parallelism a block holds one rank's KV heads (a draft model, if any,
        # runs whole on rank 0).
        block_bytes = kv_block_bytes(shard_arch(model.arch, tp_size), block_size, model.dtype)
        if self.config.draft_model is not None:
            block_bytes += kv_block_bytes(self.config.draft_model.arch, block_size, model.dtype)
        device = torch.device(model.device)
        estimate = MemoryEstimate(
            weight_bytes=weight_bytes(
                get_loader(model.path).tensor_table(),
                model.arch,
                model.dtype,
                model.quantization,
                tp_size,
            ),
            kv_bytes=num_blocks * block_bytes * tp_size,
            available_bytes=available_memory(device),
        )
        check_fit(estimate, quantization=model.quantization, device=device)

    def _start_runner(self, tp_size: int, alongside: Callable[[], object]) -> ModelRunner:
        """Rank 0's model runner, running `alongside` while its weights are interleaved; with
        tensor_parallel_size > 1 the workers too, which load their shards (of the same
        resolved model and cache config) while this process loads its own (`shutdown()` stops
        them)."""
        model, cache = self.config.model, self.config.cache
        if tp_size == 1:
            self.executor = None
            return build_runner(model, cache, torch.device(model.device), None, alongside)
        self.executor = TensorParallelExecutor(tp_size, model, cache)
        weakref.finalize(self, self.executor.shutdown)  # workers exit with the engine
        try:
            runner = build_runner(
                model, cache, self.executor.device, self.executor.group, alongside
            )
            self.executor.wait_ready()
        except BaseException:
            self.executor.shutdown()
            raise
        return runner

    def _kv_connector(
        self, config: KVTransferConfig | None, path: Path, hf_config: dict, tp_size: int
    ) -> KVConnectorScheduler | None:
        """The KV connector the config names: its scheduler side (returned) and its worker
        side on every rank, which moves that rank's KV heads."""
        if config is None:
            return None  # (p2p under tensor parallelism was refused by EngineArgs)
        layout = KVLayout(
            engine_id=engine_id(
                path,
                hf_config,
                dtype=self.model_config.dtype,
                quantization=self.model_config.quantization,
                block_size=self.cache_config.block_size,
            ),
            block_size=self.cache_config.block_size,
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.model_config.dtype,
        )
        worker = self.runner.start_kv_connector(config, layout)
        weakref.finalize(self, worker.shutdown)
        return create_connector_scheduler(config, layout.shard(0, tp_size), self.kv_manager, worker)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV connector (finishing its writes); the
        engine cannot step afterwards. Also runs when the engine is garbage-collected."""
        if self.executor is not None:
            self.executor.shutdown()
        if self.runner.connector is not None:
            self.runner.connector.shutdown()

    def _spec_decode(
        self, config: SpeculativeConfig | None, structured: StructuredOutputManager
    ) -> SpecDecodeManager | None:
        """The proposer the speculative config names, behind the manager that drafts."""
        if config is None:
            return None
        proposer = None
        if config.method == "ngram":
            from agentrt.engine.spec_decode.ngram import NgramProposer

            proposer = NgramProposer(config, self.tokenizer)
        elif config.method == "suffix":
            from agentrt.engine.spec_decode.suffix import SuffixProposer

            proposer = SuffixProposer(config, self.tokenizer)
        elif config.method == "draft_model":
            proposer = DraftModelProposer(
                self.config.draft_model, self.config.cache, device=self.runner.device
            )
        return SpecDecodeManager(
            config,
            proposer,
            self.kv_manager,
            self.max_model_len,
            steer_to_budget=structured.steer_to_budget,
            proposer_has_kv=config.method == "draft_model",
            jump_forward=self.scheduler_config.jump_forward,
            costly_rows=self.model_config.quantization != "none"
            and self.runner.device.type == "cpu",
        )

    def make_processor(self, tokenizer) -> Processor:
        """A Processor checking this engine's limits (a front end may bring its own copy of
        the tokenizer so it can tokenize on another thread)."""
        return Processor.for_engine(self.config, tokenizer)

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        """Queue a request the Processor built; `prompt` is its text, if it had one."""
        self.output_processor.add_request(
            request.req_id, prompt, request.prompt_token_ids, request.sampling_params
        )
        self.engine_core.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> list[RequestDelta]:
        """Stop requests in any state and free their blocks; unknown or finished ids are
        ignored. Returns the final delta of each request that was still live."""
        self.engine_core.abort_requests(req_ids)
        return self.output_processor.abort(req_ids)

    def abort_all(self) -> None:
        """Abort every request the engine still tracks (shutdown)."""
        self.abort_requests(list(self.output_processor.states))

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestDelta]:
        """One engine step: what changed for each request (finished ones carry `output`)."""
        deltas, to_abort = self.output_processor.process_outputs(self.engine_core.step())
        self.engine_core.abort_requests(to_abort)  # ended by a stop string
        return deltas

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay valid for their requests)."""
        self.kv_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        return self.engine_core.stats()
