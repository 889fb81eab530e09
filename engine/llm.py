"""LLM: the offline, synchronous entry point (vLLM's `LLM`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from agentrt.engine import envs
from agentrt.engine.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_dtype
from agentrt.engine.engine_core import EngineCore
from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.model.arch import ModelArchConfig
from agentrt.engine.model.checkpoint import (
    load_hf_config,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)
from agentrt.engine.model_runner import ModelRunner, kv_pool_blocks
from agentrt.engine.outputs import OutputProcessor, RequestOutput
from agentrt.engine.processor import Processor, Prompt
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler
from agentrt.engine.structured_output import StructuredOutputManager, to_grammar_spec
from agentrt.grammar import GrammarSpec

Messages = list[dict]


class LLM:
    """Generate from a model on this machine. `model=None` runs the embedded
    SmolLM2-135M-Instruct; otherwise a local HF checkpoint directory or a .gguf file."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int = 16,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_cache_memory_gb: float = 2.0,
        num_kv_blocks: int | None = None,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        attention_backend: str = "torch",
        grammar_timeout_s: float = 10.0,
        seed: int = 0,
    ) -> None:
        threads = envs.num_threads()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.model_config = ModelConfig(model, resolve_dtype(dtype), device, max_model_len, seed)
        self.cache_config = CacheConfig(
            block_size, kv_cache_memory_gb, num_kv_blocks, enable_prefix_caching
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, scheduling_policy, long_prefill_token_threshold
        )
        path = resolve_model(model)
        self.model_path = path
        hf_config = load_hf_config(path)
        self.arch = ModelArchConfig.from_hf_dict(hf_config)
        self.tokenizer = load_tokenizer(path)
        self.max_model_len = min(
            max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        dtype_ = self.model_config.dtype
        num_blocks = kv_pool_blocks(self.arch, self.cache_config, dtype_)
        self.runner = ModelRunner(
            self.arch,
            load_state_dict(path),
            dtype=dtype_,
            device=torch.device(device),
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            attention_backend=attention_backend,
        )
        self.kv_manager = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, self.kv_manager, self.max_model_len)
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        structured = StructuredOutputManager(
            self.tokenizer, self.arch.vocab_size, sorted(eos), grammar_timeout_s
        )
        self.engine_core = EngineCore(self.scheduler, self.runner, self.arch.vocab_size, structured)
        self.processor = Processor(
            self.tokenizer,
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            block_size=block_size,
            num_kv_blocks=num_blocks,
            eos_token_ids=frozenset(eos),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._req_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay valid for their requests)."""
        self.kv_manager.reset_prefix_cache()

    def stats(self):
        return self.scheduler.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. Prompts are
        strings or token-id lists. Every request is validated before any is queued."""
        prompt_list = _as_prompt_list(prompts)
        return self._run(
            [(p, p if isinstance(p, str) else None) for p in prompt_list], sampling_params, priority
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered
        with the model's chat template."""
        if not messages:
            raise InvalidRequestError(
                "messages is empty: pass at least one message.", field="messages", value=messages
            )
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            ids = self.processor.chat_token_ids(
                list(conversation), add_generation_prompt=add_generation_prompt
            )
            prompts.append((ids, self.tokenizer.decode(ids)))
        return self._run(prompts, sampling_params, None)

    def _run(self, prompts, sampling_params, priority) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts), "sampling_params", SamplingParams())
        priorities = _per_prompt(priority, len(prompts), "priority", 0)
        requests: list[tuple[Request, str | None, GrammarSpec | None]] = []
        for (prompt, text), p, prio in zip(prompts, params, priorities, strict=True):
            req_id = f"llm-{next(self._req_counter)}"
            request = self.processor.process(req_id, prompt, p, priority=prio)
            spec = to_grammar_spec(p.structured_outputs) if p.structured_outputs else None
            requests.append((request, text, spec))
        for request, text, spec in requests:
            self.output_processor.add_request(
                request.req_id, text, request.prompt_token_ids, request.sampling_params
            )
            self.engine_core.add_request(request, spec)
        results: dict[str, RequestOutput] = {}
        while self.engine_core.has_unfinished_requests():
            finished, to_abort = self.output_processor.process_outputs(self.engine_core.step())
            self.engine_core.abort_requests(to_abort)
            results.update((out.request_id, out) for out in finished)
        return [results[request.req_id] for request, _, _ in requests]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("prompts is empty: pass at least one prompt.", field="prompts")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(value, count: int, name: str, default) -> list:
    """One value per prompt: None -> `default` for all, a single value -> for all, else a
    sequence that must have one entry per prompt."""
    if value is None:
        value = default
    if isinstance(value, SamplingParams | int):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise InvalidRequestError(
            f"{name} has {len(value)} entries for {count} prompts: pass one, or one per prompt.",
            field=name,
            value=len(value),
        )
    return value
