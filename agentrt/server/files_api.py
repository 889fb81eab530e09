"""`/v1/files` (OpenAI's Files API, for batch input and output files): upload (multipart,
`purpose=batch`, streamed to disk: agentrt.server.file_upload), list, retrieve, content,
delete. Storage and owners: agentrt.server.file_store.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from agentrt.server.batch_options import BatchConfig
from agentrt.server.file_store import FileStore, owner_of
from agentrt.server.file_upload import receive_upload
from agentrt.server.middleware import request_api_key

FILES_PATH = "/v1/files"


class StateDir:
    """The directory files and batches live in: `config.state_dir`, or a temporary one that
    `close` removes."""

    def __init__(self, config: BatchConfig) -> None:
        self._tmp = None if config.state_dir else tempfile.mkdtemp(prefix="agentrt-state-")
        self.path = Path(config.state_dir or self._tmp)

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def request_owner(request: Request, api_key: str | None) -> str | None:
    """Whose files a request may see: its key's when the server has one (the guard has
    checked it), else everyone's (None)."""
    return None if api_key is None else owner_of(request_api_key(request.headers))


def add_file_routes(app: FastAPI, files: FileStore, api_key: str | None) -> None:
    @app.post(FILES_PATH)
    async def upload(request: Request) -> dict:
        return await receive_upload(request, files, request_owner(request, api_key))

    @app.get(FILES_PATH)
    async def list_files(request: Request, purpose: str | None = None) -> dict:
        owner = request_owner(request, api_key)
        found = await anyio.to_thread.run_sync(files.list, owner, purpose)
        return {"object": "list", "data": found, "has_more": False}

    @app.get(FILES_PATH + "/{file_id}")
    async def retrieve(file_id: str, request: Request) -> dict:
        return files.get(request_owner(request, api_key), file_id)

    @app.get(FILES_PATH + "/{file_id}/content")
    async def content(file_id: str, request: Request) -> StreamingResponse:
        files.get(request_owner(request, api_key), file_id)
        return StreamingResponse(files.read_chunks(file_id), media_type="application/octet-stream")

    @app.delete(FILES_PATH + "/{file_id}")
    async def delete(file_id: str, request: Request) -> dict:
        return files.delete(request_owner(request, api_key), file_id)
