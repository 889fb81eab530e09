"""KV connectors: KV blocks moved between an engine's pool and storage or another instance
(base.py has the interface and the request flow). Each is a scheduler side, one per engine,
and a worker side, one per tensor-parallel rank."""

from __future__ import annotations

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.core.kv_cache_manager import KVCacheManager
from agentrt.engine.kv_transfer.base import (
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLayout,
    KVTransferResult,
    engine_id,
)


def create_connector_worker(config: KVTransferConfig, layout: KVLayout) -> KVConnectorWorker:
    """The worker side of the connector `config.connector` names, for the rank of `layout`."""
    if config.connector == "storage":
        from agentrt.engine.kv_transfer.storage import StorageWorker

        return StorageWorker(config, layout)
    from agentrt.engine.kv_transfer.p2p_worker import P2PWorker

    return P2PWorker(config, layout)


def create_connector_scheduler(
    config: KVTransferConfig, layout: KVLayout, kv: KVCacheManager, worker: KVConnectorWorker
) -> KVConnectorScheduler:
    """The scheduler side of the connector `config.connector` names; `layout` is rank 0's,
    `worker` rank 0's worker side (a p2p producer's params name the port it serves on)."""
    if config.connector == "storage":
        from agentrt.engine.kv_transfer.storage import StorageScheduler

        return StorageScheduler(config, layout, kv)
    from agentrt.engine.kv_transfer.p2p import P2PScheduler

    return P2PScheduler(config, layout, kv, port=getattr(worker, "port", None))


__all__ = [
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVLayout",
    "KVTransferResult",
    "create_connector_scheduler",
    "create_connector_worker",
    "engine_id",
]
