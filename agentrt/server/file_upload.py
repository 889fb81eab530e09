"""The multipart body of `POST /v1/files`, streamed into the file store as it arrives.

The body is parsed chunk by chunk (python-multipart's push parser, which Starlette's form
parser is built on) and the `file` part's bytes go straight into a `PendingUpload` in the
store's directory: nothing of the file is held in memory or spooled elsewhere, and the caps
(`--max-file-bytes`, the room left under `--max-storage-bytes`) are enforced while it
streams, so a body past them is refused (413) when the cap is passed, not once it has all
arrived, and what was written is removed. The form's other fields (`purpose`) are small and
bounded; so are the number of parts and the whole body. A file's lines are checked from the
stored file when a batch is created (agentrt.server.batch_job.validate), never here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header

from agentrt.server.errors import APIError, bad_request
from agentrt.server.file_store import FileStore, PendingUpload, check_purpose

MAX_FIELD_BYTES = 1024  # a form field beside the file ("purpose")
MAX_PARTS = 4
MULTIPART_SLACK = 64 * 1024  # the body's bytes beyond the file: boundaries, headers, fields


async def receive_upload(request: Request, files: FileStore, owner: str | None) -> dict[str, Any]:
    """Store the `file` part of the request's multipart body (with `purpose=batch`); its
    file object. 400 for a malformed form, 413 past a cap."""
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise bad_request("send the upload as multipart/form-data with a 'file' part.", "file")
    form = _FormEvents(boundary)
    pending: PendingUpload | None = None
    filename, fields = "upload.jsonl", {}
    part: dict[str, Any] | None = None  # the part being read: name, is_file
    num_parts = num_body_bytes = 0
    try:
        async for chunk in request.stream():
            num_body_bytes += len(chunk)
            file_data = []  # this chunk's bytes of the file, written in one thread call
            for kind, value in form.feed(chunk):
                if kind == "part":
                    num_parts += 1
                    if num_parts > MAX_PARTS:
                        raise bad_request(f"the form has more than {MAX_PARTS} parts.", "file")
                    part = value
                    if part["is_file"]:
                        if part["name"] != "file" or pending is not None:
                            raise bad_request(
                                "send one file, as the multipart field 'file'.", "file"
                            )
                        pending = await anyio.to_thread.run_sync(files.begin_upload)
                        filename = Path(part["filename"] or filename).name or filename
                    else:
                        fields[part["name"]] = b""
                elif kind == "data" and part is not None and part["is_file"]:
                    file_data.append(value)
                elif kind == "data" and part is not None:
                    fields[part["name"]] += value
                    if len(fields[part["name"]]) > MAX_FIELD_BYTES:
                        raise bad_request(
                            f"the form field {part['name']!r} is longer than {MAX_FIELD_BYTES} "
                            "bytes.",
                            part["name"],
                        )
            if file_data:
                await anyio.to_thread.run_sync(pending.write, b"".join(file_data))
            num_file_bytes = 0 if pending is None else pending.num_bytes
            if num_body_bytes - num_file_bytes > MULTIPART_SLACK:  # the body beside the file
                raise _body_too_large()
        if not form.ended:
            raise bad_request("the multipart body ended before its closing boundary.", "file")
        if pending is None:
            raise bad_request("send the file as the multipart field 'file'.", "file")
        if "purpose" not in fields:
            raise bad_request("send the multipart field 'purpose' ('batch').", "purpose")
        check_purpose(fields["purpose"].decode("utf-8", "replace"))
        return await anyio.to_thread.run_sync(pending.commit, owner, "batch", filename)
    finally:
        if pending is not None:
            await anyio.to_thread.run_sync(pending.discard)


class _FormEvents:
    """python-multipart's callbacks collected as events per fed chunk: ("part", {name,
    filename, is_file}) once a part's headers are read, then ("data", bytes)..."""

    def __init__(self, boundary: bytes) -> None:
        self.events: list[tuple[str, Any]] = []
        self.ended = False
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        callbacks = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_end": self._end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    def feed(self, chunk: bytes) -> list[tuple[str, Any]]:
        self.events = []
        try:
            self._parser.write(chunk)
        except Exception as exc:  # python-multipart's MultipartParseError and kin
            raise bad_request(f"the multipart body is malformed: {exc}", "file") from None
        return self.events

    def _part_begin(self) -> None:
        self._headers = {}

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        filename = options.get(b"filename")
        name = options.get(b"name", b"").decode("utf-8", "replace")
        self.events.append(
            (
                "part",
                {
                    "name": name,
                    "filename": None if filename is None else filename.decode("utf-8", "replace"),
                    "is_file": filename is not None,
                },
            )
        )

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        self.events.append(("data", bytes(data[start:end])))

    def _end(self) -> None:
        self.ended = True


def _body_too_large() -> APIError:
    return APIError(
        413,
        f"the multipart body holds more than {MULTIPART_SLACK} bytes beside the file: send "
        "the file and its 'purpose' alone.",
        code="request_too_large",
    )
