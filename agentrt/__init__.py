"""agentrt: a structured-output agent runtime on its own paged inference engine."""

from __future__ import annotations
