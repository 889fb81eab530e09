"""agentrt: a structured-output agent runtime on its own paged inference engine.

    async with agentrt.Runtime() as rt:
        person = await rt.session(system="...").generate("...", schema=Person)

Names load lazily: `import agentrt.grammar` does not start loading the engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # SDK
    "Runtime": "agentrt.runtime",
    "Session": "agentrt.session",
    "Result": "agentrt.session",
    "Usage": "agentrt.backend",
    "ReasoningText": "agentrt.reasoning",
    "Regex": "agentrt.formats",
    "Choice": "agentrt.formats",
    "tool": "agentrt.tools",
    "Tool": "agentrt.tools",
    "Agent": "agentrt.agent",
    "AgentResult": "agentrt.agent",
    "mcp_server": "agentrt.mcp",
    "ExtractResult": "agentrt.extract",
    "AsyncEngine": "agentrt.engine.client.async_engine",
    # errors
    "AgentError": "agentrt.errors",
    "AgentrtError": "agentrt.errors",
    "EngineDeadError": "agentrt.errors",
    "EngineOverloadedError": "agentrt.errors",
    "GenerationError": "agentrt.errors",
    "InvalidRequestError": "agentrt.errors",
    "MCPServerError": "agentrt.errors",
    "OutputValidationError": "agentrt.errors",
    "SchemaError": "agentrt.errors",
    "TruncatedOutputError": "agentrt.errors",
    # the offline engine API
    "LLM": "agentrt.engine",
    "EngineArgs": "agentrt.engine",
    "CompletionOutput": "agentrt.engine",
    "Logprob": "agentrt.engine",
    "RequestOutput": "agentrt.engine",
    "SamplingParams": "agentrt.engine",
    "StructuredOutputsParams": "agentrt.engine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
