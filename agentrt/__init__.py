"""agentrt: a structured-output agent runtime on its own paged inference engine.

Public names load lazily: `import agentrt.grammar` does not start loading the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "agentrt.engine.llm",
    "CompletionOutput": "agentrt.engine.outputs",
    "Logprob": "agentrt.engine.outputs",
    "RequestOutput": "agentrt.engine.outputs",
    "SamplingParams": "agentrt.engine.sampling_params",
    "StructuredOutputsParams": "agentrt.engine.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
