"""`agentrt run-batch -i in.jsonl -o out.jsonl` (vLLM's command): an OpenAI batch input file
run on a local engine, without a server. Lines may mix `/v1/chat/completions` and
`/v1/responses`; each goes through the same routes `agentrt serve` answers (the app, called
in-process), and its result is appended to the output as it finishes, in OpenAI's batch
output format (successes and failures in the one file, each with its status_code).

`--resume` continues an output a stopped run left (its custom_ids are not run again; a torn
last line is cut off and redone). SIGINT / SIGTERM stop admitting lines and let those in
flight finish (up to --drain-timeout, a second signal aborts them); exit status 128 + the
signal's number. Otherwise 0 when every line got a 2xx, else 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

from agentrt.engine.args import EngineArgs
from agentrt.engine.errors import InvalidRequestError
from agentrt.extract_io import JsonlWriter
from agentrt.extract_job import StopFlag, watch_signals
from agentrt.server.batch_job import (
    AppDispatcher,
    BatchLine,
    iter_lines,
    load_journal,
    run_lines,
    succeeded,
    validate,
)


def run_batch(args: argparse.Namespace) -> int:
    source, output = Path(args.input_file), Path(args.output_file)
    total, errors = validate(source, None)
    if errors:
        for error in errors:
            print(f"{source}: {error.message}", file=sys.stderr)
        return 2
    if output.exists() and output.stat().st_size and not (args.resume or args.overwrite):
        raise InvalidRequestError(
            f"{output} exists: pass --resume to continue it or --overwrite to start afresh.",
            field="output",
        )
    if args.overwrite and not args.resume:
        output.unlink(missing_ok=True)
    done = load_journal(output).done
    logging.getLogger("agentrt").setLevel(logging.ERROR)
    counts = {"completed": 0, "failed": 0}
    stop = StopFlag()
    bar = None if args.quiet else _progress_bar(total - len(done))
    writer = JsonlWriter(output)
    start = time.perf_counter()
    started: list[float] = []  # when the first line was read: the engine is up

    def on_record(record: dict) -> None:
        writer.write(record)
        counts["completed" if succeeded(record) else "failed"] += 1
        if bar is not None:
            bar.update(1)

    try:
        lines = _timed(iter_lines(source, None, done), started)
        anyio.run(_run, args, lines, on_record, stop)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    end = time.perf_counter()
    first = started[0] if started else end
    num_run = counts["completed"] + counts["failed"]
    rate = num_run / (end - first) if end > first else 0.0
    print(
        f"{counts['completed']}/{num_run} lines succeeded, {counts['failed']} failed, "
        f"{len(done)} already done -> {output}\n{rate:.2f} lines/s over {end - first:.1f} s "
        f"(after {first - start:.1f} s of start-up)",
        file=sys.stderr,
    )
    if stop.signal_name is not None:
        print(f"stopped by {stop.signal_name}: run again with --resume to finish", file=sys.stderr)
        return 128 + signal.Signals[stop.signal_name].value
    return 0 if counts["failed"] == 0 else 1


async def _run(args, lines, on_record, stop: StopFlag) -> None:
    from agentrt.server.app import create_app
    from agentrt.server.state import ServerConfig

    config = ServerConfig(
        engine_args=EngineArgs.from_cli_args(args), served_model_name=args.served_model_name
    )
    app = create_app(config)
    async with app.router.lifespan_context(app), anyio.create_task_group() as tg:
        work = anyio.CancelScope()
        await tg.start(watch_signals, stop, work, args.drain_timeout)
        try:
            with work:  # cancelled = the drain timed out: the lines in flight are aborted
                limiter = anyio.Semaphore(args.concurrency)
                await run_lines(AppDispatcher(app, None), lines, limiter, on_record, stop.is_set)
        finally:
            tg.cancel_scope.cancel()  # the watcher


def _timed(lines: Iterator[BatchLine], started: list[float]) -> Iterator[BatchLine]:
    for line in lines:
        if not started:
            started.append(time.perf_counter())
        yield line


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="run-batch", unit="line", dynamic_ncols=True)
