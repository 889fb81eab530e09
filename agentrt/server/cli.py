"""The `agentrt serve` command line: server options and the engine's (`EngineArgs`), then
`serve(...)`."""

from __future__ import annotations

import argparse
import os

from agentrt.engine.args import EngineArgs
from agentrt.server.batch_options import BatchConfig, add_batch_args
from agentrt.server.response_store import MAX_AGE_S, MAX_BYTES, MAX_RESPONSES

# --cache-isolation: whose requests may share prefix-cache hits (and see them in
# cached_tokens): everyone's, those of one `user`, or those sent with one API key.
CACHE_ISOLATION = ("none", "user", "key")


def add_listen_args(parser: argparse.ArgumentParser, api_key_checked: str = "") -> None:
    """--host, --port and --api-key of an HTTP front (`agentrt serve`, `agentrt proxy`):
    loopback and open unless told otherwise. `api_key_checked`: when the key is checked, if
    that needs saying."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AGENTRT_API_KEY"),
        help=f"require 'Authorization: Bearer KEY' on every route but /health{api_key_checked} "
        "(default: $AGENTRT_API_KEY; none = open)",
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    add_listen_args(parser)
    parser.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="else 413")
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests"
    )
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=MAX_RESPONSES,
        help="responses kept for previous_response_id and GET /v1/responses/{id}, oldest out "
        "first (0: none)",
    )
    parser.add_argument(
        "--stored-response-ttl",
        type=float,
        default=MAX_AGE_S,
        help="seconds a stored response is kept",
    )
    parser.add_argument(
        "--max-stored-response-bytes",
        type=int,
        default=MAX_BYTES,
        help="bytes the stored responses may hold, conversations included",
    )
    parser.add_argument(
        "--cache-isolation",
        choices=CACHE_ISOLATION,
        default="none",
        help="whose requests share prefix-cache hits (and see them in cached_tokens): all "
        "(none), those of one `user` field (user), or those of one API key (key); a request's "
        "own cache_salt separates it further",
    )
    parser.add_argument(
        "--allow-client-priority",
        action="store_true",
        help="honour a request's `priority` (else ignored: any client could jump the queue)",
    )
    parser.add_argument(
        "--allow-mcp-servers",
        nargs="+",
        default=[],
        metavar="URL_OR_COMMAND",
        help="MCP servers that Responses `mcp` tools may use: a streamable HTTP URL, or a "
        "command that serves MCP on stdin/stdout (quoted); a request's `server_url` must be "
        "one of these exactly (default: none, mcp tools are refused)",
    )
    parser.add_argument("--log-level", default="info")
    add_batch_args(parser)
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (exit 0 after draining) or an engine fault (exit 1)."""
    import logging

    import anyio

    from agentrt.server.serve import serve
    from agentrt.server.state import ServerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        engine_args=EngineArgs.from_cli_args(args),
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        max_stored_responses=args.max_stored_responses,
        stored_response_ttl_s=args.stored_response_ttl,
        max_stored_response_bytes=args.max_stored_response_bytes,
        cache_isolation=args.cache_isolation,
        allow_client_priority=args.allow_client_priority,
        allow_mcp_servers=tuple(args.allow_mcp_servers),
        batch=BatchConfig.from_cli_args(args),
    )
    return anyio.run(
        lambda: serve(config, host=args.host, port=args.port, log_level=args.log_level.lower())
    )
