"""Benchmark workloads, generated locally and deterministically from a seed.

- `random`: a prompt of about `input_len` tokens drawn from a fixed word list (one common
  English word is about one token), and exactly `output_len` output tokens (`ignore_eos`).
- `shared-prefix`: agent sessions: one long system prompt shared by every request (about
  three quarters of `input_len`) and a short per-request user turn; `output_len` tokens.
- `extraction`: JSON-schema extraction: a schema picked from a directory of maskbench-style
  files (`{"schema": ..., "tests": [{"valid": true, "data": ...}]}`) and a short document
  built from one of its valid examples; the request carries the schema as its constraint.
- `tool-calls`: the model is shown a few tools and must reply with one call, constrained by
  the JSON schema of a call (`{"name": <one of the tools>, "arguments": <its parameters>}`).

Structured requests end when the object is complete (no `ignore_eos`); `output_len` caps
them. The same `BenchRequest` list is sent in-process and over HTTP.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrt.bench.errors import BenchConfigError

DATASETS = ("random", "shared-prefix", "extraction", "tool-calls")
STRUCTURED_DATASETS = ("extraction", "tool-calls")

# The maskbench schemas of this checkout's shared data (absent from an installed package:
# then pass schema_dir, or the built-in schemas below are used).
DEFAULT_SCHEMA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "maskbench"
# Small schemas keep a structured reply within a few dozen tokens.
MAX_SCHEMA_CHARS = 400
# Schema families whose objects are short, flat and compile quickly.
SCHEMA_PREFIXES = ("Github_easy", "BFCL_simple")

WORDS = (
    "the time people way year day thing man world life hand part child eye woman place work "
    "week case point number group problem fact house water room money story month lot book "
    "job word night business home issue side kind head service friend power hour game line "
    "end member law car city name team minute idea body back parent face level office door "
    "health person art history party result change morning reason research girl guy moment "
    "air teacher force order model report plan system data market price cost risk owner"
).split()

AGENT_SYSTEM = (
    "You are an operations agent for a logistics company. You read tickets from customers, "
    "look up orders, plan deliveries and write short, precise answers. Always name the order, "
    "the warehouse and the next step. Never promise a date the plan does not support. "
)
TASKS = (
    "Where is my order and when will it arrive?",
    "The parcel arrived damaged: what are my options?",
    "Please change the delivery address to the office.",
    "Can the two open orders be shipped together?",
    "Cancel the last order if it has not left the warehouse.",
)

BUILTIN_SCHEMAS = (
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    },
)

TOOLS = (
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {
        "name": "find_order",
        "description": "Look up an order by its number.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999}},
            "required": ["order_id"],
            "additionalProperties": False,
        },
    },
    {
        "name": "send_email",
        "description": "Send a short e-mail.",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string", "maxLength": 30},
                "subject": {"type": "string", "maxLength": 30},
            },
            "required": ["to", "subject"],
            "additionalProperties": False,
        },
    },
)
TOOL_ASKS = (
    "What is the weather like in Lisbon, in celsius?",
    "Find order 4512 for me.",
    "E-mail anna@example.com that the meeting moved.",
    "Is it warm in Osaka right now? Use fahrenheit.",
    "Look up order number 77.",
)


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    """Which workload and how big. Validated on creation (`BenchConfigError`)."""

    name: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    seed: int = 0
    schema_dir: str | None = None  # extraction: default DEFAULT_SCHEMA_DIR, else built-ins

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise BenchConfigError(
                f"dataset {self.name!r} is unknown: expected one of {', '.join(DATASETS)}."
            )
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise BenchConfigError(f"{name}={getattr(self, name)} is invalid: expected >= 1.")

    @property
    def structured(self) -> bool:
        return self.name in STRUCTURED_DATASETS


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: a plain `prompt` or chat `messages`, and for structured
    workloads the JSON `schema` its output must satisfy."""

    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    schema: dict[str, Any] | None = None
    ignore_eos: bool = False
    schema_name: str = field(default="")


