"""The server's configuration (a frozen record) and its live state: the engine, metrics, and
the shutdown flags that `/health`, the SIGTERM drain and the dead-engine exit share."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentrt.engine.args import EngineArgs
from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.server.batch_options import BatchConfig
from agentrt.server.cli import CACHE_ISOLATION
from agentrt.server.errors import APIError
from agentrt.server.metrics import ServerMetrics
from agentrt.server.middleware import request_api_key
from agentrt.server.offload import max_token_chars, new_limiter
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
    cache_isolation: str = "none"
    # A client's `priority` reorders the queue only when the operator allows it.
    allow_client_priority: bool = False
    # The MCP servers (URLs or commands) a Responses `mcp` tool may name: a client must not
    # make the server reach any other host (agentrt.server.responses_mcp).
    allow_mcp_servers: tuple[str, ...] = ()
    # /v1/files and /v1/batches: where they are kept, and their bounds.
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(
                f"cache_isolation={self.cache_isolation!r}: expected one of {CACHE_ISOLATION}"
            )

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
        self.prompt_limiter = new_limiter()  # threads that render and tokenize prompts
        self._max_token_chars: int | None = None
        # Keys the salts --cache-isolation derives: per process, never sent anywhere.
        self._salt_key = secrets.token_bytes(32)

    @property
    def max_model_len(self) -> int:
        """The context length /tokenize and the model card report (requests are checked
        against every limit in one place, the engine's Processor)."""
        return self.engine.processor.max_model_len

    @property
    def max_token_chars(self) -> int:
        """The longest token of the vocabulary, in chars (offload.check_text_length)."""
        if self._max_token_chars is None:
            self._max_token_chars = max_token_chars(self.engine.tokenizer)
        return self._max_token_chars

    def cache_salt(
        self, client_salt: str | None, user: str | None, headers: Mapping[str, str]
    ) -> str | None:
        """The salt a request's blocks are hashed with: the client's own `cache_salt`,
        within the tenant --cache-isolation derives (a MAC of the `user` or of the API key
        sent, so neither can be guessed from the salt, nor the salt chosen to match another
        tenant's)."""
        mode = self.config.cache_isolation
        if mode == "none":
            return client_salt
        if mode == "user":
            tenant = b"user\0" + (user or "").encode()
        else:
            tenant = b"key\0" + (request_api_key(headers) or "").encode()
        if client_salt is not None:
            tenant += b"\0salt\0" + client_salt.encode()
        return hmac.new(self._salt_key, tenant, hashlib.sha256).hexdigest()

    def priority(self, requested: int | None) -> int:
        """The scheduling priority of a request: the client's when --allow-client-priority
        is set, else 0 (a client could otherwise put itself ahead of everyone)."""
        return (requested or 0) if self.config.allow_client_priority else 0

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
