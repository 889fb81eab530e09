"""The server's configuration (a frozen record) and its live state: the engine, metrics, and
the shutdown flags that `/health`, the SIGTERM drain and the dead-engine exit share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.server.errors import APIError
from agentrt.server.metrics import ServerMetrics
from agentrt.server.response_store import MAX_AGE_S, MAX_BYTES, MAX_RESPONSES

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`engine_args` configure the engine (`EngineArgs(model=None)` serves the embedded
    model); the rest is the HTTP server's own."""

    engine_args: EngineArgs = field(default_factory=EngineArgs)
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    drain_timeout_s: float = 30.0
    # How long a dead engine keeps answering (503) before the process exits non-zero.
    dead_engine_grace_s: float = 1.0
    # The Responses API's store (previous_response_id, GET /v1/responses/{id}): its bounds.
    max_stored_responses: int = MAX_RESPONSES
    stored_response_ttl_s: float = MAX_AGE_S
    max_stored_response_bytes: int = MAX_BYTES

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine_args.model
        if model is None:
            return EMBEDDED_MODEL_NAME
        path = Path(model)
        return path.stem if path.suffix == ".gguf" else path.name


class ServerState:
    """Shared by the routes and the supervisor. `request_exit` is installed by whoever runs
    the ASGI server (`serve.py`); under a test transport it does nothing."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine) -> None:
        self.config = config
        self.engine = engine
        self.model_name = config.model_name
        self.metrics = ServerMetrics(self.model_name)  # its series carry the model name
        self.draining = False
        self.drain_requested = False
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None
        self.created = 0

    @property
    def max_model_len(self) -> int:
        """The context length /tokenize and the model card report (requests are checked
        against every limit in one place, the engine's Processor)."""
        return self.engine.processor.max_model_len

    @property
    def healthy(self) -> bool:
        return not (self.draining or self.engine.is_dead)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist: this server serves {self.model_name!r} "
                "(see GET /v1/models).",
                param="model",
                code="model_not_found",
            )
