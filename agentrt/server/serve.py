"""Run the app under uvicorn with agentrt's shutdown rules, and return the exit status.

- SIGTERM / SIGINT: stop admitting requests (`/health` and new requests answer 503), let the
  running ones finish for up to `drain_timeout_s`, then stop; exit status 0. A second signal
  stops at once.
- A dead engine: `/health` answers 503 for `dead_engine_grace_s`, then the server stops with
  exit status 1, so a supervisor (systemd, Kubernetes) restarts it.

uvicorn's own handler would stop at the first signal and re-raise it after shutdown (the
process would die *by* SIGTERM, not exit 0), so `_Server` replaces it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from agentrt.server.app import create_app
from agentrt.server.state import ServerConfig, ServerState

try:
    import uvicorn
except ImportError:  # pragma: no cover - the hint is the point
    raise ImportError(
        "agentrt serve needs fastapi and uvicorn: pip install 'agentrt[server]'"
    ) from None

logger = logging.getLogger("agentrt.server")


async def serve(
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    llm_engine=None,
    sock: socket.socket | None = None,
    on_ready: Callable[[ServerState], None] | None = None,
) -> int:
    """Serve until drained or the engine dies; returns the process exit status. `sock` is
    an already bound socket to serve on (then host and port are ignored). `on_ready(state)`
    runs once the server accepts requests; setting `state.drain_requested` stops it as
    SIGTERM does (for a server embedded in another program)."""
    app = create_app(config, llm_engine=llm_engine)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # Requests were drained already; this bounds what a stuck connection can delay.
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    server = _Server(uv_config)
    server.on_ready = on_ready
    await server.serve(sockets=[sock] if sock is not None else None)
    state = getattr(app.state, "server", None)
    if state is None or not server.started:  # the lifespan failed (the model did not load)
        return 1
    return state.exit_code


class _Server(uvicorn.Server):
    """Signals start a drain instead of a stop; the app's supervisor stops the server."""

    agentrt_state: ServerState | None = None
    on_ready: Callable[[ServerState], None] | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        state = getattr(self.config.app.state, "server", None)
        if state is not None:
            self.agentrt_state = state

            def request_exit() -> None:
                self.should_exit = True

            state.request_exit = request_exit
            if self.on_ready is not None:
                self.on_ready(state)

    def handle_exit(self, sig, frame) -> None:
        state = self.agentrt_state
        if state is None or state.drain_requested:  # not started yet, or a second signal
            self.should_exit = True
            self.force_exit = state is not None
            return
        logger.info("signal %d: draining before exit", sig)
        state.drain_requested = True
