"""Files of `agentrt extract`: documents read lazily from JSONL, CSV or Parquet, and results
written as they finish, resumable.

Input: one `Document` per row, its id the `id_field` value (a string or an integer), else the
row's number (JSONL: the 1-based line number; CSV and Parquet: the 1-based data row). A row
that cannot be read (not JSON, no text, a text that is not a string) is a Document with an
`error` naming the row, so it becomes a failed result instead of stopping the run.

Output records: `{"id", "value", "error"}`, `error` = `{"type", "code", "message"}` or null.
- JSONL is appended and flushed per result. On resume the file is scanned; a torn last line
  (no newline, or not JSON: the process died mid-write) is cut off, and its document redone.
- CSV and Parquet cannot be appended a row at a time (Parquet has a footer; a CSV field may
  span lines), so results go to a JSONL journal beside the output (`OUTPUT.partial.jsonl`),
  which `close()` merges into the output file (written to a temporary file, then renamed).
  A run killed before `close()` leaves the journal; `--resume` reads it and the output.
  Columns: `id` (text), the values, then `error_type`, `error_code`, `error_message`.
  The values are "flat" (default for an object schema): one column per top-level property,
  named `value.<name>`, typed from the schema (string, integer, number, boolean; anything
  else is JSON text); or "json": one `value` column holding the value as JSON text.

Ids compare as text (`str(id)`), so an id read back from a CSV file matches the input's.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrt.errors import InvalidRequestError, code_of
from agentrt.extract import Document, ExtractResult

FORMATS = ("jsonl", "csv", "parquet")
VALUE_COLUMNS = ("flat", "json")
ERROR_COLUMNS = ("error_type", "error_code", "error_message")
PARQUET_BATCH_ROWS = 1024


def format_of(path: str | os.PathLike[str]) -> str:
    """The file format named by the path's suffix (.jsonl/.json/.ndjson, .csv, .parquet)."""
    suffix = Path(path).suffix.lower()
    kind = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}.get(suffix)
    if kind is None and suffix in (".parquet", ".pq"):
        kind = "parquet"
    if kind is None:
        raise InvalidRequestError(
            f"{path}: unknown file type {suffix!r}: expected .jsonl, .csv or .parquet.",
            field="input",
        )
    return kind


