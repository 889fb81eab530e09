"""Files of the Files API on disk: `ROOT/files/<id>.data` (the bytes) and `<id>.json` (the
OpenAI file object, plus its owner). Both are written to a temporary name and renamed, the
data first, so a file whose metadata exists is whole.

Owners: with an API key configured, a file belongs to the key that uploaded it (stored as
a SHA-256 of the key, never the key) and is invisible to any other (404, as for a file that
does not exist). Without a key everything is one owner, None.

The store is bounded by `max_storage_bytes` over everything under ROOT (batch journals and
outputs included): `check_room` raises a 413 when a write of that size would pass it.
Methods are plain blocking file operations; the routes call them off the event loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from agentrt.server.errors import APIError
from agentrt.server.responses import new_id

PURPOSES = ("batch", "batch_output")
_CHUNK = 1 << 20


def owner_of(api_key: str | None) -> str | None:
    """The owner id of a request that sent `api_key` (None: no key configured)."""
    return None if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No {kind} with id {object_id!r}.", param="id", code="not_found")


class FileStore:
    def __init__(self, root: Path, *, max_file_bytes: int, max_storage_bytes: int) -> None:
        self.root = root
        self.files = root / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        self.max_storage_bytes = max_storage_bytes

    # -- writing ------------------------------------------------------------------------------

    def upload(
        self, owner: str | None, purpose: str, filename: str, source: BinaryIO
    ) -> dict[str, Any]:
        """Copy `source` into a new file; 413 past `max_file_bytes` or the storage cap."""
        check_purpose(purpose)
        pending = self.begin_upload()
        try:
            while chunk := source.read(_CHUNK):
                pending.write(chunk)
            return pending.commit(owner, purpose, filename)
        finally:
            pending.discard()

    def begin_upload(self) -> PendingUpload:
        """A new file being written (under a temporary name in the store, so the bytes go
        straight to disk): `write` its chunks, then `commit` it or `discard` it."""
        room = min(self.max_file_bytes, self.max_storage_bytes - self.used_bytes())
        return PendingUpload(self, new_id("file"), room)

    def add(
        self,
        owner: str | None,
        purpose: str,
        filename: str,
        data: Path,
        *,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Make the file at `data` (moved, not copied) a stored file; its object."""
        file_id = file_id or new_id("file")
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": data.stat().st_size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        os.replace(data, self.data_path(file_id))
        write_json(self.files / f"{file_id}.json", {**obj, "owner": owner})
        return obj

    def delete(self, owner: str | None, file_id: str) -> dict[str, Any]:
        self.get(owner, file_id)
        (self.files / f"{file_id}.json").unlink()
        self.data_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- reading ------------------------------------------------------------------------------

    def get(self, owner: str | None, file_id: str) -> dict[str, Any]:
        """The file object; 404 when there is none or it is another owner's."""
        meta = read_json(self.files / f"{file_id}.json") if valid_id(file_id) else None
        if meta is None or meta.pop("owner") != owner:
            raise not_found("file", file_id)
        return meta

    def list(self, owner: str | None, purpose: str | None = None) -> list[dict[str, Any]]:
        """The owner's files, newest first."""
        found = []
        for path in self.files.glob("*.json"):
            meta = read_json(path)
            if meta is not None and meta.pop("owner") == owner:
                if purpose is None or meta["purpose"] == purpose:
                    found.append(meta)
        return sorted(found, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def data_path(self, file_id: str) -> Path:
        return self.files / f"{file_id}.data"

    def read_chunks(self, file_id: str) -> Iterator[bytes]:
        with open(self.data_path(file_id), "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk

    # -- the cap ------------------------------------------------------------------------------

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def check_room(self, num_bytes: int = 0) -> None:
        """413 when the state directory holds more than the cap (after `num_bytes` more)."""
        used = self.used_bytes() + num_bytes
        if used > self.max_storage_bytes:
            raise APIError(
                413,
                f"the server's file storage is full ({used} of {self.max_storage_bytes} bytes, "
                "--max-storage-bytes): delete files (DELETE /v1/files/{id}) and retry.",
                code="storage_limit_exceeded",
            )

    def _too_large(self, num_bytes: int) -> APIError:
        if num_bytes > self.max_file_bytes:
            return APIError(
                413,
                f"the file is larger than {self.max_file_bytes} bytes (--max-file-bytes): split "
                "it into smaller batches.",
                param="file",
                code="file_too_large",
            )
        return APIError(
            413,
            f"the server's file storage would pass its cap of {self.max_storage_bytes} bytes "
            "(--max-storage-bytes): delete files (DELETE /v1/files/{id}) and retry.",
            code="storage_limit_exceeded",
        )


def check_purpose(purpose: str) -> None:
    if purpose != "batch":
        raise APIError(
            400,
            f"purpose={purpose!r} is not supported: this server stores files for the Batch "
            "API only (purpose 'batch').",
            param="purpose",
        )


class PendingUpload:
    """One upload on its way to disk, `ROOT/files/<id>.data.tmp`: at most `room` bytes
    (`write` raises the 413 past it, having written nothing more). Until `commit` it is no
    file of the store; `discard` removes what was written (a no-op once committed)."""

    def __init__(self, store: FileStore, file_id: str, room: int) -> None:
        self.store = store
        self.file_id = file_id
        self.room = room
        self.num_bytes = 0
        self.path = store.files / f"{file_id}.data.tmp"
        self._out: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 (closed by commit/discard)

    def write(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        if self.num_bytes > self.room:
            raise self.store._too_large(self.num_bytes)
        self._out.write(chunk)

    def commit(self, owner: str | None, purpose: str, filename: str) -> dict[str, Any]:
        """Make it a stored file: its object."""
        self._out.close()
        self._out = None
        return self.store.add(owner, purpose, filename, self.path, file_id=self.file_id)

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        self.path.unlink(missing_ok=True)


def valid_id(object_id: str) -> bool:
    """Ids are ours (`prefix-<hex>`): anything else, a path above all, names no file."""
    prefix, _, rest = object_id.partition("-")
    return prefix.isalpha() and len(rest) == 32 and all(c in "0123456789abcdef" for c in rest)


def write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
