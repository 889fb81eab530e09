"""agentrt.ray on a real local Ray cluster (2 CPUs): two Extractor actors, each with its own
engine, give the single-process results (greedy, on the default engine as `rt`); an actor
killed mid-job has its batch retried and the output still holds every id once; `agentrt
extract --ray` writes the same results as a local run."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import ray

from agentrt.extract import Document
from agentrt.extract_job import DEFAULT_INSTRUCTIONS, ExtractJob, StopFlag, run_job
from agentrt.ray import BATCHES_PER_ACTOR, Extractor, run_on_ray
from tests.agentrt.test_extract import DOCS, INSTRUCTIONS, Contact

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
ENGINE = {"kv_cache_memory_gb": 0.25}
# The tiny model's engines (the local run and every actor): a 0.05 GiB KV pool, 6,553 of its
# blocks, is plenty.
TINY_ENGINE = {"dtype": "float32", "kv_cache_memory_gb": 0.05}
MAX_TOKENS = 48
KILLED_ROW = 5


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


class KillOnce:
    """An Extractor whose actor dies (os._exit) on the batch holding row `killed_row`, once:
    the process that removes the marker file first is the one that dies. With `starts`,
    each construction appends its process id to that file."""

    def __init__(
        self, marker: str, killed_row: int = KILLED_ROW, starts: str | None = None, **options
    ) -> None:
        self.marker = marker
        self.killed_row = killed_row
        self.extractor = Extractor(**options)
        if starts is not None:
            with open(starts, "a") as f:
                f.write(f"{os.getpid()}\n")

    async def __call__(self, batch):
        if self.killed_row in list(batch["row"]):
            try:
                os.unlink(self.marker)
            except FileNotFoundError:
                pass
            else:
                os._exit(1)
        return await self.extractor(batch)


async def test_two_actors_match_one_process_and_survive_a_killed_actor(cluster, rt, tmp_path: Path):
    texts = [f"{doc} (note {i})" for i, doc in enumerate(DOCS + DOCS[:3])]
    local = await rt.extract_many(
        texts, Contact, instructions=INSTRUCTIONS, progress=False, max_tokens=MAX_TOKENS
    )
    marker = tmp_path / "kill-once"
    marker.touch()
    ds = ray.data.from_items([{"row": i, "text": text} for i, text in enumerate(texts)])
    out = ds.map_batches(
        KillOnce,
        fn_constructor_kwargs={
            "marker": str(marker),
            "schema": Contact,
            "instructions": INSTRUCTIONS,
            "engine_options": ENGINE,
            "sampling": {"max_tokens": MAX_TOKENS},
        },
        concurrency=2,
        batch_size=2,
        num_cpus=1,
    )
    rows = out.take_all()
    assert not marker.exists()  # an actor did die
    assert sorted(row["row"] for row in rows) == list(range(len(texts)))  # each id once
    for row in rows:
        expected = local[row["row"]]
        assert row["error_code"] is None and expected.ok, row
        assert json.loads(row["value"]) == expected.value.model_dump(mode="json")
        assert row["completion_tokens"] == expected.usage.completion_tokens
        assert "text" not in row  # the document is not carried to the output


def test_extract_command_on_ray_writes_what_a_local_run_writes(
    cluster, tiny_checkpoint, tmp_path: Path
):
    tiny_dir = str(tiny_checkpoint("llama"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    source = tmp_path / "in.jsonl"
    rows = [{"text": f"Document {i}."} for i in range(20)]
    rows[7] = {"body": "no text"}  # a bad row: an error the driver writes itself
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(output: Path, **options):
        return run_job(
            ExtractJob(
                schema=str(schema),
                input=str(source),
                output=str(output),
                instructions="Reply with JSON.",
                progress=False,
                sampling={"max_tokens": 12},
                engine_options={"model": tiny_dir, **TINY_ENGINE},
                **options,
            )
        )

    local_report, _ = run(tmp_path / "local.jsonl")
    ray_report, status = run(tmp_path / "ray.jsonl", ray_address="local", num_actors=2)
    assert status == 1 and ray_report.num_failed == 1 and ray_report.num_ok == 19
    assert ray_report.completion_tokens == local_report.completion_tokens

    def by_id(path: Path) -> dict:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(records) == len({r["id"] for r in records}) == 20
        return {r["id"]: (r["value"], r["error"] and r["error"]["code"]) for r in records}

    assert by_id(tmp_path / "ray.jsonl") == by_id(tmp_path / "local.jsonl")


def test_actors_live_across_the_whole_job(cluster, tiny_checkpoint, tmp_path: Path):
    """`run_on_ray` keeps its actors, so their engines, for the whole input: 24 documents in
    batches of 2 on 2 actors holding at most BATCHES_PER_ACTOR batches each (12 batches, 3x
    what is ever in flight) start 2 extractors, and one more for the actor killed mid-job,
    whose batch runs again on its restarted actor; every id comes back once (before, each
    window of documents started its actors anew: checked, windows of 4 batches start 7)."""
    batch_size, num_actors, num_docs = 2, 2, 24
    assert num_docs == 3 * num_actors * BATCHES_PER_ACTOR * batch_size
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    job = ExtractJob(
        schema="-",
        input="-",
        output="-",
        sampling={"max_tokens": 12},
        engine_options={"model": str(tiny_checkpoint("llama")), **TINY_ENGINE},
        ray_address="local",
        num_actors=num_actors,
        batch_size=batch_size,
    )
    marker, starts = tmp_path / "kill-once", tmp_path / "starts"
    marker.touch()
    killed_row = 1  # of a batch: every batch has a row 1, so the first actor's first dies
    documents = (Document(f"d{i}", f"Document {i}.") for i in range(num_docs))
    results = []
    run_on_ray(
        job,
        schema,
        DEFAULT_INSTRUCTIONS.format(schema=json.dumps(schema)),
        documents,
        results.append,
        StopFlag(),
        extractor=functools.partial(
            KillOnce, marker=str(marker), killed_row=killed_row, starts=str(starts)
        ),
    )
    assert not marker.exists()  # an actor did die
    pids = starts.read_text().split()
    assert len(pids) == len(set(pids)) == num_actors + 1, pids  # the restart only
    assert sorted(r.id for r in results) == sorted(f"d{i}" for i in range(num_docs))
    assert sorted(r.index for r in results) == list(range(num_docs))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
