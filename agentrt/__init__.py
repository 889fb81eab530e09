"""agentrt: a structured-output agent runtime on its own paged inference engine.

The offline API (`LLM`, `SamplingParams`, ...) is re-exported from `agentrt.engine`, lazily:
`import agentrt.grammar` does not start loading the engine.
"""

from __future__ import annotations

import importlib

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("agentrt.engine"), name)
    raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
