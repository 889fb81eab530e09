"""The FastAPI application: routes, the engine's lifetime, and the supervisor that turns a
drain request (SIGTERM) or a dead engine into a server exit.

`create_app(config)` loads the model when the app starts (ASGI lifespan) and runs it on an
`AsyncEngine`; pass `llm_engine=` to serve an engine that is already loaded (tests do).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm_engine import LLMEngine
from agentrt.engine.errors import ErrorCode, InvalidRequestError
from agentrt.server.batches import BatchManager
from agentrt.server.batches_api import add_batch_routes
from agentrt.server.chat import chat_prompt, create_chat_completion
from agentrt.server.completions import create_completion
from agentrt.server.errors import (
    bad_request,
    coded_error,
    from_exception,
    install_error_handlers,
)
from agentrt.server.file_store import FileStore
from agentrt.server.file_upload import MULTIPART_SLACK
from agentrt.server.files_api import FILES_PATH, StateDir, add_file_routes
from agentrt.server.generation import ClientDisconnected
from agentrt.server.messages_api import add_messages_routes
from agentrt.server.metrics import CONTENT_TYPE
from agentrt.server.middleware import GuardMiddleware
from agentrt.server.offload import check_text_length, off_loop
from agentrt.server.params import ChatConstraint
from agentrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from agentrt.server.response_store import ResponseStore
from agentrt.server.responses import now
from agentrt.server.responses_api import add_response_routes
from agentrt.server.responses_mcp_sessions import MCPSessionPool
from agentrt.server.state import ServerConfig, ServerState

logger = logging.getLogger("agentrt.server")

_SUPERVISOR_PERIOD_S = 0.05


def create_app(config: ServerConfig, *, llm_engine: LLMEngine | None = None) -> FastAPI:
    holder: dict[str, ServerState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        args = config.engine_args
        if llm_engine is None:
            engine = AsyncEngine(**dataclasses.asdict(args))
        else:  # already built: only the front end's own limit applies
            engine = AsyncEngine(engine=llm_engine, max_waiting_requests=args.max_waiting_requests)
        async with engine:
            state = ServerState(config, engine)
            state.created = now()
            app.state.server = state
            holder["state"] = state
            async with anyio.create_task_group() as tg:
                tg.start_soon(_supervise, state)
                await tg.start(app.state.mcp_sessions.run)  # MCP sessions kept between requests
                await batches.start(tg, app, config.api_key, lambda: not state.healthy)
                yield
                tg.cancel_scope.cancel()
        state_dir.close()

    app = FastAPI(
        title="agentrt",
        summary="OpenAI-compatible API on the agentrt engine",
        version="0.1.0",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.state.mcp_sessions = MCPSessionPool()
    _add_routes(app)
    store = ResponseStore(
        config.max_stored_responses,
        config.stored_response_ttl_s,
        config.max_stored_response_bytes,
    )
    add_response_routes(app, store)
    add_messages_routes(app, config)
    state_dir = StateDir(config.batch)
    files = FileStore(
        state_dir.path,
        max_file_bytes=config.batch.max_file_bytes,
        max_storage_bytes=config.batch.max_storage_bytes,
    )
    batches = BatchManager(files, config.batch.max_concurrency, config.batch.completion_windows)
    add_file_routes(app, files, config.api_key)
    add_batch_routes(app, batches, config.api_key)

    def count_status(status: int) -> None:
        if "state" in holder:
            holder["state"].metrics.count_response(status)

    app.add_middleware(
        GuardMiddleware,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
        max_upload_bytes={FILES_PATH: config.batch.max_file_bytes + MULTIPART_SLACK},
        streamed_paths=(FILES_PATH,),  # streamed to disk, capped as it comes: file_upload
        on_status=count_status,
    )
    return app


async def _supervise(state: ServerState) -> None:
    """Exit when asked to drain (after draining) or when the engine died (non-zero)."""
    while True:
        if state.engine.is_dead:
            logger.error("the engine died: answering 503, then exiting with status 1")
            state.exit_code = 1
            await anyio.sleep(state.config.dead_engine_grace_s)
            state.request_exit()
            return
        if state.drain_requested:
            state.draining = True
            timeout = state.config.drain_timeout_s
            logger.info("draining: no new requests; waiting up to %.0fs for running ones", timeout)
            left = await state.engine.drain(timeout)
            if left:
                logger.warning("drain timeout: aborting %d unfinished requests", left)
            state.request_exit()
            return
        await anyio.sleep(_SUPERVISOR_PERIOD_S)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _add_routes(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has gone

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = _state(request)
        if state.healthy:
            return JSONResponse({"status": "ok"})
        reason = "draining" if state.draining and not state.engine.is_dead else "engine dead"
        raise coded_error(ErrorCode.ENGINE_DEAD, f"the server is not serving: {reason}.")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state = _state(request)
        stats = None if state.engine.is_dead else await state.engine.stats()
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(_state(request))]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str, request: Request) -> dict:
        state = _state(request)
        state.check_model(model)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(_state(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(_state(request), body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("pass exactly one of `prompt` and `messages`.", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(
                model=state.model_name,
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
            )
            constraint = ChatConstraint(None, None, None)
            tokens = await off_loop(state.prompt_limiter, chat_prompt, state, chat, constraint)
        else:
            tokens = await off_loop(state.prompt_limiter, _encode, state, body)
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        try:
            token_ids = state.engine.processor.tokenize(body.tokens) if body.tokens else []
        except InvalidRequestError as exc:
            raise from_exception(exc, {"prompt_token_ids": "tokens"}) from None
        text = await off_loop(state.prompt_limiter, state.engine.tokenizer.decode, token_ids)
        return {"prompt": text}


def _encode(state: ServerState, body: TokenizeRequest) -> list[int]:
    check_text_length(body.prompt, state.max_model_len, state.max_token_chars)
    return state.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "agentrt",
        # vLLM puts the model's path here; a client has no use for the server's file system.
        "root": state.model_name,
        "max_model_len": state.max_model_len,
    }
