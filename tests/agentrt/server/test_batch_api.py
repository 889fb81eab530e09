"""The OpenAI Files and Batch APIs against a real `agentrt serve` on the embedded model,
driven by the official `openai` client: upload, batch, output and error files, validation,
caps, cancel, and a SIGKILL mid-batch resumed by a restart with no line lost or run twice."""

from __future__ import annotations

import io
import json
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.agentrt.server.helpers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
KEY = "batch-key-a"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Accra"]


def serve_args(state_dir: Path, key: str = KEY, *extra: str) -> list[str]:
    return [
        "--state-dir",
        str(state_dir),
        "--api-key",
        key,
        "--kv-cache-memory-gb",
        "0.25",
        "--max-batch-concurrency",
        "4",
        "--max-file-bytes",
        "200000",
        *extra,
    ]


def chat_line(custom_id: str, city: str, max_tokens: int = 16, model: str = MODEL) -> dict:
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": "Reply with the city of the sentence as JSON."},
            {"role": "user", "content": f"I flew to {city} last week."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def client_for(server: ServerProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory, smollm2_dir):
    with ServerProcess(*serve_args(tmp_path_factory.mktemp("state"))) as server:
        yield server


@pytest.fixture(scope="module")
def client(batch_server) -> openai.OpenAI:
    return client_for(batch_server)


def test_file_round_trip(client: openai.OpenAI) -> None:
    data = jsonl([chat_line("x", "Paris")])
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(data), "in.jsonl", "batch")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(uploaded.id).content == data
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):  # an id that is a path names no file
        client.files.retrieve("..%2F..%2Fetc%2Fpasswd")


def test_upload_limits(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 300_000)), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"


def test_batch_completes_with_output_and_error_files(client: openai.OpenAI) -> None:
    lines = [chat_line(f"req-{i}", city) for i, city in enumerate(CITIES[:5])]
    lines.append(chat_line("wrong-model", "Rome", model="no-such-model"))
    source = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    created = client.batches.create(
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "cities"},
    )
    assert created.status == "validating" and created.metadata == {"job": "cities"}
    batch = wait_for(client, created.id, {"completed", "failed"})
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    outputs = output_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == [f"req-{i}" for i in range(5)]
    for line in outputs:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        completion = openai.types.chat.ChatCompletion.model_validate(line["response"]["body"])
        assert isinstance(json.loads(completion.choices[0].message.content)["city"], str)
    (failed,) = output_lines(client, batch.error_file_id)
    assert failed["custom_id"] == "wrong-model"
    assert failed["response"]["status_code"] == 404
    assert failed["response"]["body"]["error"]["code"] == "model_not_found"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"

    listed = client.batches.list(limit=100)
    assert created.id in [b.id for b in listed.data]


def test_invalid_input_file_fails_the_batch(client: openai.OpenAI) -> None:
    lines = [chat_line("a", "Oslo"), chat_line("a", "Lima")]  # a repeated custom_id
    data = jsonl(lines) + b"not json\n"
    data += json.dumps({**chat_line("b", "Rome"), "url": "/v1/embeddings"}).encode() + b"\n"
    source = client.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    created = client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for(client, created.id, {"failed", "completed"})
    assert batch.status == "failed" and batch.output_file_id is None
    errors = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert errors == [
        (2, "duplicate_custom_id", "custom_id"),
        (3, "invalid_request", None),
        (4, "invalid_request", "url"),
    ]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-" + "0" * 32, endpoint="/v1/responses", completion_window="24h"
        )


def test_cancel_keeps_the_lines_finished(client: openai.OpenAI) -> None:
    lines = [chat_line(f"c-{i}", CITIES[i % 8], max_tokens=24) for i in range(48)]
    source = client.files.create(file=("many.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    created = client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, created.id, {"in_progress"})
    deadline = time.monotonic() + 120
    while client.batches.retrieve(created.id).request_counts.completed < 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert client.batches.cancel(created.id).status in ("cancelling", "cancelled")
    batch = wait_for(client, created.id, {"cancelled"})
    outputs = output_lines(client, batch.output_file_id)
    assert 4 <= len(outputs) < 48
    assert len(outputs) == batch.request_counts.completed
    assert len({o["custom_id"] for o in outputs}) == len(outputs)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_a_completed_batch(client))


def _a_completed_batch(client: openai.OpenAI) -> str:
    return next(b.id for b in client.batches.list(limit=100).data if b.status == "completed")


def test_sigkill_mid_batch_resumes_without_loss_or_duplicates(tmp_path, smollm2_dir) -> None:
    """SIGKILL while the batch runs (a few lines journaled), a torn last line added as a
    kill mid-write leaves it, then a restart on the same --state-dir: the batch finishes
    with every custom_id exactly once, and the lines journaled before the kill are kept as
    they were (not run again). A server with another key then sees none of it."""
    lines = [chat_line(f"k-{i}", CITIES[i % 8]) for i in range(40)]
    with ServerProcess(*serve_args(tmp_path)) as server:
        client = client_for(server)
        source = client.files.create(file=("k.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch_id = client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        journal = tmp_path / "batches" / f"{batch_id}.jsonl"
        deadline = time.monotonic() + 180
        while not journal.exists() or journal.read_bytes().count(b"\n") < 6:
            assert time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.05)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    before = [json.loads(line) for line in journal.read_bytes().splitlines()]
    assert 6 <= len(before) < 40
    with journal.open("ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "batch_req_torn", "custom_id": "k-39", "resp')

    with ServerProcess(*serve_args(tmp_path)) as server:
        client = client_for(server)
        batch = wait_for(client, batch_id, {"completed", "failed"})
        assert batch.status == "completed", batch.errors
        assert batch.request_counts.model_dump() == {"total": 40, "completed": 40, "failed": 0}
        outputs = output_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"k-{i}" for i in range(40))
        by_id = {o["custom_id"]: o for o in outputs}
        assert all(by_id[record["custom_id"]] == record for record in before)
        assert not journal.exists()

    other = "batch-key-b"
    with ServerProcess(*serve_args(tmp_path, other)) as server:
        client = client_for(server, other)
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(batch.output_file_id)
        assert client.files.list().data == [] and client.batches.list().data == []
