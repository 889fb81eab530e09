"""The OpenAI Files and Batch APIs against a real `agentrt serve` on the embedded model,
driven by the official `openai` client: upload, batch, output and error files, validation,
caps, cancel (a server in the test's process, on the session's fp32 engine), and a SIGKILL
mid-batch resumed by a restart with no line lost or run twice (`agentrt serve` processes)."""

from __future__ import annotations

import io
import json
import signal
import time
import tracemalloc
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import openai
import pytest
from openai.types.chat import ChatCompletion

from agentrt.server.batch_options import BatchConfig
from agentrt.server.state import ServerConfig
from tests.agentrt.server.helpers import ServerProcess, in_process_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "batch-key-a"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Accra"]


def serve_args(state_dir: Path) -> list[str]:
    return [
        "--state-dir",
        str(state_dir),
        "--api-key",
        KEY,
        "--kv-cache-memory-gb",
        "0.25",
        "--max-batch-concurrency",
        "4",
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


def sync_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def batch_server(state_dir: Path, llm, key: str = KEY, windows: tuple[str, ...] = ("24h",)):
    """`agentrt serve` in-process on the embedded model (fp32), with a small file cap and
    batches run 4 lines at a time; yields an AsyncOpenAI client with `key`."""
    batch = BatchConfig(
        state_dir=str(state_dir),
        max_file_bytes=200_000,
        max_concurrency=4,
        completion_windows=windows,
    )
    config = ServerConfig(api_key=key, batch=batch)
    async with in_process_server(config, llm.engine) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120
        )
        try:
            yield client
        finally:
            await client.close()
            server.stop()


async def wait_for(client, batch_id: str, statuses: set[str], timeout_s: float = 240):
    with anyio.fail_after(timeout_s):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            await anyio.sleep(0.1)


async def output_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def upload(client, lines: list[dict] | bytes, name: str = "in.jsonl"):
    data = lines if isinstance(lines, bytes) else jsonl(lines)
    return await client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


async def start_batch(client, lines: list[dict], window: str = "24h") -> str:
    """Upload `lines` and create a chat-completions batch of them: its id."""
    source = await upload(client, lines)
    created = await client.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window=window
    )
    return created.id


