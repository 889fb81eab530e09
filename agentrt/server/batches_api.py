"""`/v1/batches` (OpenAI's Batch API): create, retrieve, list, cancel. The batches run in
the server (agentrt.server.batches) on its own routes."""

from __future__ import annotations

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel

from agentrt.server.batches import BatchManager
from agentrt.server.files_api import request_owner


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def add_batch_routes(app: FastAPI, batches: BatchManager, api_key: str | None) -> None:
    @app.post("/v1/batches")
    async def create(body: CreateBatchRequest, request: Request) -> dict:
        return batches.create(
            request_owner(request, api_key),
            body.input_file_id,
            body.endpoint,
            body.completion_window,
            body.metadata,
        )

    @app.get("/v1/batches")
    async def list_batches(
        request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> dict:
        return batches.list(request_owner(request, api_key), after, limit)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> dict:
        return batches.get(request_owner(request, api_key), batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict:
        return batches.cancel(request_owner(request, api_key), batch_id)