def make_requests(config: DatasetConfig) -> list[BenchRequest]:
    """`config.num_prompts` requests; the same config always gives the same list."""
    rng = random.Random(config.seed)
    make = {
        "random": _random,
        "shared-prefix": _shared_prefix,
        "extraction": _extraction,
        "tool-calls": _tool_calls,
    }[config.name]
    return make(config, rng)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _random(config: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    return [
        BenchRequest(
            prompt=_words(rng, config.input_len), max_tokens=config.output_len, ignore_eos=True
        )
        for _ in range(config.num_prompts)
    ]


def _shared_prefix(config: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    suffix_len = max(1, config.input_len // 4)
    prefix_len = max(1, config.input_len - suffix_len - len(AGENT_SYSTEM.split()))
    system = AGENT_SYSTEM + "Notes: " + _words(rng, prefix_len)
    return [
        BenchRequest(
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"{rng.choice(TASKS)} {_words(rng, suffix_len)}"},
            ],
            max_tokens=config.output_len,
            ignore_eos=True,
        )
        for _ in range(config.num_prompts)
    ]


def _extraction(config: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    pool = load_schemas(config.schema_dir)
    requests = []
    for _ in range(config.num_prompts):
        name, schema, example = rng.choice(pool)
        document = _document(example, rng)
        requests.append(
            BenchRequest(
                messages=[
                    {
                        "role": "system",
                        "content": "Extract the fields of this JSON schema from the user's "
                        f"document. Reply with JSON only.\nSchema: {json.dumps(schema)}",
                    },
                    {"role": "user", "content": document},
                ],
                schema=schema,
                max_tokens=config.output_len,
                schema_name=name,
            )
        )
    return requests


def _document(example: Any, rng: random.Random) -> str:
    """A short text that states the example's values, in a seeded order."""
    if isinstance(example, dict):
        items = list(example.items())
        rng.shuffle(items)
        lines = [f"{key.replace('_', ' ')}: {json.dumps(value)}" for key, value in items]
    else:
        lines = [f"value: {json.dumps(example)}"]
    return "Record from the archive.\n" + "\n".join(lines)


def load_schemas(schema_dir: str | None) -> list[tuple[str, dict, Any]]:
    """(name, schema, a valid example) for each usable schema, sorted by name: small ones of
    the easy families, with a valid example, that the grammar layer accepts. Falls back to
    built-in schemas when the directory does not exist (and none was asked for)."""
    from agentrt.grammar import GrammarSpec
    from agentrt.grammar.errors import GrammarSpecError

    directory = Path(schema_dir) if schema_dir is not None else DEFAULT_SCHEMA_DIR
    if not directory.is_dir():
        if schema_dir is not None:
            raise BenchConfigError(
                f"schema_dir {schema_dir!r} is not a directory: pass a directory of "
                'maskbench-style JSON files ({"schema": ..., "tests": [...]}).'
            )
        return [(f"builtin-{i}", s, _example(s)) for i, s in enumerate(BUILTIN_SCHEMAS)]
    pool = []
    for path in sorted(directory.glob("*.json")):
        if schema_dir is None and not path.name.startswith(SCHEMA_PREFIXES):
            continue
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        schema = entry.get("schema") if isinstance(entry, dict) else None
        if not isinstance(schema, dict) or len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            continue
        valid = [t["data"] for t in entry.get("tests", []) if t.get("valid") and "data" in t]
        if not valid:
            continue
        try:
            GrammarSpec.from_json_schema(schema)  # the engine refuses what this refuses
        except GrammarSpecError:
            continue
        pool.append((path.stem, schema, valid[0]))
    if not pool:
        raise BenchConfigError(f"no usable schema in {directory}: see DatasetConfig.schema_dir.")
    return pool


def _example(schema: dict) -> dict:
    return {
        key: ("Ada" if prop.get("type") == "string" else 36)
        for key, prop in schema["properties"].items()
    }


def tool_call_schema(tools: tuple[dict, ...] = TOOLS) -> dict:
    """The JSON schema of one call of one of `tools`."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, "arguments": tool["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }


def _tool_calls(config: DatasetConfig, rng: random.Random) -> list[BenchRequest]:
    schema = tool_call_schema()
    shown = json.dumps(list(TOOLS))
    return [
        BenchRequest(
            messages=[
                {
                    "role": "system",
                    "content": "You call tools. Reply with one call as JSON "
                    f'{{"name": ..., "arguments": {{...}}}}. Tools: {shown}',
                },
                {"role": "user", "content": rng.choice(TOOL_ASKS)},
            ],
            schema=schema,
            max_tokens=config.output_len,
            schema_name="tool-call",
        )
        for _ in range(config.num_prompts)
    ]