async def wait_completed(client, batch_id: str, count: int) -> None:
    """Until at least `count` of the batch's lines are done (at most 120 s)."""
    with anyio.fail_after(120):
        while (await client.batches.retrieve(batch_id)).request_counts.completed < count:
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_file_round_trip_and_limits(tmp_path, smollm2_llm) -> None:
    data = jsonl([chat_line("x", "Paris")])
    async with batch_server(tmp_path, smollm2_llm) as client:
        uploaded = await upload(client, data)
        assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (
            len(data),
            "in.jsonl",
            "batch",
        )
        assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
        assert uploaded.id in [f.id for f in (await client.files.list(purpose="batch")).data]
        assert (await client.files.content(uploaded.id)).content == data
        assert (await client.files.delete(uploaded.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):  # a path names no file
            await client.files.retrieve("..%2F..%2Fetc%2Fpasswd")

        with pytest.raises(openai.APIStatusError) as too_large:
            await upload(client, b"x" * 300_000)
        assert too_large.value.status_code == 413
        with pytest.raises(openai.BadRequestError) as purpose:
            await client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        assert purpose.value.body["param"] == "purpose"


class _Body(io.RawIOBase):
    """`size` bytes of JSONL, made as they are read (nothing held), counting what was read."""

    def __init__(self, size: int) -> None:
        self.size, self.num_read = size, 0
        self.line = json.dumps(chat_line("x", "Paris")).encode() + b"\n"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.num_read)
        start = self.num_read % len(self.line)
        repeated = (self.line * (n // len(self.line) + 2))[start : start + n]
        buffer[:n] = repeated
        self.num_read += n
        return n


@pytest.mark.anyio
async def test_a_big_upload_streams_to_disk_within_the_caps(tmp_path, smollm2_llm) -> None:
    """A 64 MB upload through the openai client: the server's memory does not grow with it
    (its bytes go to the state dir as they arrive: tracemalloc's peak over the whole upload,
    client and server in this process, stays a small fraction of it) and the stored file is
    the bytes sent. Past --max-file-bytes the upload is a 413 and no partial file is left."""
    size = 64 * 2**20
    config = ServerConfig(
        api_key=KEY, batch=BatchConfig(state_dir=str(tmp_path), max_file_bytes=100 * 2**20)
    )
    async with in_process_server(config, smollm2_llm.engine) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        tracemalloc.start()
        try:
            uploaded = await client.files.create(file=("big.jsonl", _Body(size)), purpose="batch")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.close()
            server.stop()
    assert uploaded.bytes == size
    print(f"upload peak {peak / 2**20:.1f} MiB")
    assert peak < size / 8, f"peak {peak / 2**20:.1f} MiB during a {size / 2**20:.0f} MiB upload"
    stored = (tmp_path / "files" / f"{uploaded.id}.data").open("rb")
    expected = _Body(size)
    with stored:
        while chunk := stored.read(2**20):
            assert chunk == expected.read(len(chunk))

    async with batch_server(tmp_path, smollm2_llm) as client:  # max_file_bytes=200_000
        body = _Body(50 * 2**20)
        with pytest.raises(openai.APIStatusError) as too_large:
            await client.files.create(file=("big.jsonl", body), purpose="batch")
        assert too_large.value.status_code == 413
        assert too_large.value.body["code"] == "file_too_large"
        assert [p.name for p in (tmp_path / "files").glob("*.tmp")] == []
        assert [f.id for f in (await client.files.list()).data] == [uploaded.id]


@pytest.mark.anyio
async def test_batch_completes_with_output_and_error_files(tmp_path, smollm2_llm) -> None:
    lines = [chat_line(f"req-{i}", city) for i, city in enumerate(CITIES[:5])]
    lines.append(chat_line("wrong-model", "Rome", model="no-such-model"))
    async with batch_server(tmp_path, smollm2_llm) as client:
        source = await upload(client, lines)
        created = await client.batches.create(
            input_file_id=source.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "cities"},
        )
        assert created.status == "validating" and created.metadata == {"job": "cities"}
        batch = await wait_for(client, created.id, {"completed", "failed"})
        assert batch.status == "completed", batch.errors
        assert batch.request_counts.model_dump() == {"total": 6, "completed": 5, "failed": 1}
        assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

        outputs = await output_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == [f"req-{i}" for i in range(5)]
        for line in outputs:
            assert line["id"].startswith("batch_req_") and line["error"] is None
            assert line["response"]["status_code"] == 200
            completion = ChatCompletion.model_validate(line["response"]["body"])
            assert isinstance(json.loads(completion.choices[0].message.content)["city"], str)
        (failed,) = await output_lines(client, batch.error_file_id)
        assert failed["custom_id"] == "wrong-model"
        assert failed["response"]["status_code"] == 404
        assert failed["response"]["body"]["error"]["code"] == "model_not_found"
        assert (await client.files.retrieve(batch.output_file_id)).purpose == "batch_output"
        listed = await client.batches.list(limit=100)
        assert [b.id for b in listed.data] == [created.id]
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(created.id)


@pytest.mark.anyio
async def test_invalid_input_file_fails_the_batch(tmp_path, smollm2_llm) -> None:
    data = jsonl([chat_line("a", "Oslo"), chat_line("a", "Lima")])  # a repeated custom_id
    data += b"not json\n"
    data += json.dumps({**chat_line("b", "Rome"), "url": "/v1/embeddings"}).encode() + b"\n"
    async with batch_server(tmp_path, smollm2_llm) as client:
        source = await upload(client, data)
        created = await client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await wait_for(client, created.id, {"failed", "completed"})
        assert batch.status == "failed" and batch.output_file_id is None
        errors = [(e.line, e.code, e.param) for e in batch.errors.data]
        assert errors == [
            (2, "duplicate_custom_id", "custom_id"),
            (3, "invalid_request", None),
            (4, "invalid_request", "url"),
        ]
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(
                input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(
                input_file_id="file-" + "0" * 32, endpoint="/v1/responses", completion_window="24h"
            )


@pytest.mark.anyio
async def test_cancel_keeps_the_lines_finished(tmp_path, smollm2_llm) -> None:
    lines = [chat_line(f"c-{i}", CITIES[i % 8], max_tokens=24) for i in range(48)]
    async with batch_server(tmp_path, smollm2_llm) as client:
        batch_id = await start_batch(client, lines)
        await wait_completed(client, batch_id, 4)
        assert (await client.batches.cancel(batch_id)).status in ("cancelling", "cancelled")
        batch = await wait_for(client, batch_id, {"cancelled"})
        outputs = await output_lines(client, batch.output_file_id)
        assert 4 <= len(outputs) < 48
        assert len(outputs) == batch.request_counts.completed
        assert len({o["custom_id"] for o in outputs}) == len(outputs)


@pytest.mark.anyio
async def test_drain_leaves_the_batch_to_the_next_start(tmp_path, smollm2_llm) -> None:
    """A drain (SIGTERM) stops admitting lines and lets those in flight finish; the batch
    stays in_progress on disk and the next server on the state dir finishes it."""
    lines = [chat_line(f"d-{i}", CITIES[i % 8]) for i in range(12)]
    async with batch_server(tmp_path, smollm2_llm) as client:
        batch_id = await start_batch(client, lines)
        await wait_completed(client, batch_id, 4)
    stored = json.loads((tmp_path / "batches" / f"{batch_id}.json").read_text())
    assert stored["status"] == "in_progress"
    journaled = (tmp_path / "batches" / f"{batch_id}.jsonl").read_text().splitlines()
    assert 4 <= len(journaled) < 12

    async with batch_server(tmp_path, smollm2_llm) as client:
        batch = await wait_for(client, batch_id, {"completed", "failed"})
        assert batch.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
        outputs = await output_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"d-{i}" for i in range(12))


def _check_expired(batch, outputs: list[dict], errors: list[dict], custom_ids: list[str]):
    """An expired batch's files: every line once, in the output file (it ran, 2xx) or in
    the error file (the lines that never ran, as `batch_expired`), and counts that add up."""
    assert batch.status == "expired" and batch.expired_at >= batch.expires_at
    assert batch.completed_at is None and batch.finalizing_at is None
    ran = [o["custom_id"] for o in outputs]
    never_ran = [e["custom_id"] for e in errors]
    assert sorted(ran + never_ran) == sorted(custom_ids)
    for error in errors:
        assert error["response"] is None and error["id"].startswith("batch_req_")
        assert error["error"]["code"] == "batch_expired"
    counts = batch.request_counts.model_dump()
    assert counts == {"total": len(custom_ids), "completed": len(ran), "failed": len(never_ran)}


@pytest.mark.anyio
async def test_a_batch_not_done_by_its_window_expires(tmp_path, smollm2_llm) -> None:
    """`completion_window` is honoured: "24h" (OpenAI's) and what the server allows
    (--batch-completion-windows) are accepted, anything else is a 400 in OpenAI's shape. A
    batch whose window passes mid-run ends `expired`: its lines in flight are aborted, no
    other one runs, the finished ones are in the output file and the rest in the error file
    as `batch_expired`."""
    # 64 lines of 64 free-text tokens, 4 at a time: over 10 s on an idle machine.
    lines = [chat_line(f"e-{i}", CITIES[i % 8], max_tokens=64) for i in range(64)]
    for line in lines:
        line["body"].pop("response_format")
        line["body"]["messages"][-1]["content"] += " Tell me all about the trip."
    async with batch_server(tmp_path, smollm2_llm, windows=("24h", "3s")) as client:
        source = await upload(client, lines)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.batches.create(
                input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="1h"
            )
        assert refused.value.body["param"] == "completion_window"
        assert refused.value.body["code"] == "invalid_value"
        assert refused.value.body["type"] == "invalid_request_error"
        assert "'24h', '3s'" in refused.value.body["message"]
        created = await client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="3s"
        )
        assert created.expires_at == created.created_at + 3
        batch = await wait_for(client, created.id, {"expired", "completed", "failed"}, 60)
        outputs = await output_lines(client, batch.output_file_id)
        errors = await output_lines(client, batch.error_file_id)
        _check_expired(batch, outputs, errors, [line["custom_id"] for line in lines])
        assert errors, "all 64 lines ran within 3 s: the window was not exercised"
        assert not (tmp_path / "batches" / f"{created.id}.jsonl").exists()
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(created.id)
        await anyio.sleep(1)  # nothing of it runs any more
        assert (await client.batches.retrieve(created.id)) == batch
        day = await client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert day.expires_at == day.created_at + 24 * 3600
        await client.batches.cancel(day.id)


