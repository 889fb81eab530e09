"""Extraction pipelines side by side, in one run, on the embedded SmolLM2-135M-Instruct:

  memory     `rt.extract_many(texts)` over documents held in memory (the baseline)
  cli        `agentrt extract` JSONL -> JSONL: streamed, appended and flushed per result
  ray-1      `agentrt extract --ray local --num-actors 1`: the same job through Ray Data
  ray-2      the same with 2 actors (2 engines)

Every side runs the same documents (seeded synthetic contact notes), the same schema,
instruction and sampling (greedy, `--max-tokens`), in its own process so none inherits
another's warm caches. docs/s counts from the first document sent to the last result (the
engine's or actors' start-up is reported apart; for Ray the actors start after the first
document is sent, so their start-up is inside). On a 2-core machine two actors cannot be
faster than one engine: each has one core and loses the batching of a single engine; the
Ray figures measure the overhead of the Ray path, not its scaling.

Last lines: the ratios (cli / memory, target >= 0.95; ray-1 / cli), a paper estimate of
documents/hour on a cluster (`--nodes` x `--engines-per-node` engines at the measured
ray-1 rate per engine, which on a GPU would be measured again), and a JSON object.

    python benchmarks/pipeline.py                   # 2,000 documents
    python benchmarks/pipeline.py --docs 100 --sides memory,cli   # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = (
    "You extract the contact person of a note: full name, email address and age. Reply with "
    "JSON only."
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "email", "age"],
}
FIRST = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
LAST = ["Martin", "Stone", "Diaz", "Wu", "Adams", "Khan", "Lopez", "Novak", "Ito", "Berg"]


def documents(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        email = f"{first.lower()}.{last.lower()}@example.com"
        rows.append(
            {
                "id": f"doc-{i}",
                "text": f"Note {i}: {first} {last} ({email}), aged {rng.randint(18, 90)}, "
                f"called about order {rng.randint(1000, 9999)}.",
            }
        )
    return rows


MEMORY_SIDE = """
import asyncio, json, logging, sys, time
import agentrt
logging.getLogger("agentrt").setLevel(logging.ERROR)
rows = [json.loads(line) for line in open(sys.argv[1])]
schema, instructions, max_tokens = json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model = sys.argv[5] or None
async def main():
    async with agentrt.Runtime(model) as rt:
        start = time.perf_counter()
        results = await rt.extract_many([r["text"] for r in rows], schema,
            instructions=instructions, progress=False, max_tokens=max_tokens)
        elapsed = time.perf_counter() - start
    ok = sum(r.ok for r in results)
    print(json.dumps({"docs_per_s": len(results) / elapsed, "num_ok": ok, "elapsed_s": elapsed}))
asyncio.run(main())
"""


def run_memory(source: Path, max_tokens: int, model: str | None) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_SIDE,
            str(source),
            json.dumps(SCHEMA),
            INSTRUCTIONS,
            str(max_tokens),
            model or "",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cli(source: Path, work: Path, name: str, max_tokens: int, *extra: str) -> dict:
    schema = work / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    report = work / f"{name}.report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrt",
            "extract",
            "--schema",
            str(schema),
            "--input",
            str(source),
            "--output",
            str(work / f"{name}.jsonl"),
            "--id-field",
            "id",
            "--instructions",
            INSTRUCTIONS,
            "--max-tokens",
            str(max_tokens),
            "--quiet",
            "--report-json",
            str(report),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):  # 1: some documents failed, which the report counts
        raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--model", default=None, help="a checkpoint dir or .gguf (default: the embedded model)"
    )
    parser.add_argument("--sides", default="memory,cli,ray-1,ray-2")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--engines-per-node", type=int, default=8)
    args = parser.parse_args()
    sides = args.sides.split(",")
    figures: dict[str, dict] = {}
    model = () if args.model is None else ("--model", args.model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "docs.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in documents(args.docs)))
        for side in sides:
            start = time.perf_counter()
            if side == "memory":
                figures[side] = run_memory(source, args.max_tokens, args.model)
            elif side == "cli":
                figures[side] = run_cli(source, work, side, args.max_tokens, *model)
            elif side.startswith("ray-"):
                actors = side.removeprefix("ray-")
                ray = ("--ray", "local", "--num-actors", actors)
                figures[side] = run_cli(source, work, side, args.max_tokens, *model, *ray)
            else:
                raise SystemExit(f"unknown side {side!r}")
            figures[side]["wall_s"] = time.perf_counter() - start
            f = figures[side]
            print(
                f"{side:8s} {f['docs_per_s']:7.2f} docs/s  valid {f['num_ok']}/{args.docs}  "
                f"(process wall time {f['wall_s']:.1f} s)",
                flush=True,
            )
    rate = {side: f["docs_per_s"] for side, f in figures.items()}
    if "memory" in rate and "cli" in rate:
        print(f"cli / memory: {rate['cli'] / rate['memory']:.3f} (target >= 0.95)")
    if "cli" in rate and "ray-1" in rate:
        print(f"ray-1 / cli: {rate['ray-1'] / rate['cli']:.3f} (the Ray path's overhead)")
    if "ray-1" in rate:
        engines = args.nodes * args.engines_per_node
        print(
            f"paper estimate: {engines} engines x {rate['ray-1']:.2f} docs/s x 3600 = "
            f"{engines * rate['ray-1'] * 3600:,.0f} documents/hour at this per-engine rate "
            "(a GPU engine's rate must be measured on the GPU)"
        )
    print(
        json.dumps(
            {"docs": args.docs, "max_tokens": args.max_tokens, "model": args.model, **figures}
        )
    )


if __name__ == "__main__":
    main()
