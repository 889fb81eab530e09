"""The tensor-parallel rendezvous store listens on loopback only, unless a multi-machine
rendezvous address is given (DESIGN.md, Security: every listening socket is loopback unless
configured otherwise)."""

from __future__ import annotations

from pathlib import Path

from agentrt.engine.worker.distributed import connect_store


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as the kernel lists them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def test_the_local_store_listens_on_loopback_only():
    store = connect_store(0, 1, "127.0.0.1", 0, 5.0)
    store.set("config", b"{}")
    assert listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, no 0.0.0.0 or ::
    client = connect_store(1, 1, "127.0.0.1", store.port, 5.0)
    assert client.get("config") == b"{}"
