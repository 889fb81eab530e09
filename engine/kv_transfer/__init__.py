"""KV connectors: KV blocks moved between an engine's pool and storage or another instance
(base.py has the interface and the request flow)."""

from __future__ import annotations

from agentrt.engine.config import KVTransferConfig
from agentrt.engine.kv_transfer.base import KVConnector, KVLayout, engine_id


def create_connector(config: KVTransferConfig, layout: KVLayout) -> KVConnector:
    """The connector `config.connector` names."""
    if config.connector == "storage":
        from agentrt.engine.kv_transfer.storage import StorageConnector

        return StorageConnector(config, layout)
    from agentrt.engine.kv_transfer.p2p import P2PConnector

    return P2PConnector(config, layout)


__all__ = ["KVConnector", "KVLayout", "create_connector", "engine_id"]
