"""The GGUF container: metadata values and the tensor table, read straight from the file.

gguf-py's `GGUFReader` builds a numpy view for every part of every metadata value: for a
49k-token vocabulary that is ~4M memmap slices, ~2 s here (10+ s on a loaded machine),
paid on every load and twice more inside transformers' GGUF config read. This reader walks
the header once with `struct` on a read-only `mmap` (strings as bytes slices, numeric arrays
through `np.frombuffer`) and maps the tensor data copy-on-write, so reading a tensor touches
only the pages read and nothing is written back. A long string array (the vocabulary and the
merges: 300k strings for Qwen's 152k vocabulary, ~0.3 s and ~20 MiB as Python strings) is
only stepped over: `LazyStrings` decodes it on first use, which a load whose tokenizer is
cached never makes.

`index()` is the parse as a small JSON-able record (the scalar fields, where each long array
lies, the tensor table), which the metadata cache keeps beside the config (gguf_file.py):
`GGUFContainer(path, index)` then skips the walk (Qwen's 152k vocabulary: ~300k strings
stepped over, 0.06 s of CPU at every start; from the index 0.01 s) after checking that the
file still has that header (its first bytes, size, and the first tensor's name where the
table was found).

Layout (GGUF v2/v3, little-endian): magic `GGUF`, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 value type and the value (strings: u64
length + UTF-8 bytes; arrays: element type u32, count u64, elements); each tensor entry a
name, u32 dims, u64 dims (ne0, the elements of a row, first), u32 GGML type, u64 offset
into the data section, which starts at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from agentrt.engine.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types with a fixed width: struct format per type.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})
_NUMPY_SIZES = {element: np.dtype(dtype).itemsize for element, dtype in _NUMPY.items()}
_STRING, _ARRAY = 8, 9

# GGML types stored as plain values, and their numpy dtype (BF16 as its raw 16 bits).
_DENSE = {0: np.float32, 1: np.float16, 30: np.uint16}
# String arrays at least this long are decoded on first use (LazyStrings); an index
# (GGUFContainer.index) locates arrays this long instead of holding their values.
LAZY_STRINGS = 1024
INDEX_VERSION = 1


class LazyStrings(Sequence):
    """A metadata string array decoded on first use (indexing, iteration, len, ==), from
    the file it was found in. Reads the file again then: raises `ModelLoadError` if it
    changed size since."""

    def __init__(self, path: Path, size: int, start: int, count: int) -> None:
        self._path, self._size, self._start, self._count = path, size, start, count
        self._values: list[str] | None = None

    def _decoded(self) -> list[str]:
        if self._values is None:
            with self._path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if len(m) != self._size:
                    raise ModelLoadError(f"{self._path} changed while it was in use")
                values, pos = [], self._start
                for _ in range(self._count):
                    (length,) = struct.unpack_from("<Q", m, pos)
                    values.append(m[pos + 8 : pos + 8 + length].decode("utf-8"))
                    pos += 8 + length
            self._values = values
        return self._values

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):  # int -> str, slice -> list[str]
        return self._decoded()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyStrings):
            other = other._decoded()
        return isinstance(other, list) and self._decoded() == other

    __hash__ = None  # a mutable-looking sequence, like list

    def __repr__(self) -> str:
        return f"LazyStrings({self._count} strings at byte {self._start} of {self._path.name})"


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file. `shape` in GGUF order (ne0, the elements of a row, first);
    `data` a copy-on-write view of the file: (rows, row bytes) uint8 for a block type,
    (rows, ne0) of its dtype for F32 / F16 / BF16 (BF16 as uint16)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return prod(self.shape)


class GGUFContainer:
    """A parsed GGUF file: `fields` (metadata key -> value: int, float, bool, str, or a list
    of them), `tensors` in file order, and `data`, the whole file memory-mapped
    copy-on-write (the tensors' views point into it)."""

    def __init__(self, path: str | os.PathLike[str], index: dict | None = None) -> None:
        """Parses the file's header, or takes `index` (an earlier `index()` of this file)
        for it when the file still matches it (else parses)."""
        self.path = Path(path)
        try:
            with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                header = _Header(m, self.path)
                self.version = header.version
                if index is not None and _matches(index, header):
                    self._index = index
                    self.fields = _indexed_fields(index["fields"], m, self.path)
                    table = [(n, tuple(s), q, o) for n, s, q, o in index["tensors"]]
                    data_start = index["data_start"]
                else:
                    self._index = None
                    self.fields = header.read_fields()
                    table_pos = header.pos
                    table = header.read_tensor_table()
                    alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
                    data_start = -(-header.pos // alignment) * alignment
                    self._walked = (header.head(), len(m), header.refs, table_pos)
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.data = np.memmap(self.path, mode="c", dtype=np.uint8)
        self._table, self._data_start = table, data_start
        self.tensors = [self._tensor(data_start, *entry) for entry in table]

    def index(self) -> dict:
        """This parse as a JSON-able record for `GGUFContainer(path, index)`: scalar fields
        by value, arrays of LAZY_STRINGS or more elements by place, the tensor table."""
        if self._index is not None:
            return self._index
        head, size, refs, table_pos = self._walked
        fields = {}
        for key, value in self.fields.items():
            fields[key] = {"at": refs[key]} if key in refs else value
        return {
            "version": INDEX_VERSION,
            "head": head,
            "size": size,
            "table_pos": table_pos,
            "data_start": self._data_start,
            "fields": fields,
            "tensors": [list(entry) for entry in self._table],
        }

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int
    ) -> GGUFTensor:
        # Imported here: the kernels package imports torch, which a config read (a cache
        # hit of checkpoint.resolve_model) does without.
        from agentrt.kernels.ggml_types import BLOCK_SIZES, GGMLType

        start = data_start + offset
        row = shape[0] if shape else 1
        rows = prod(shape[1:])
        if qtype in _DENSE:
            dtype = np.dtype(_DENSE[qtype])
            n_bytes = row * rows * dtype.itemsize
            data = self._span(name, start, n_bytes).view(dtype).reshape(rows, row)
        else:
            try:
                elems, size = BLOCK_SIZES[GGMLType(qtype)]
            except (ValueError, KeyError) as exc:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has unknown GGML type {qtype}."
                ) from exc
            if row % elems:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has rows of {row} elements, not a multiple "
                    f"of its type's block of {elems}."
                )
            n_bytes = row // elems * size * rows
            data = self._span(name, start, n_bytes).reshape(rows, row // elems * size)
        if len(shape) == 1:
            data = data.reshape(-1)
        return GGUFTensor(name, shape, qtype, start, n_bytes, data)

    def _span(self, name: str, start: int, n_bytes: int) -> np.ndarray:
        if start + n_bytes > self.data.size:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)."
            )
        return self.data[start : start + n_bytes]


