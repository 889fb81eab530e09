"""`agentrt run-batch -i in.jsonl -o out.jsonl` on the embedded model: chat-completions and
responses lines in one file, OpenAI's output format, exit statuses, and --resume after a
torn output; a line answered as its route answers the same body POSTed (AppDispatcher calls
the endpoint without HTTP); plus the pieces without a model (line checks, the file store's
caps and owners)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from agentrt.cli import main
from agentrt.server.app import create_app
from agentrt.server.batch_job import AppDispatcher, BatchLine, parse_line, validate
from agentrt.server.errors import APIError
from agentrt.server.file_store import FileStore, owner_of
from agentrt.server.state import ServerConfig
from tests.agentrt.server.test_batch_api import CITIES, chat_line, jsonl

MODEL = "SmolLM2-135M-Instruct"


def responses_line(custom_id: str, text: str) -> dict:
    body = {"model": MODEL, "input": text, "max_output_tokens": 8, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def run_batch(source: Path, output: Path, *flags: str) -> int:
    return main(
        ["run-batch", "-i", str(source), "-o", str(output), "--quiet"]
        + ["--kv-cache-memory-gb", "0.25", *flags]
    )


def read(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_run_batch_mixed_endpoints_then_resume(tmp_path, smollm2_dir, capsys) -> None:
    lines = [chat_line(f"chat-{i}", city) for i, city in enumerate(CITIES[:3])]
    lines += [responses_line("resp-0", "Name a colour."), responses_line("resp-1", "Say hi.")]
    lines.append(chat_line("wrong-model", "Oslo", model="no-such-model"))
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))

    assert run_batch(source, output) == 1  # one line failed
    records = {r["custom_id"]: r for r in read(output)}
    assert sorted(records) == sorted(line["custom_id"] for line in lines)
    for i in range(3):
        body = records[f"chat-{i}"]["response"]["body"]
        message = ChatCompletion.model_validate(body).choices[0].message
        assert isinstance(json.loads(message.content)["city"], str)
    for i in range(2):
        response = Response.model_validate(records[f"resp-{i}"]["response"]["body"])
        assert response.output_text
    assert records["wrong-model"]["response"]["status_code"] == 404

    assert run_batch(source, output) == 2  # an output exists: --resume or --overwrite
    assert "--resume" in capsys.readouterr().err

    # As a stopped run leaves it: two lines done, the third torn mid-write.
    kept = [records["chat-0"], records["resp-1"]]
    torn = json.dumps(records["chat-2"])[:40]
    output.write_text("".join(json.dumps(r) + "\n" for r in kept) + torn)
    assert run_batch(source, output, "--resume") == 1
    resumed = read(output)
    assert sorted(r["custom_id"] for r in resumed) == sorted(records)
    assert resumed[:2] == kept  # not run again


def test_run_batch_refuses_a_bad_input_file(tmp_path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line("a", "Rome")]) + b'{"custom_id": "b"}\n')
    assert run_batch(source, tmp_path / "out.jsonl") == 2
    assert "line 2: url None is not one of" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_parse_line_and_validate(tmp_path) -> None:
    good = json.dumps(chat_line("a", "Rome")).encode()
    assert parse_line(1, good, "/v1/chat/completions") == BatchLine(
        "a", "/v1/chat/completions", chat_line("a", "Rome")["body"]
    )
    wrong_endpoint = parse_line(1, good, "/v1/responses")
    assert wrong_endpoint.param == "url"
    streamed = {**chat_line("a", "Rome")}
    streamed["body"] = {**streamed["body"], "stream": True}
    assert parse_line(7, json.dumps(streamed).encode(), None).param == "body.stream"
    assert parse_line(3, b'{"custom_id": 5}', None).param == "custom_id"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert validate(empty, None)[1][0].code == "empty_file"


def test_file_store_caps_and_owners(tmp_path) -> None:
    store = FileStore(tmp_path, max_file_bytes=100, max_storage_bytes=10_000)
    alice, bob = owner_of("key-a"), owner_of("key-b")
    first = store.upload(alice, "batch", "a.jsonl", io.BytesIO(b"x" * 100))
    with pytest.raises(APIError) as too_large:
        store.upload(alice, "batch", "b.jsonl", io.BytesIO(b"x" * 101))
    assert (too_large.value.status, too_large.value.code) == (413, "file_too_large")
    store.upload(bob, "batch", "c.jsonl", io.BytesIO(b"x" * 100))
    store.max_storage_bytes = store.used_bytes() + 30  # data and metadata count
    with pytest.raises(APIError) as full:
        store.upload(alice, "batch", "d.jsonl", io.BytesIO(b"x" * 60))
    assert full.value.code == "storage_limit_exceeded"
    assert [f["id"] for f in store.list(alice)] == [first["id"]]
    with pytest.raises(APIError) as hidden:
        store.get(bob, first["id"])
    assert hidden.value.status == 404
    store.delete(alice, first["id"])
    store.upload(alice, "batch", "d.jsonl", io.BytesIO(b"x" * 60))  # room again
    assert sorted(p.name for p in (tmp_path / "files").iterdir() if p.suffix == ".tmp") == []


def test_batch_flags_match_batch_config_defaults() -> None:
    from agentrt.cli import build_parser
    from agentrt.server.batch_options import BatchConfig

    args = build_parser().parse_args(["serve"])
    assert BatchConfig.from_cli_args(args) == BatchConfig()
    args = build_parser().parse_args(["serve", "--state-dir", "/x", "--max-file-bytes", "5"])
    assert BatchConfig.from_cli_args(args) == BatchConfig(state_dir="/x", max_file_bytes=5)
    with pytest.raises(ValueError, match="max_concurrency=0"):
        BatchConfig(max_concurrency=0)
    args = build_parser().parse_args(["serve", "--batch-completion-windows", "24h", "90s"])
    assert BatchConfig.from_cli_args(args).completion_windows == ("24h", "90s")
    for windows in (("1d",), ("0h",), ("24 h",), ()):
        with pytest.raises(ValueError, match="completion_windows"):
            BatchConfig(completion_windows=windows)


def _stable(value):
    """`value` without what differs between two runs of one request: ids, timestamps and the
    prefix cache's hits and writes."""
    if isinstance(value, dict):
        drop = (
            "id",
            "created",
            "created_at",
            "completed_at",
            "cached_tokens",
            "cache_write_tokens",
        )
        return {k: _stable(v) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


@pytest.mark.anyio
async def test_a_line_gets_what_its_route_answers(smollm2_llm) -> None:
    """A line runs on the route's endpoint without HTTP (AppDispatcher): its status and body
    are those of the same body POSTed to the app, whether it succeeds or fails in validation,
    on the model's name or in the handler's own checks (ids and timestamps aside)."""
    chat = chat_line("c", "Paris", max_tokens=4)["body"]
    responses = {**responses_line("r", "Say hi.")["body"], "max_output_tokens": 4}
    cases = [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "temperature": "hot"}),  # a type
        ("/v1/chat/completions", {**chat, "stop": 5}),  # a union: none of its forms
        ("/v1/chat/completions", {**chat, "colour": "red"}),  # an unknown argument
        ("/v1/chat/completions", {"model": MODEL}),  # a missing field
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}),  # 404
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}),  # the handler's 400
        ("/v1/responses", responses),
        ("/v1/responses", {**responses, "background": True}),
        ("/v1/responses", {**responses, "input": 5}),
    ]
    app = create_app(ServerConfig(api_key="k"), llm_engine=smollm2_llm.engine)
    async with app.router.lifespan_context(app):
        dispatcher = AppDispatcher(app, "k")
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": "Bearer k"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=headers
        ) as http:
            statuses = []
            for url, body in cases:
                record = await dispatcher.post(BatchLine("x", url, body))
                response = await http.post(url, json=body)
                assert record["response"]["status_code"] == response.status_code, body
                assert _stable(record["response"]["body"]) == _stable(response.json()), body
                statuses.append(response.status_code)
            metrics = (await http.get("/metrics")).text
    assert statuses == [200, 400, 400, 400, 400, 404, 400, 200, 400, 400]
    for status, count in (("200", 4), ("400", 14), ("404", 2)):  # the lines' and the POSTs'
        assert f'status="{status}"}} {count}.0' in metrics
