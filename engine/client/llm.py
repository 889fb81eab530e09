"""LLM: the offline, synchronous entry point (vLLM's `LLM`).

Importing this module imports no torch: `LLM(...)` imports the engine, and so torch
(tests/engine/test_gguf_reader.py checks that the import stays torch-free), with Python's
cyclic garbage collector paused. Torch's import and the engine's build create ~250k
long-lived objects (Llama-3.2-1B Q4_K_M), and the collector's passes over them while they
were created were ~0.2-0.3 s of a start's main-thread CPU (~400 passes, three of them full
ones), freeing ~7k small objects (no tensors). When `LLM(...)` imported torch (the process's
start), what is alive then is frozen once built (`gc.freeze()`, as a pre-forking server
does): never traversed again, where resuming would make the first step's collection pass
over all of it (~0.1 s). A later engine in the process only pauses the collector: a freeze
would also keep whatever cyclic garbage other code had not yet had collected.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from agentrt.engine.errors import InvalidRequestError
from agentrt.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agentrt.engine.client.outputs import RequestOutput
    from agentrt.engine.client.processor import Prompt
    from agentrt.engine.records import EngineCoreRequest

Messages = list[dict]


class LLM:
    """Generate from a model on this machine, synchronously. `model=None` runs the embedded
    SmolLM2-135M-Instruct; otherwise a local HF checkpoint directory or a .gguf file. The
    options are the fields of `EngineArgs`; the engine's components (`tokenizer`, `scheduler`, `kv_manager`, ...)
    are reachable as attributes of the LLM."""

    def __init__(self, model: str | None = None, **options) -> None:
        with _collector_paused():
            from agentrt.engine.client.llm_engine import LLMEngine  # torch: module doc

            self.engine = LLMEngine(model, **options)
        self._req_counter = itertools.count()

    def __getattr__(self, name: str):
        if name == "engine":  # not yet set: __init__ failed
            raise AttributeError(name)
        return getattr(self.engine, name)

    def get_tokenizer(self):
        return self.engine.tokenizer

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
            ids = self.engine.processor.chat_token_ids(
                list(conversation), add_generation_prompt=add_generation_prompt
            )
            prompts.append((ids, self.engine.tokenizer.decode(ids)))
        return self._run(prompts, sampling_params, None)

    def _run(self, prompts, sampling_params, priority) -> list[RequestOutput]:
        engine = self.engine
        params = _per_prompt(sampling_params, len(prompts), "sampling_params", SamplingParams())
        priorities = _per_prompt(priority, len(prompts), "priority", 0)
        requests: list[tuple[EngineCoreRequest, str | None]] = []
        for (prompt, text), p, prio in zip(prompts, params, priorities, strict=True):
            req_id = f"llm-{next(self._req_counter)}"
            requests.append((engine.processor.process(req_id, prompt, p, priority=prio), text))
        for request, text in requests:
            engine.add_request(request, text)
        results: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            results.update((d.request_id, d.output) for d in engine.step() if d.finished)
        return [results[request.req_id] for request, _ in requests]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic collection while the body runs; once it is done, everything alive frozen if
    it imported torch (module doc). The collector's enabled state is restored either way."""
    starting = "torch" not in sys.modules
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if starting:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()


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
