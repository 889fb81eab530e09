"""Compile caches: a bounded in-memory LRU (by bytes) and an optional on-disk cache.

Memory: key -> Grammar, evicting least recently used entries once their summed
`memory_bytes` exceeds `max_bytes`. Disk: key -> the routing decision (backend, the exact
schema/grammar text handed to it, the report), so a restart skips normalization, routing
and failed backend attempts. Keys include the spec and the tokenizer fingerprint.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class GrammarCache:
    """Thread-safe LRU bounded by total bytes. `get` refreshes recency."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: str, value: Any, num_bytes: int) -> None:
        if num_bytes > self.max_bytes:
            return  # larger than the whole cache: never cached
        with self._lock:
            if key in self._items:
                self._bytes -= self._items.pop(key)[1]
            self._items[key] = (value, num_bytes)
            self._bytes += num_bytes
            while self._bytes > self.max_bytes:
                _, (_, size) = self._items.popitem(last=False)
                self._bytes -= size


@dataclass(frozen=True, slots=True)
class RoutedSource:
    """What the disk cache stores: how a spec was compiled last time."""

    backend: str
    kind: str  # "json" | "regex" | "lark" | "gbnf"
    source: str
    report: list[list[Any]]
    gate_eos: bool


class DiskCache:
    """One JSON file per key under `directory`; writes are atomic (rename)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> RoutedSource | None:
        path = self.dir / f"{key}.json"
        try:
            data = json.loads(path.read_text())
            return RoutedSource(**data)
        except (OSError, ValueError, TypeError):
            return None

    def put(self, key: str, routed: RoutedSource) -> None:
        path = self.dir / f"{key}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        payload = {
            "backend": routed.backend,
            "kind": routed.kind,
            "source": routed.source,
            "report": routed.report,
            "gate_eos": routed.gate_eos,
        }
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)
