"""One run of `agentrt extract`: documents streamed from a file through `extract_iter` (or a
Ray cluster, see `agentrt.ray`) into a resumable output, with a progress bar, a final report,
and a clean stop on SIGINT / SIGTERM.

Stopping: the first signal stops admitting documents; the requests in flight get
`drain_timeout_s` to finish (a second signal ends the wait), then are aborted. Every result
written so far is already flushed; the output is closed (a table output merged), the report
printed, and the exit status is 128 + the signal's number. Aborted documents have no result,
so `--resume` runs them again."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from agentrt.extract import Document, ExtractResult, extract_iter, load_schema
from agentrt.extract_io import Columns, OutputState, ResultSink, count_rows, id_key, read_documents
from agentrt.formats import resolve_format

DEFAULT_INSTRUCTIONS = (
    "Extract the fields of the JSON schema below from the user's document. Reply with JSON "
    "only.\nSchema: {schema}"
)


@dataclass(slots=True)
class ExtractJob:
    """The options of one run (the `agentrt extract` flags)."""

    schema: str  # pkg.module:Model or a JSON-schema file
    input: str
    output: str
    instructions: str | None = None
    text_field: str = "text"
    id_field: str | None = None
    limit: int | None = None  # the first `limit` documents of the input
    resume: bool = False
    retry_failed: bool = False
    overwrite: bool = False
    value_column: str = "flat"
    concurrency: int = 32
    progress: bool = True
    report_json: str | None = None
    drain_timeout_s: float = 30.0
    sampling: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    ray_address: str | None = None  # run on a Ray cluster ("auto", or host:port)
    num_actors: int = 1
    batch_size: int = 16  # documents per Ray batch


@dataclass(slots=True)
class JobReport:
    """Counts of one run. `docs_per_s`: this run's results over `elapsed_s`, the time from the
    first document sent to the last result; `startup_s` (loading the engine, or starting
    the Ray job) comes before it."""

    output: str
    num_read: int = 0  # documents read from the input (up to --limit)
    num_skipped: int = 0  # already in the output (--resume / --retry-failed)
    num_duplicates: int = 0  # an id seen before in this input: not run again
    num_ok: int = 0
    num_failed: int = 0
    num_aborted: int = 0  # in flight when a stop aborted them: no result, redone on resume
    num_steered: int = 0  # valid, but the grammar closed them at max_tokens
    errors_by_code: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    startup_s: float = 0.0
    elapsed_s: float = 0.0
    docs_per_s: float = 0.0
    started_at: float | None = field(default=None, repr=False)  # first document sent
    stopped_by: str | None = None  # the signal's name when a signal stopped the run

    def add(self, result: ExtractResult) -> None:
        if result.ok:
            self.num_ok += 1
        else:
            self.num_failed += 1
            code = getattr(result.error, "code", None)
            key = "none" if code is None else str(code)
            self.errors_by_code[key] = self.errors_by_code.get(key, 0) + 1
        self.num_steered += result.num_steered_tokens > 0
        if result.usage is not None:
            self.prompt_tokens += result.usage.prompt_tokens
            self.cached_tokens += result.usage.cached_tokens
            self.completion_tokens += result.usage.completion_tokens

    @property
    def num_results(self) -> int:
        return self.num_ok + self.num_failed

    def summary(self) -> str:
        n = self.num_results
        share = f" ({100 * self.num_ok / n:.1f}% valid)" if n else ""
        codes = ", ".join(f"{c}: {k}" for c, k in sorted(self.errors_by_code.items()))
        lines = [
            f"{self.num_ok}/{n} extracted{share} -> {self.output}",
            f"failed: {self.num_failed}" + (f" ({codes})" if codes else ""),
            f"skipped (already done): {self.num_skipped}, duplicate ids: {self.num_duplicates}",
            f"{self.docs_per_s:.2f} docs/s over {self.elapsed_s:.1f} s (after "
            f"{self.startup_s:.1f} s of start-up); tokens: prompt "
            f"{self.prompt_tokens} (cached {self.cached_tokens}), completion "
            f"{self.completion_tokens}",
        ]
        if self.num_steered:
            lines.append(f"steered at max_tokens (valid, maybe cut short): {self.num_steered}")
        if self.stopped_by is not None:
            lines.append(
                f"stopped by {self.stopped_by}: {self.num_aborted} in flight aborted; "
                "run again with --resume to finish"
            )
        return "\n".join(lines)


class StopFlag:
    """Set by the signal watcher; read by the document feed (a plain generator)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def set(self, signal_name: str) -> None:
        self.signal_name = self.signal_name or signal_name
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def run_job(job: ExtractJob) -> tuple[JobReport, int]:
    """Run `job`; returns its report and the exit status (0 all valid, 1 some failed,
    128 + signal number when stopped). The report is printed to stderr."""
    schema = load_schema(job.schema)
    json_schema = resolve_format(schema).json_schema  # a bad schema fails here, once
    instructions = job.instructions or DEFAULT_INSTRUCTIONS.format(
        schema=json.dumps(json_schema or {})
    )
    sink = ResultSink(
        job.output,
        columns=Columns.for_schema(json_schema, job.value_column),
        resume=job.resume,
        retry_failed=job.retry_failed,
        overwrite=job.overwrite,
    )
    report = JobReport(output=job.output)
    stop = StopFlag()
    documents = read_documents(job.input, text_field=job.text_field, id_field=job.id_field)
    pending = _pending(documents, sink.state, report, job.limit, stop)
    bar = _progress_bar(job, sink.state)
    # The reply-by-reply warning about steered replies would bury the bar: they are counted.
    logging.getLogger("agentrt").setLevel(logging.ERROR)
    start = time.perf_counter()

    def on_result(result: ExtractResult) -> None:
        sink.write(result)
        report.add(result)
        if bar is not None:
            bar.set_postfix_str(f"valid {100 * report.num_ok / report.num_results:.1f}%", False)
            bar.update(1)

    try:
        anyio.run(_run, job, schema, instructions, pending, on_result, stop)
    finally:
        sink.close()
        if bar is not None:
            bar.close()
        end = time.perf_counter()
        first = report.started_at if report.started_at is not None else end
        report.startup_s, report.elapsed_s = first - start, end - first
        report.docs_per_s = report.num_results / report.elapsed_s if report.elapsed_s else 0.0
        report.stopped_by = stop.signal_name
        admitted = report.num_read - report.num_skipped - report.num_duplicates
        report.num_aborted = max(0, admitted - report.num_results)
        print(report.summary(), file=sys.stderr)
        if job.report_json is not None:
            with open(job.report_json, "w") as f:
                fields = asdict(report)
                del fields["started_at"]
                json.dump(fields, f, indent=2)
    if stop.signal_name is not None:
        return report, 128 + signal.Signals[stop.signal_name].value
    return report, 0 if report.num_failed == 0 else 1


