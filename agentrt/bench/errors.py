"""Typed errors of `agentrt bench`."""

from __future__ import annotations

from agentrt.errors import AgentrtError, ErrorCode


class BenchConfigError(AgentrtError, ValueError):
    """A benchmark option is out of range or names something unknown; the message says
    which and what is expected."""

    code = ErrorCode.INVALID_REQUEST
