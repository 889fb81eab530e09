"""The OpenAI Batch API vs `agentrt extract` on the same lines, side by side in one run, on the
embedded SmolLM2-135M-Instruct:

  extract    `agentrt extract` JSONL -> JSONL (the baseline; benchmarks/pipeline.py's `cli`)
  run-batch  `agentrt run-batch -i lines.jsonl -o out.jsonl` on the same documents as OpenAI
             batch lines: chat completions with the same instruction (system message), the
             same JSON schema (response_format) and sampling (greedy, --max-tokens)
  serve      `agentrt serve --state-dir D`: the lines uploaded with the openai client
             (files.create), one batch (batches.create), timed from create to completed
  kill       the same batch, the server SIGKILLed once about half the lines are journaled,
             restarted on the same state dir; counts the custom_ids lost and duplicated

Rates count from the first request to the last result: the engine's start-up is apart
(extract and run-batch report it; the server is up before its batch is created, and its
rate includes the batch's validation, finalizing and polls, see `Server.wait`). Every side
runs in its own process(es) with the same engine defaults and --concurrency lines in flight.
The timed sides run --rounds times, in alternating order (the load of a shared machine
drifts); the medians are compared.

Last lines: the median ratios to extract (target >= 0.95), lost / duplicated after the kill
(target 0 / 0), the machine (CPU model, load average), and a JSON object.

`--dispatch-cpu N` measures instead what running a line costs the event loop beyond its
handler: N lines that the handler refuses before the engine (a model mismatch, 404), run by
the batch's `AppDispatcher` (the endpoint called directly) and POSTed to the same app
through httpx.ASGITransport (the HTTP round trip), alternated --rounds times; CPU time of
the event loop's thread per line, and the ratio.

    python benchmarks/batch_api.py                          # 2,000 lines
    python benchmarks/batch_api.py --docs 40 --rounds 2     # on a busy machine
    python benchmarks/batch_api.py --dispatch-cpu 500 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import INSTRUCTIONS, ROOT, SCHEMA, documents, run_cli

KEY = "bench-key"


def batch_lines(rows: list[dict], max_tokens: int) -> list[dict]:
    response_format = {"type": "json_schema", "json_schema": {"name": "contact", "schema": SCHEMA}}
    return [
        {
            "custom_id": row["id"],
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "SmolLM2-135M-Instruct",
                "messages": [
                    {"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": row["text"]},
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
                "response_format": response_format,
            },
        }
        for row in rows
    ]


def run_batch_command(source: Path, work: Path, concurrency: int) -> dict:
    output = work / "run-batch.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "agentrt", "run-batch", "-i", str(source), "-o", str(output)]
        + ["--quiet", "--concurrency", str(concurrency)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):
        raise SystemExit(f"run-batch failed:\n{done.stderr[-2000:]}")
    rate = re.search(r"([\d.]+) lines/s over ([\d.]+) s \(after ([\d.]+) s", done.stderr)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    return {
        "docs_per_s": len(records) / float(rate[2]),  # the printed rate has 2 decimals
        "elapsed_s": float(rate[2]),
        "startup_s": float(rate[3]),
        "num_ok": sum(r["response"]["status_code"] == 200 for r in records),
    }


class Server:
    def __init__(self, state_dir: Path, port: int, concurrency: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        args = ["--port", str(port), "--state-dir", str(state_dir), "--api-key", KEY]
        args += ["--max-batch-concurrency", str(concurrency), "--log-level", "warning"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentrt", "serve", *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import httpx

        while True:
            if self.process.poll() is not None:
                raise SystemExit("agentrt serve exited at start-up")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        import openai

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=2)

    def wait(self, batch_id: str):
        """Poll until the batch ended: every 0.1 s at first, then every 1% of the time waited
        (at most 1 s), so the polls neither cost the server much (a retrieve costs it ~1.7 ms
        of CPU, 10 a second ~2% of a core) nor add more than 1% to the time measured."""
        start = time.perf_counter()
        while (batch := self.client.batches.retrieve(batch_id)).status not in (
            "completed",
            "failed",
            "cancelled",
        ):
            time.sleep(min(1.0, max(0.1, 0.01 * (time.perf_counter() - start))))
        return batch

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)
        self.process.wait()


def output_ids(server: Server, batch) -> list[str]:
    ids = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            text = server.client.files.content(file_id).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines()]
    return ids


def run_serve(source: Path, work: Path, concurrency: int, port: int) -> dict:
    server = Server(work / "state-serve", port, concurrency)
    try:
        file_id = server.client.files.create(file=source.open("rb"), purpose="batch").id
        start = time.perf_counter()
        batch = server.client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = server.wait(batch.id)
        elapsed = time.perf_counter() - start
    finally:
        server.stop()
    counts = batch.request_counts
    return {"docs_per_s": counts.total / elapsed, "elapsed_s": elapsed, "num_ok": counts.completed}


def run_kill(source: Path, work: Path, concurrency: int, port: int, num_docs: int) -> dict:
    state = work / "state-kill"
    server = Server(state, port, concurrency)
    file_id = server.client.files.create(file=source.open("rb"), purpose="batch").id
    batch_id = server.client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id
    journal = state / "batches" / f"{batch_id}.jsonl"
    while not journal.exists() or journal.read_bytes().count(b"\n") < num_docs // 2:
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    journaled = journal.read_bytes().count(b"\n")
    server = Server(state, port, concurrency)
    try:
        batch = server.wait(batch_id)
        ids = output_ids(server, batch)
    finally:
        server.stop()
    expected = {f"doc-{i}" for i in range(num_docs)}
    return {
        "journaled_at_kill": journaled,
        "status": batch.status,
        "lost": len(expected - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "num_ok": batch.request_counts.completed,
    }


def dispatch_cpu(num_lines: int, rounds: int) -> None:
    import anyio
    import httpx

    from agentrt.server.app import create_app
    from agentrt.server.batch_job import AppDispatcher, BatchLine
    from agentrt.server.state import ServerConfig

    lines = [
        BatchLine(line["custom_id"], line["url"], {**line["body"], "model": "no-such-model"})
        for line in batch_lines(documents(num_lines), 64)
    ]

    async def main() -> dict[str, list[float]]:
        app = create_app(ServerConfig(api_key=KEY))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {KEY}"}
        cpu: dict[str, list[float]] = {"dispatcher": [], "http": []}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://b", headers=headers) as http,
        ):
            dispatcher = AppDispatcher(app, KEY)
            for round_ in range(rounds):
                for side in ("dispatcher", "http")[:: 1 if round_ % 2 == 0 else -1]:
                    start = time.thread_time()
                    for line in lines:
                        if side == "dispatcher":
                            status = (await dispatcher.post(line))["response"]["status_code"]
                        else:
                            status = (await http.post(line.url, json=line.body)).status_code
                        assert status == 404, status
                    cpu[side].append(1000 * (time.thread_time() - start) / num_lines)
        return cpu

    cpu = anyio.run(main)
    for side, values in cpu.items():
        print(f"{side:10s} event-loop CPU per line: {' '.join(f'{v:.3f}' for v in values)} ms")
    best = {side: min(values) for side, values in cpu.items()}
    print(f"http / dispatcher (best rounds): {best['http'] / best['dispatcher']:.1f}x")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sides", default="extract,run-batch,serve,kill")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--rounds", type=int, default=2, help="of each timed side, alternated")
    parser.add_argument(
        "--dispatch-cpu", type=int, default=0, metavar="N", help="measure the dispatch alone"
    )
    args = parser.parse_args()
    if args.dispatch_cpu:
        dispatch_cpu(args.dispatch_cpu, args.rounds)
        return
    figures: dict[str, list[dict]] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = documents(args.docs)
        docs = work / "docs.jsonl"
        docs.write_text("".join(json.dumps(r) + "\n" for r in rows))
        source = work / "lines.jsonl"
        lines = batch_lines(rows, args.max_tokens)
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        sides = args.sides.split(",")
        timed = [side for side in sides if side != "kill"]
        for round_ in range(args.rounds):  # alternate the order: the load drifts
            for side in timed if round_ % 2 == 0 else timed[::-1]:
                f = run_side(side, docs, source, work / f"round{round_}", args)
                figures.setdefault(side, []).append(f)
                loads.append(os.getloadavg()[0])
                print(
                    f"round {round_} {side:9s} {f['docs_per_s']:7.3f} docs/s over "
                    f"{f['elapsed_s']:.1f} s  valid {f['num_ok']}/{args.docs}  "
                    f"(load {loads[-1]:.1f})",
                    flush=True,
                )
        if "kill" in sides:
            f = run_kill(source, work, args.concurrency, args.port, args.docs)
            figures["kill"] = [f]
            print(
                f"kill: SIGKILL at {f['journaled_at_kill']} journaled lines, then {f['status']}: "
                f"lost {f['lost']}, duplicated {f['duplicated']}, valid {f['num_ok']}/{args.docs}",
                flush=True,
            )
    rate = {
        side: statistics.median(f["docs_per_s"] for f in runs)
        for side, runs in figures.items()
        if side != "kill"
    }
    for side, value in rate.items():
        print(f"{side:9s} median {value:.3f} docs/s over {args.rounds} rounds")
    for side in ("run-batch", "serve"):
        if "extract" in rate and side in rate:
            print(f"{side} / extract: {rate[side] / rate['extract']:.3f} (target >= 0.95)")
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs, 1-min load {min(loads):.1f}-{max(loads):.1f}"
    print(f"machine: {machine}")
    summary = {"docs": args.docs, "max_tokens": args.max_tokens, "machine": machine}
    print(json.dumps({**summary, "median_docs_per_s": rate, **figures}))


def run_side(side: str, docs: Path, source: Path, work: Path, args) -> dict:
    work.mkdir(exist_ok=True)
    if side == "extract":
        extra = ("--concurrency", str(args.concurrency))
        return run_cli(docs, work, side, args.max_tokens, *extra)
    if side == "run-batch":
        return run_batch_command(source, work, args.concurrency)
    if side == "serve":
        return run_serve(source, work, args.concurrency, args.port)
    raise SystemExit(f"unknown side {side!r}")


if __name__ == "__main__":
    main()