class _Header:
    """A cursor over the header bytes."""

    def __init__(self, m: mmap.mmap, path: Path) -> None:
        self.m = m
        self.path = path
        if m[:4] != MAGIC:
            raise ValueError("it does not start with the GGUF magic bytes")
        self.version, self.tensor_count, self.field_count = struct.unpack_from("<IQQ", m, 4)
        if self.version not in VERSIONS:
            raise ValueError(f"GGUF version {self.version} (supported: 2 and 3)")
        self.pos = 24
        # key -> where a long array's elements lie: ["strings", start, count] or
        # ["array", element type, start, count] (`read_fields` fills it).
        self.refs: dict[str, list] = {}

    def head(self) -> list[int]:
        return [self.version, self.tensor_count, self.field_count]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.m, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        start = self.pos
        self.pos += length
        return self.m[start : self.pos].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"metadata value type {kind} at byte {self.pos}")
        element, count = struct.unpack_from("<IQ", self.m, self.pos)
        self.pos += 12
        if element in _NUMPY:
            values = _numeric_array(self.m, element, self.pos, count)
            self.pos += count * _NUMPY_SIZES[element]
            return values
        if element == _STRING and count >= LAZY_STRINGS:
            start = self.pos
            for _ in range(count):  # step over: lengths only
                self.pos += 8 + struct.unpack_from("<Q", self.m, self.pos)[0]
            if self.pos > len(self.m):
                raise ValueError(f"a string array runs past the end of the file at {start}")
            return LazyStrings(self.path, len(self.m), start, count)
        if element == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(element) for _ in range(count)]  # nested arrays

    def read_fields(self) -> dict[str, Any]:
        fields = {}
        for _ in range(self.field_count):
            key = self._string()
            kind = self._unpack("<I")
            if kind == _ARRAY:
                element, count = struct.unpack_from("<IQ", self.m, self.pos)
                start = self.pos + 12
                if count >= LAZY_STRINGS and element == _STRING:
                    self.refs[key] = ["strings", start, count]
                elif count >= LAZY_STRINGS and element in _NUMPY:
                    self.refs[key] = ["array", element, start, count]
            fields[key] = self._value(kind)
        return fields

    def read_tensor_table(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        table = []
        for _ in range(self.tensor_count):
            name = self._string()
            dims = struct.unpack_from(f"<{self._unpack('<I')}Q", self.m, self.pos)
            self.pos += 8 * len(dims)
            qtype, offset = struct.unpack_from("<IQ", self.m, self.pos)
            self.pos += 12
            table.append((name, tuple(int(d) for d in dims), int(qtype), int(offset)))
        return table


def _numeric_array(m: mmap.mmap, element: int, pos: int, count: int) -> list:
    return np.frombuffer(m, np.dtype(_NUMPY[element]), count, pos).tolist()


def _matches(index: dict, header: _Header) -> bool:
    """Whether `index` describes the file `header` reads: same index format, size and head
    (version and counts), and the first tensor's name where the tensor table began."""
    if index.get("version") != INDEX_VERSION or index["size"] != len(header.m):
        return False
    if index["head"] != header.head():
        return False
    if not index["tensors"]:
        return True
    start, header.pos = header.pos, index["table_pos"]
    try:
        return header._string() == index["tensors"][0][0]
    except (struct.error, UnicodeDecodeError):
        return False
    finally:
        header.pos = start


def _indexed_fields(indexed: dict[str, Any], m: mmap.mmap, path: Path) -> dict[str, Any]:
    """An index's fields with its long arrays in place: string arrays as LazyStrings,
    numeric arrays read now (a few ms for a 152k vocabulary's token types)."""
    fields = {}
    for key, value in indexed.items():
        if isinstance(value, dict):
            ref = value["at"]
            if ref[0] == "strings":
                value = LazyStrings(path, len(m), ref[1], ref[2])
            else:
                value = _numeric_array(m, ref[1], ref[2], ref[3])
        fields[key] = value
    return fields
