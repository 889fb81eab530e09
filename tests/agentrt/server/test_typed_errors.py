"""The same failure is the same exception, with the same code and message, from the local
engine and through `agentrt serve` + RemoteBackend: one table (agentrt.errors.ERROR_KINDS)
gives the server its status and the client its exception, and no layer reads a message to
tell errors apart."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from agentrt.backend import Completion, LocalBackend
from agentrt.engine.args import EngineArgs
from agentrt.engine.client.async_engine import AsyncEngine
from agentrt.engine.client.llm import LLM
from agentrt.engine.errors import EngineError, ErrorCode
from agentrt.errors import (
    ERROR_KINDS,
    AgentrtError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    OutputValidationError,
    SchemaError,
)
from agentrt.formats import resolve_format
from agentrt.remote import RemoteBackend
from agentrt.server.errors import coded_error
from agentrt.server.state import ServerConfig
from agentrt.session import Session
from tests.agentrt.server.helpers import API_KEY, in_process_server

pytestmark = pytest.mark.anyio

# Valid JSON schema, but the grammar cannot compile it: the reference goes nowhere.
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
# The grammar can only spell [1, 1]; uniqueItems is checked after generation, so the end of
# the array is never allowed: a dead end.
DEAD_END = {
    "type": "array",
    "items": {"enum": [1]},
    "minItems": 2,
    "maxItems": 2,
    "uniqueItems": True,
}


@pytest.fixture
async def local(smollm2_default_llm):
    async with AsyncEngine(engine=smollm2_default_llm.engine) as engine:
        yield LocalBackend(engine)


@pytest.fixture
async def remote(server):
    backend = RemoteBackend(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    yield backend
    await backend.aclose()


async def _failure(backend, prompt: str, schema=None, **sampling) -> Exception:
    with pytest.raises((AgentrtError, EngineError)) as info:
        await Session(backend).generate(prompt, schema, temperature=0.0, **sampling)
    return info.value


def _same(local: Exception, remote: Exception, cls: type, code: ErrorCode) -> None:
    assert type(local) is cls and type(remote) is cls, (local, remote)
    assert local.code == remote.code == code
    assert str(local) == str(remote)


async def test_a_schema_the_grammar_cannot_compile(local, remote):
    errors = [
        await _failure(b, "Give me JSON.", UNCOMPILABLE, max_tokens=8) for b in (local, remote)
    ]
    _same(*errors, SchemaError, ErrorCode.INVALID_SCHEMA)
    assert "missing" in str(errors[0]) and "grammar compilation failed" not in str(errors[0])
    # Below the Session: both backends end the turn with a failed completion and its code.
    fmt = resolve_format(UNCOMPILABLE)
    messages = [{"role": "user", "content": "Give me JSON."}]
    for backend in (local, remote):
        items = [i async for i in backend.stream(messages, fmt, {"max_tokens": 8})]
        assert isinstance(items[-1], Completion)
        assert items[-1].finish_reason == "error"
        assert items[-1].error_code == ErrorCode.INVALID_SCHEMA


async def test_a_grammar_dead_end(local, remote):
    errors = [await _failure(b, "A list:", DEAD_END, max_tokens=20) for b in (local, remote)]
    _same(*errors, OutputValidationError, ErrorCode.STRUCTURED_OUTPUT_FAILED)
    assert errors[0].text == errors[1].text == "[1, 1]"
    assert "unique" in str(errors[0])


def test_a_dead_end_mid_stream_is_an_error_event_then_done(http):
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "A list:"}],
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "l", "schema": DEAD_END},
        },
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200  # the first token was out before the dead end
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "structured_output_failed" and "unique" in error["message"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert text == "[1, 1]"


async def test_a_full_queue_and_a_dead_engine(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    llm = LLM(model, dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=1)
    long = {"max_tokens": 1000, "ignore_eos": True}
    config = ServerConfig(engine_args=EngineArgs(model=model, max_waiting_requests=0))

    async def overloaded(backend) -> Exception:
        """The one running slot is taken: the next request is refused."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: Session(backend).generate("one", **long))
            with anyio.fail_after(30):
                while (await backend.stats()).num_running == 0:
                    await anyio.sleep(0.02)
            error = await _failure(backend, "two", max_tokens=2)
            tg.cancel_scope.cancel()
        return error

    async with AsyncEngine(engine=llm.engine, max_waiting_requests=0) as engine:
        local_error = await overloaded(LocalBackend(engine))
    async with in_process_server(config, llm.engine) as server:
        backend = RemoteBackend(base_url=server.url + "/v1", max_retries=0)
        remote_error = await overloaded(backend)
        await backend.aclose()
        server.stop()
    _same(local_error, remote_error, EngineOverloadedError, ErrorCode.OVERLOADED)

    def broken_llm() -> LLM:  # a fresh one each: a failed step leaves its request behind
        broken = LLM(model, dtype="float32", kv_cache_memory_gb=0.01)

        def broken_step():
            raise RuntimeError("injected fault")

        broken.engine.engine_core.step = broken_step
        return broken

    async with AsyncEngine(engine=broken_llm().engine) as engine:
        local_error = await _failure(LocalBackend(engine), "hello", max_tokens=4)
    config = ServerConfig(engine_args=EngineArgs(model=model), dead_engine_grace_s=3.0)
    async with in_process_server(config, broken_llm().engine) as server:
        backend = RemoteBackend(base_url=server.url + "/v1", max_retries=0)
        remote_error = await _failure(backend, "hello", max_tokens=4)
        await backend.aclose()
    assert type(local_error) is type(remote_error) is EngineDeadError
    assert local_error.code == remote_error.code == ErrorCode.ENGINE_DEAD
    assert "injected fault" in str(local_error) and "injected fault" in str(remote_error)


@pytest.mark.parametrize("code", list(ErrorCode))
async def test_every_code_comes_back_as_its_exception(code: ErrorCode):
    """The server's error object for a code, read by the remote client: the table's class
    (raised, or as a failed completion for the codes that end a request) and the same code,
    with `param` as the exception's field."""
    error = coded_error(code, f"failed: {code}", param="max_tokens")
    response = httpx.Response(error.status, request=httpx.Request("POST", "http://x/v1"))
    exc = openai.APIStatusError(error.message, response=response, body=error.body())

    class Failing:
        async def create(self, **_):
            raise exc

    backend = RemoteBackend(base_url="http://127.0.0.1:1/v1", model="m")
    backend.client.chat.completions = Failing()
    kind = ERROR_KINDS[code]
    fmt = resolve_format(None)
    if kind.finishes:
        (completion,) = [i async for i in backend.stream([], fmt, {})]
        assert completion.finish_reason == "error" and completion.error_code == code
        assert completion.error == f"failed: {code}"
        with pytest.raises(kind.exception) as info:
            await Session(backend).generate("x")
    else:
        with pytest.raises(kind.exception) as info:
            [i async for i in backend.stream([], fmt, {})]
        if kind.exception is InvalidRequestError:
            assert info.value.field == "max_tokens"
    assert info.value.code == code and str(info.value) == f"failed: {code}"
    await backend.aclose()