@pytest.mark.anyio
async def test_a_window_passed_while_the_server_was_down_expires_the_batch(
    tmp_path, smollm2_llm
) -> None:
    """A batch drained mid-run, its window passed before the next start: the next server on
    the state dir expires it instead of resuming it (no line runs again); the lines
    journaled before stay in the output file exactly as they were."""
    lines = [chat_line(f"w-{i}", CITIES[i % 8]) for i in range(12)]
    async with batch_server(tmp_path, smollm2_llm) as client:
        batch_id = await start_batch(client, lines)
        await wait_completed(client, batch_id, 4)
    journal = tmp_path / "batches" / f"{batch_id}.jsonl"
    before = [json.loads(line) for line in journal.read_text().splitlines()]
    assert 4 <= len(before) < 12
    stored_path = tmp_path / "batches" / f"{batch_id}.json"
    stored = json.loads(stored_path.read_text())
    assert stored["status"] == "in_progress"
    stored["expires_at"] = int(time.time()) - 1  # as if a day had passed
    stored_path.write_text(json.dumps(stored))

    async with batch_server(tmp_path, smollm2_llm) as client:
        batch = await wait_for(client, batch_id, {"expired", "completed", "failed"}, 60)
        outputs = await output_lines(client, batch.output_file_id)
        errors = await output_lines(client, batch.error_file_id)
        _check_expired(batch, outputs, errors, [line["custom_id"] for line in lines])
        assert outputs == before  # kept as they were, none run again
        assert not journal.exists()


