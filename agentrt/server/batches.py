"""Batches of `/v1/batches`: their records on disk, and the task that runs each one.

A batch lives in `ROOT/batches/<id>.json` (the OpenAI batch object and its owner) and, while
it runs, `<id>.jsonl` (the journal of finished lines, see agentrt.server.batch_job). Its
life: validating (the input file checked whole) -> in_progress -> finalizing (the journal
split into the output file, 2xx lines, and the error file, the others) -> completed; or
failed (a bad input file, the storage cap), or cancelling -> cancelled (the lines finished
so far in the output files), or expired.

Expiry is OpenAI's: a batch must end within its `completion_window` ("24h", the only value
OpenAI accepts; `--batch-completion-windows` may allow others). When `expires_at` comes and
it has not reached finalizing, its lines in flight are aborted, no other one runs, and it
ends `expired`: the lines finished stay in the output and error files, and each line that
never ran is added to the error file with the code `batch_expired` (and counted failed).

A restart resumes every batch that had not ended, or expires it when its window has passed
meanwhile: the journal tells which lines are done, so none is lost or run twice. Finalizing
(and expiring) is repeatable (the output files' ids are derived from the batch id), so a
crash inside it is redone on the next start.

Lines run as requests of the batch's owner (its API key, sent in-process); a batch whose key
the server no longer has waits until it has it again, or until its window ends: it expires at
its `expires_at` like any other.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from agentrt.extract_io import JsonlWriter, iter_jsonl_records
from agentrt.server.batch_job import (
    ENDPOINTS,
    AppDispatcher,
    BatchLine,
    LineError,
    ServerUnavailable,
    iter_lines,
    load_journal,
    run_lines,
    succeeded,
    validate,
)
from agentrt.server.batch_options import COMPLETION_WINDOWS, window_seconds
from agentrt.server.errors import APIError, bad_request
from agentrt.server.file_store import (
    FileStore,
    not_found,
    owner_of,
    read_json,
    valid_id,
    write_json,
)

logger = logging.getLogger("agentrt.server")

ENDED = frozenset({"completed", "failed", "cancelled", "expired"})
_CAP_CHECK_LINES = 64  # lines between checks of the storage cap while a batch runs
_EXPIRED = "This request could not be executed before the completion window expired."


class BatchManager:
    """Creates, lists, cancels and runs batches. `start` (in the app's lifespan) resumes the
    unfinished ones; `app` is where lines are sent, `api_key` the server's key.
    `completion_windows`: the `completion_window` values accepted."""

    def __init__(
        self,
        files: FileStore,
        max_concurrency: int,
        completion_windows: tuple[str, ...] = COMPLETION_WINDOWS,
    ) -> None:
        self.files = files
        self.completion_windows = completion_windows
        self.dir = files.root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._limiter = anyio.Semaphore(max_concurrency)  # shared by every batch
        self._live: dict[str, dict[str, Any]] = {}  # running batches: the current object
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._app = None
        self._api_key: str | None = None
        self._should_stop = lambda: False

    async def start(self, tg: anyio.abc.TaskGroup, app, api_key: str | None, should_stop) -> None:
        self._tg, self._app, self._api_key, self._should_stop = tg, app, api_key, should_stop
        unfinished = [b for b in self._stored() if b["status"] not in ENDED]
        for batch in sorted(unfinished, key=lambda b: b["created_at"]):
            self._launch(batch)
        for batch in self._stored():  # a crash between the last save and the journal removal
            if batch["status"] in ENDED:
                self._journal(batch["id"]).unlink(missing_ok=True)

    # -- the API ------------------------------------------------------------------------------

    def create(
        self,
        owner: str | None,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint {endpoint!r} is not one of {list(ENDPOINTS)}.", "endpoint")
        if completion_window not in self.completion_windows:
            supported = ", ".join(repr(w) for w in self.completion_windows)
            raise bad_request(
                f"Invalid value for 'completion_window': {completion_window!r}. Supported "
                f"values are: {supported}.",
                "completion_window",
                "invalid_value",
            )
        if self.files.get(owner, input_file_id)["purpose"] != "batch":
            raise bad_request(f"file {input_file_id!r} is not a batch input file.", "input_file_id")
        self.files.check_room()
        created = int(time.time())
        batch = {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": created,
            "in_progress_at": None,
            "expires_at": created + window_seconds(completion_window),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "owner": owner,
        }
        self._save(batch)
        self._launch(batch)
        return _public(batch)

    def get(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        return _public(self._owned(owner, batch_id))

    def list(self, owner: str | None, after: str | None, limit: int) -> dict[str, Any]:
        """OpenAI's page: newest first, those after the batch `after`."""
        batches = [b for b in self._stored() if b["owner"] == owner]
        batches.sort(key=lambda b: (b["created_at"], b["id"]), reverse=True)
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = [_public(b) for b in batches[:limit]]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(batches) > limit,
        }

    def cancel(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        batch = self._owned(owner, batch_id)
        if batch["status"] in ENDED or batch["status"] in ("cancelling", "finalizing"):
            if batch["status"] not in ("cancelled", "cancelling"):
                raise APIError(
                    409,
                    f"batch {batch_id!r} is {batch['status']}: it cannot be cancelled.",
                    code="batch_not_cancellable",
                )
            return _public(batch)
        batch |= {"status": "cancelling", "cancelling_at": int(time.time())}
        self._save(batch)
        scope = self._scopes.get(batch_id)
        if scope is not None:
            scope.cancel()  # the run finalizes it as cancelled
        elif batch_id not in self._live:
            self._launch(batch)
        return _public(batch)

    # -- running ------------------------------------------------------------------------------

    def _launch(self, batch: dict[str, Any]) -> None:
        if self._tg is None:
            return  # not started yet: `start` launches it
        if batch["owner"] != owner_of(self._api_key) and not _past_window(batch):
            logger.warning("batch %s waits: its API key is not this server's", batch["id"])
            self._tg.start_soon(self._expire_when_due, batch)
            return
        self._live[batch["id"]] = batch
        self._tg.start_soon(self._run, batch)

    async def _expire_when_due(self, batch: dict[str, Any]) -> None:
        """Launch a waiting batch (its key is not this server's) once its window has ended
        by the wall clock, as `_run` reads it: it expires then."""
        while (left := batch["expires_at"] - time.time()) > 0:
            await anyio.sleep(left)
        self._launch(batch)

    async def _run(self, batch: dict[str, Any]) -> None:
        try:
            out_of_time = False
            if batch["status"] == "validating" and not _past_window(batch):
                await self._validate(batch)
            if batch["status"] == "in_progress" and not _past_window(batch):
                out_of_time = await self._run_lines(batch)
            unended = batch["status"] in ("validating", "in_progress")
            if unended and (out_of_time or _past_window(batch)):
                await anyio.to_thread.run_sync(self._finalize, batch)  # it expires
            if batch["status"] in ("finalizing", "cancelling"):
                await anyio.to_thread.run_sync(self._finalize, batch)
        except OSError as exc:  # its input file deleted, the disk full: this batch fails
            logger.error("batch %s failed: %s", batch["id"], exc)
            batch |= {"status": "failed", "failed_at": int(time.time())}
            error = LineError(None, f"the batch could not run: {exc.strerror or exc}")
            batch["errors"] = {"object": "list", "data": [error.to_dict()]}
            self._save(batch)
        finally:
            self._live.pop(batch["id"], None)

    async def _validate(self, batch: dict[str, Any]) -> None:
        path = self.files.data_path(batch["input_file_id"])
        total, errors = await anyio.to_thread.run_sync(validate, path, batch["endpoint"])
        now = int(time.time())
        batch["request_counts"]["total"] = total
        if batch["status"] == "cancelling":
            return  # cancelled while validating
        if errors:
            batch |= {"status": "failed", "failed_at": now}
            batch["errors"] = {"object": "list", "data": [e.to_dict() for e in errors]}
        else:
            batch |= {"status": "in_progress", "in_progress_at": now}
        self._save(batch)

    async def _run_lines(self, batch: dict[str, Any]) -> bool:
        """Run the lines not journaled yet; True when its window ended them (the batch is
        left in_progress for `_run` to expire)."""
        journal_path = self._journal(batch["id"])
        state = await anyio.to_thread.run_sync(load_journal, journal_path)
        counts = batch["request_counts"]
        counts["failed"] = len(state.failed)
        counts["completed"] = len(state.done) - len(state.failed)
        writer = JsonlWriter(journal_path)
        dispatcher = AppDispatcher(self._app, self._api_key)
        full = False

        def on_record(record: dict[str, Any]) -> None:
            nonlocal full
            writer.write(record)
            counts["completed" if succeeded(record) else "failed"] += 1
            if sum(counts.values()) % _CAP_CHECK_LINES == 0:
                full = self.files.used_bytes() > self.files.max_storage_bytes

        lines = iter_lines(
            self.files.data_path(batch["input_file_id"]), batch["endpoint"], state.done
        )

        out_of_time = False

        def stop() -> bool:
            nonlocal out_of_time
            out_of_time = out_of_time or _past_window(batch)
            return full or batch["status"] == "cancelling" or self._should_stop() or out_of_time

        # At `expires_at` the lines in flight are aborted (none is journaled): `_run` expires it.
        deadline = anyio.current_time() + batch["expires_at"] - time.time()
        scope = self._scopes[batch["id"]] = anyio.CancelScope(deadline=deadline)
        try:
            with scope:
                await run_lines(dispatcher, lines, self._limiter, on_record, stop)
        except ServerUnavailable:
            return False  # left in_progress: resumed (or expired) on the next start
        finally:
            del self._scopes[batch["id"]]
            writer.close()
        now = int(time.time())
        if full:
            batch |= {"status": "failed", "failed_at": now}
            message = (
                f"the server's file storage passed its cap ({self.files.max_storage_bytes} bytes)"
            )
            error = LineError(None, message, "storage_limit_exceeded")
            batch["errors"] = {"object": "list", "data": [error.to_dict()]}
        elif batch["status"] != "cancelling" and (scope.cancelled_caught or out_of_time):
            return True  # past its window
        elif self._should_stop():
            return False  # the server is stopping: resumed on the next start
        elif batch["status"] != "cancelling":
            batch |= {"status": "finalizing", "finalizing_at": now}
        self._save(batch)
        return False

    def _finalize(self, batch: dict[str, Any]) -> None:
        """Split the journal into the output and error files, then end the batch (a batch
        still validating or in_progress expires: its lines never run join the error file)."""
        journal = self._journal(batch["id"])
        expiring = batch["status"] in ("validating", "in_progress")
        parts = {
            "output": self.dir / f"{batch['id']}.output.tmp",
            "error": self.dir / f"{batch['id']}.error.tmp",
        }
        counts = {"output": 0, "error": 0}
        writers = {name: JsonlWriter(path) for name, path in parts.items()}
        done: set[str] = set()
        try:
            if journal.exists():
                for record in iter_jsonl_records(journal):
                    name = "output" if succeeded(record) else "error"
                    writers[name].write(record)
                    counts[name] += 1
                    done.add(record["custom_id"])
            if expiring:
                for line in self._unfinished(batch, done):
                    writers["error"].write(_expired(line))
                    counts["error"] += 1
        finally:
            for writer in writers.values():
                writer.close()
        for name, path in parts.items():
            if counts[name]:
                file_id = f"file-{uuid.uuid5(uuid.NAMESPACE_URL, batch['id'] + '/' + name).hex}"
                filename = f"{batch['id']}_{name}.jsonl"
                self.files.add(batch["owner"], "batch_output", filename, path, file_id=file_id)
                batch[f"{name}_file_id"] = file_id
            else:
                path.unlink(missing_ok=True)
        now = int(time.time())
        if expiring:
            batch |= {"status": "expired", "expired_at": now}
            batch["request_counts"] = {
                "total": counts["output"] + counts["error"],
                "completed": counts["output"],
                "failed": counts["error"],
            }
        elif batch["status"] == "cancelling":
            batch |= {"status": "cancelled", "cancelled_at": now}
        else:
            batch |= {"status": "completed", "completed_at": now}
        self._save(batch)
        journal.unlink(missing_ok=True)

    def _unfinished(self, batch: dict[str, Any], done: set[str]) -> list[BatchLine]:
        """The lines of an expiring batch that never ran (each custom_id once: the file of
        a batch expired while validating was not checked)."""
        path = self.files.data_path(batch["input_file_id"])
        if not path.exists():
            return []  # its input file was deleted: only the journal is left to report
        unfinished: dict[str, BatchLine] = {}
        for line in iter_lines(path, batch["endpoint"], done):
            unfinished.setdefault(line.custom_id, line)
        return list(unfinished.values())

    # -- storage ------------------------------------------------------------------------------

    def _journal(self, batch_id: str) -> Path:
        return self.dir / f"{batch_id}.jsonl"

    def _save(self, batch: dict[str, Any]) -> None:
        write_json(self.dir / f"{batch['id']}.json", batch)

    def _stored(self) -> list[dict[str, Any]]:
        found = []
        for path in self.dir.glob("*.json"):
            batch = self._live.get(path.stem) or read_json(path)
            if batch is not None:
                found.append(batch)
        return found

    def _owned(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        batch = self._live.get(batch_id)
        if batch is None and valid_id(batch_id.replace("_", "-", 1)):
            batch = read_json(self.dir / f"{batch_id}.json")
        if batch is None or batch["owner"] != owner:
            raise not_found("batch", batch_id)
        return batch


def _public(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "owner"}


def _past_window(batch: dict[str, Any]) -> bool:
    return time.time() >= batch["expires_at"]


def _expired(line: BatchLine) -> dict[str, Any]:
    """The error-file record of a line that never ran (OpenAI's)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": _EXPIRED},
    }