def pyarrow_parquet():
    """`pyarrow.parquet`, or an install hint."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("Parquet files need pyarrow: pip install 'agentrt[parquet]'") from None
    return pq


def id_key(doc_id: str | int) -> str:
    return str(doc_id)


# -- input --------------------------------------------------------------------------------------


def read_documents(
    path: str | os.PathLike[str], *, text_field: str = "text", id_field: str | None = None
) -> Iterator[Document]:
    """Documents of `path` one at a time (the file is never read whole)."""
    kind = format_of(path)
    if kind == "jsonl":
        return _read_jsonl(Path(path), text_field, id_field)
    if kind == "csv":
        return _read_csv(Path(path), text_field, id_field)
    return _read_parquet(Path(path), text_field, id_field)


def count_rows(path: str | os.PathLike[str]) -> int | None:
    """Rows of the input, for a progress bar's total: exact for Parquet (its metadata) and
    JSONL (lines, blank ones included), None for CSV (a field may span lines)."""
    kind = format_of(path)
    if kind == "parquet":
        return pyarrow_parquet().ParquetFile(path).metadata.num_rows
    if kind == "csv":
        return None
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _read_jsonl(path: Path, text_field: str, id_field: str | None) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                yield _bad_row(number, f"{path}:{number}: not JSON: {exc}")
                continue
            if isinstance(item, dict):
                yield _document(item, number, f"{path}:{number}", text_field, id_field)
            elif id_field is None:
                yield _document({text_field: item}, number, f"{path}:{number}", text_field, None)
            else:
                yield _bad_row(number, f"{path}:{number}: expected an object with {id_field!r}.")


def _read_csv(path: Path, text_field: str, id_field: str | None) -> Iterator[Document]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        _check_columns(path, reader.fieldnames or [], text_field, id_field)
        for number, row in enumerate(reader, 1):
            yield _document(row, number, f"{path}: row {number}", text_field, id_field)


def _read_parquet(path: Path, text_field: str, id_field: str | None) -> Iterator[Document]:
    source = pyarrow_parquet().ParquetFile(path)
    _check_columns(path, source.schema_arrow.names, text_field, id_field)
    columns = [text_field] if id_field is None else [text_field, id_field]
    number = 0
    for batch in source.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for row in batch.to_pylist():
            number += 1
            yield _document(row, number, f"{path}: row {number}", text_field, id_field)


def _check_columns(path: Path, names: list[str], text_field: str, id_field: str | None) -> None:
    for name, flag in ((text_field, "--text-field"), (id_field, "--id-field")):
        if name is not None and name not in names:
            raise InvalidRequestError(
                f"{path}: no column {name!r} ({flag}); the columns are {names}.", field="input"
            )


def _document(
    row: dict, number: int, where: str, text_field: str, id_field: str | None
) -> Document:
    doc_id: Any = number
    if id_field is not None:
        doc_id = row.get(id_field)
        if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or doc_id == "":
            return _bad_row(number, f"{where}: {id_field!r} is {doc_id!r}, not a string or int.")
    text = row.get(text_field)
    if not isinstance(text, str):
        found = "missing" if text is None else f"of type {type(text).__name__}"
        return _bad_row(doc_id, f"{where}: {text_field!r} is {found}, expected a string.")
    return Document(doc_id, text)


def _bad_row(doc_id: str | int, message: str) -> Document:
    return Document(doc_id, None, InvalidRequestError(message, field="input"))


# -- output records -----------------------------------------------------------------------------


def result_record(result: ExtractResult) -> dict[str, Any]:
    """The JSON record of one result: {"id", "value", "error"}."""
    value = result.value
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    error = None
    if result.error is not None:
        code = code_of(result.error)
        error = {
            "type": getattr(result.error, "type_name", type(result.error).__name__),
            "code": None if code is None else str(code),
            "message": str(result.error),
        }
    return {"id": result.id, "value": value, "error": error}


@dataclass(slots=True)
class OutputState:
    """What an existing output already holds: the keys of its results, and of the failed
    ones among them. `key`: the field of a record that names its input (a batch output's
    is `custom_id`)."""

    done: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    num_torn: int = 0  # torn last lines cut off (0 or 1 a file)
    key: str = "id"

    def add(self, record: dict) -> None:
        key = id_key(record[self.key])
        self.done.add(key)
        if record.get("error") is not None:
            self.failed.add(key)
        else:
            self.failed.discard(key)


def scan_jsonl(path: Path, state: OutputState, *, repair: bool) -> None:
    """Add the records of a JSONL results file to `state`. A torn last line is cut off when
    `repair` (else only counted); a bad line elsewhere is an error: the file is not ours."""
    good_end = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            record = _parse_record(line, state.key) if line.endswith(b"\n") else None
            if record is None:
                if f.read(1):
                    raise InvalidRequestError(
                        f"{path}:{number}: not a result record; the file is not an agentrt "
                        "extract output, or was edited: fix the line or start afresh.",
                        field="output",
                    )
                state.num_torn += 1
                break
            state.add(record)
            good_end += len(line)
    if state.num_torn and repair:
        os.truncate(path, good_end)


def _parse_record(line: bytes, key: str = "id") -> dict | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or key not in record or "error" not in record:
        return None
    return record


def iter_jsonl_records(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for line in f:
            record = _parse_record(line)
            if record is not None:
                yield record


def rewrite_jsonl_without(path: Path, keys: set[str]) -> None:
    """Drop the records of `keys` from a JSONL results file (a new file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for record in iter_jsonl_records(path):
            if id_key(record["id"]) not in keys:
                out.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


class JsonlWriter:
    """Appends one record a line and flushes it: a crash loses at most the line being
    written, which the next scan cuts off."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# -- tables (CSV, Parquet) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Columns:
    """The value columns of a table output: `value.<name>` per property (flat), or `value`."""

    flat: tuple[tuple[str, str], ...] | None  # (property, JSON type or "json"), or None: json

    @classmethod
    def for_schema(cls, json_schema: dict | None, value_column: str) -> Columns:
        if value_column not in VALUE_COLUMNS:
            raise InvalidRequestError(
                f"value_column={value_column!r}: expected one of {VALUE_COLUMNS}.",
                field="value_column",
            )
        properties = (json_schema or {}).get("properties")
        if value_column == "json" or not isinstance(properties, dict) or not properties:
            return cls(None)
        scalar = ("string", "integer", "number", "boolean")
        return cls(
            tuple(
                (name, spec.get("type") if spec.get("type") in scalar else "json")
                for name, spec in properties.items()
            )
        )

    @property
    def names(self) -> list[str]:
        values = ["value"] if self.flat is None else [f"value.{name}" for name, _ in self.flat]
        return ["id", *values, *ERROR_COLUMNS]

    def row(self, record: dict) -> dict[str, Any]:
        """A record as a table row; nested values as JSON text."""
        value, error = record["value"], record["error"] or {}
        row: dict[str, Any] = {"id": id_key(record["id"])}
        if self.flat is None:
            row["value"] = None if value is None else json.dumps(value)
        else:
            for name, kind in self.flat:
                item = value.get(name) if isinstance(value, dict) else None
                row[f"value.{name}"] = (
                    json.dumps(item) if kind == "json" and item is not None else item
                )
        row["error_type"] = error.get("type")
        row["error_code"] = error.get("code")
        row["error_message"] = error.get("message")
        return row

    def arrow_schema(self):
        import pyarrow as pa

        types = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64()}
        types |= {"boolean": pa.bool_(), "json": pa.string()}
        values = (
            [("value", pa.string())]
            if self.flat is None
            else [(f"value.{name}", types[kind]) for name, kind in self.flat]
        )
        return pa.schema(
            [("id", pa.string()), *values, *((name, pa.string()) for name in ERROR_COLUMNS)]
        )


def table_records(path: Path, kind: str) -> Iterator[dict]:
    """The id and error of every row of a CSV or Parquet results file (for resuming)."""
    for row in _table_rows(path, kind, ["id", "error_code", "error_type", "error_message"]):
        error = None if not row.get("error_type") else {"code": row.get("error_code")}
        yield {"id": row["id"], "error": error}


def _table_rows(path: Path, kind: str, columns: list[str] | None = None) -> Iterator[dict]:
    if kind == "csv":  # an empty CSV field is a null
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                yield {name: item or None for name, item in row.items()}
        return
    for batch in (
        pyarrow_parquet().ParquetFile(path).iter_batches(PARQUET_BATCH_ROWS, columns=columns)
    ):
        yield from batch.to_pylist()


def write_table(
    path: Path, kind: str, columns: Columns, old_rows: Iterable[dict], records: Iterable[dict]
) -> None:
    """Write `old_rows` (table rows) then `records` (JSON records) to `path`, through a
    temporary file renamed over it, streaming in batches."""
    tmp = path.with_name(path.name + ".tmp")
    rows = _chain_rows(columns, old_rows, records)
    if kind == "csv":
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns.names, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa

        pq = pyarrow_parquet()
        schema = columns.arrow_schema()
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[dict] = []
            for row in rows:
                batch.append(row)
                if len(batch) == PARQUET_BATCH_ROWS:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    os.replace(tmp, path)


def _chain_rows(columns: Columns, old_rows: Iterable[dict], records: Iterable[dict]):
    for row in old_rows:
        yield {name: row.get(name) for name in columns.names}
    for record in records:
        yield columns.row(record)


# -- the output of one run ----------------------------------------------------------------------


class ResultSink:
    """Where one run's results go (see the module docstring for each format). Opening reads
    what the output already holds (`state`); `write` makes a result durable at once (an
    appended, flushed JSONL line); `close` leaves the output complete and readable."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        columns: Columns,
        resume: bool = False,
        retry_failed: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        self.kind = format_of(path)
        self.columns = columns
        # JSONL is its own journal; a table output has one beside it.
        self.journal = (
            self.path
            if self.kind == "jsonl"
            else self.path.with_name(self.path.name + ".partial.jsonl")
        )
        self.state = OutputState()
        existing = [p for p in {self.path, self.journal} if p.exists() and p.stat().st_size]
        if existing and not (resume or retry_failed or overwrite):
            raise InvalidRequestError(
                f"{existing[0]} exists: pass --resume to continue it, --retry-failed to redo "
                "its failures, or --overwrite to start afresh.",
                field="output",
            )
        if overwrite and not (resume or retry_failed):
            for p in existing:
                p.unlink()
        else:
            self._load(retry_failed)
        self._writer = JsonlWriter(self.journal)

    def _load(self, retry_failed: bool) -> None:
        if self.kind != "jsonl" and self.path.exists():
            for record in table_records(self.path, self.kind):
                self.state.add(record)
        if self.journal.exists():
            scan_jsonl(self.journal, self.state, repair=True)
        if retry_failed and self.state.failed:
            # The failures leave the journal now (their redone results are appended); a
            # table's are replaced at close by the journal's newer records of the same ids.
            if self.journal.exists():
                rewrite_jsonl_without(self.journal, self.state.failed)
            self.state.done -= self.state.failed

    def write(self, result: ExtractResult) -> None:
        self._writer.write(result_record(result))

    def close(self) -> None:
        """Flush; a table output is rewritten with the journal merged in (a journal record
        replaces the table's row of the same id), and the journal removed."""
        self._writer.close()
        if self.kind == "jsonl":
            return
        new_keys = {id_key(r["id"]) for r in iter_jsonl_records(self.journal)}
        old_rows: Iterable[dict] = ()
        if self.path.exists():
            old_rows = (
                row
                for row in _table_rows(self.path, self.kind)
                if id_key(row["id"]) not in new_keys
            )
        write_table(self.path, self.kind, self.columns, old_rows, iter_jsonl_records(self.journal))
        self.journal.unlink()