async def _run(job, schema, instructions, pending, on_result, stop: StopFlag) -> None:
    async with anyio.create_task_group() as tg:
        work = anyio.CancelScope()
        await tg.start(watch_signals, stop, work, job.drain_timeout_s)
        try:
            if job.ray_address is not None:
                from agentrt.ray import connect, run_on_ray

                connect(job.ray_address)  # on this (the main) thread
                await anyio.to_thread.run_sync(
                    run_on_ray, job, schema, instructions, pending, on_result, stop
                )
            else:
                await _run_local(job, schema, instructions, pending, on_result, work)
        finally:
            tg.cancel_scope.cancel()  # the watcher


async def _run_local(job, schema, instructions, pending, on_result, work) -> None:
    from agentrt.runtime import Runtime

    async with Runtime(**job.engine_options) as rt:
        with work:  # cancelled = the drain timed out: the requests in flight are aborted
            results = extract_iter(
                rt.backend,
                pending,
                schema,
                instructions=instructions,
                concurrency=job.concurrency,
                **job.sampling,
            )
            async with aclosing(results):
                async for result in results:
                    on_result(result)


async def watch_signals(
    stop: StopFlag,
    work: anyio.CancelScope,
    drain_timeout_s: float,
    *,
    task_status=anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            stop.set(signal.Signals(signum).name)
            print(
                f"\n{stop.signal_name}: no new documents; waiting up to {drain_timeout_s:g} s "
                "for those in flight (again to abort them)",
                file=sys.stderr,
            )
            with anyio.move_on_after(drain_timeout_s):
                async for _ in signals:
                    break
            work.cancel()
            return


def _pending(
    documents: Iterator[Document],
    state: OutputState,
    report: JobReport,
    limit: int | None,
    stop: StopFlag,
) -> Iterator[Document]:
    """The documents still to run, read one at a time: up to `limit`, not those already in
    the output, each id once, none after a stop."""
    seen: set[str] = set()
    for document in documents:
        if stop.is_set() or (limit is not None and report.num_read >= limit):
            return
        report.num_read += 1
        key = id_key(document.id)
        if key in seen:
            report.num_duplicates += 1
            continue
        seen.add(key)
        if key in state.done:
            report.num_skipped += 1
            continue
        if report.started_at is None:
            report.started_at = time.perf_counter()
        yield document


def _progress_bar(job: ExtractJob, state: OutputState):
    if not job.progress:
        return None
    from tqdm.auto import tqdm

    rows = count_rows(job.input)
    if rows is not None and job.limit is not None:
        rows = min(rows, job.limit)
    total = None if rows is None else max(0, rows - len(state.done))
    return tqdm(total=total, desc="extract", unit="doc", dynamic_ncols=True)
