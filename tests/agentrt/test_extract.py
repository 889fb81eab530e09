"""Batch extraction: results in input order, per-item errors returned (not raised), the
shared instruction served from the prefix cache, and the `agentrt extract` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from agentrt import SchemaError, TruncatedOutputError
from agentrt.extract import ExtractResult
from agentrt.extract_io import result_record

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


class Contact(BaseModel):
    name: str = Field(max_length=30)
    email: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)


DOCS = [
    "Reach Alice Martin at alice@example.com; she is 34.",
    "Bob Stone (bob.stone@mail.org), aged 51, called yesterday.",
    "Carol Diaz, 27 years old, email carol.d@site.net.",
    "Contact: Dan Wu <dan@wu.io>, 45.",
    "Eve Adams is 38 and uses eve@adams.dev.",
]
INSTRUCTIONS = (
    "You extract the contact person of a message: full name, email address and age. "
    "Reply with JSON only. " * 4
)


async def test_results_are_in_input_order_and_valid(rt):
    before = await rt.stats()
    results = await rt.extract_many(
        DOCS, Contact, instructions=INSTRUCTIONS, concurrency=3, progress=False
    )
    assert [r.index for r in results] == list(range(len(DOCS)))
    assert all(r.ok and isinstance(r.value, Contact) for r in results), results
    assert all(r.usage.completion_tokens > 0 for r in results)
    # The first name in each document comes back for that document (input order kept).
    for doc, result in zip(DOCS, results, strict=True):
        assert result.value.name.split()[0] in doc
    # The shared instruction (several blocks) is prefilled once: every document hits it.
    after = await rt.stats()
    instruction_blocks = len(INSTRUCTIONS) // 4 // 16  # at least this many full blocks
    hit = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    assert all(r.usage.cached_tokens >= 16 * instruction_blocks for r in results)
    assert hit >= len(DOCS) * 16 * instruction_blocks


async def test_item_failures_are_returned_not_raised(rt):
    results = await rt.extract_many(
        DOCS[:3] + [""], Contact, instructions=INSTRUCTIONS, progress=False, max_tokens=4
    )
    assert all(not r.ok for r in results)
    assert all(isinstance(r.error, TruncatedOutputError) for r in results[:3])
    assert results[3].error is not None  # an empty document is a bad request, for it alone
    with pytest.raises(SchemaError):
        await rt.extract_many(DOCS, 42, instructions="x", progress=False)
    assert await rt.extract_many([], Contact, instructions="x") == []


@pytest.mark.slow
def test_extract_command(tmp_path: Path, smollm2_dir):
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join([json.dumps({"text": DOCS[0]}), json.dumps(DOCS[1]), "", json.dumps(DOCS[2])])
    )
    output = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "agentrt",
        "extract",
        "--schema",
        "tests.agentrt.test_extract:Contact",
        "--input",
        str(source),
        "--output",
        str(output),
        "--quiet",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == [1, 2, 4]  # ids: the line numbers
    assert all(line["error"] is None for line in lines)
    for line in lines:
        Contact.model_validate(line["value"])
    assert "3/3 extracted" in result.stderr


def test_extract_command_reports_a_schema_it_cannot_load(tmp_path: Path, capsys):
    """In this process (test_extract_command runs the command): a process would spend ~2.4 s
    of CPU importing torch before the schema is looked for."""
    from agentrt.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": DOCS[0]}))
    argv = ["extract", "--schema", "no.such.module:Model", "--input", str(source)]
    assert main([*argv, "--output", str(tmp_path / "out.jsonl"), "--quiet"]) == 2
    assert "cannot load the schema" in capsys.readouterr().err


def test_result_records_carry_the_error_code():
    first, second = (
        result_record(result)
        for result in [
            ExtractResult(0, value=Contact(name="Ann", email="a@b.c", age=30)),
            ExtractResult(1, id="x", error=TruncatedOutputError("cut short", text="{")),
        ]
    )
    assert first["id"] == 0 and first["error"] is None and first["value"]["name"] == "Ann"
    assert second["id"] == "x"
    assert second["error"] == {
        "type": "TruncatedOutputError",
        "code": "structured_output_failed",
        "message": "cut short",
    }
