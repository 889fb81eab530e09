"""agentrt.engine: the paged inference engine (config -> scheduler -> KV -> runner -> sampler).

Public names load lazily, so importing one submodule does not pull in the whole engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "agentrt.engine.client.llm",
    "EngineArgs": "agentrt.engine.args",
    "SpeculativeConfig": "agentrt.engine.config",
    "ParallelConfig": "agentrt.engine.config",
    "CompletionOutput": "agentrt.engine.client.outputs",
    "Logprob": "agentrt.engine.client.outputs",
    "RequestOutput": "agentrt.engine.client.outputs",
    "SamplingParams": "agentrt.engine.sampling_params",
    "StructuredOutputsParams": "agentrt.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrt.engine' has no attribute {name!r}")