@pytest.mark.anyio
async def test_a_batch_of_another_key_expires_at_its_window_while_the_server_runs(
    tmp_path, smollm2_llm
) -> None:
    """A batch left unfinished by a server with key A waits on a server with key B (its lines
    need A's key), yet its window ends at its `expires_at` while B runs, not at B's next
    start: it is expired then, and no line ran on B."""
    lines = [chat_line(f"o-{i}", CITIES[i % 8]) for i in range(48)]
    async with batch_server(tmp_path, smollm2_llm) as client:
        batch_id = await start_batch(client, lines)  # then drained at once
    stored_path = tmp_path / "batches" / f"{batch_id}.json"
    stored = json.loads(stored_path.read_text())
    assert stored["status"] in ("validating", "in_progress")
    stored["expires_at"] = int(time.time()) + 3
    stored_path.write_text(json.dumps(stored))
    journal = tmp_path / "batches" / f"{batch_id}.jsonl"
    num_before = len(journal.read_bytes().splitlines()) if journal.exists() else 0

    async with batch_server(tmp_path, smollm2_llm, key="batch-key-b"):
        assert time.time() < stored["expires_at"], "B started after the window: not exercised"
        assert json.loads(stored_path.read_text())["status"] == stored["status"]  # it waits
        with anyio.fail_after(30):
            while (batch := json.loads(stored_path.read_text()))["status"] != "expired":
                await anyio.sleep(0.1)
    assert batch["expired_at"] >= batch["expires_at"]
    counts = {"total": 48, "completed": num_before, "failed": 48 - num_before}
    assert batch["request_counts"] == counts  # the lines A finished, none more
    assert not journal.exists()


@pytest.mark.slow  # two `agentrt serve` processes load the model
@pytest.mark.anyio
async def test_sigkill_mid_batch_resumes_without_loss_or_duplicates(tmp_path, smollm2_llm) -> None:
    """`agentrt serve` (a subprocess) SIGKILLed while the batch runs (a few lines
    journaled), a torn last line added as a kill mid-write leaves it, then a restart on the
    same --state-dir: the batch finishes with every custom_id exactly once, and the lines
    journaled before the kill are kept as they were (not run again). A server with another
    key then sees none of it."""
    lines = [chat_line(f"k-{i}", CITIES[i % 8]) for i in range(24)]
    with ServerProcess(*serve_args(tmp_path)) as server:
        client = sync_client(server)
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
    assert 6 <= len(before) < 24
    with journal.open("ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "batch_req_torn", "custom_id": "k-23", "resp')

    with ServerProcess(*serve_args(tmp_path)) as server:
        client = sync_client(server)
        deadline = time.monotonic() + 240
        while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
        assert batch.status == "completed", batch.errors
        assert batch.request_counts.model_dump() == {"total": 24, "completed": 24, "failed": 0}
        content = client.files.content(batch.output_file_id).text
        outputs = [json.loads(line) for line in content.splitlines()]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"k-{i}" for i in range(24))
        by_id = {o["custom_id"]: o for o in outputs}
        assert all(by_id[record["custom_id"]] == record for record in before)
        assert not journal.exists()

    async with batch_server(tmp_path, smollm2_llm, key="batch-key-b") as client:
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve(batch_id)
        with pytest.raises(openai.NotFoundError):
            await client.files.content(batch.output_file_id)
        assert (await client.files.list()).data == []
        assert (await client.batches.list()).data == []
