"""`agentrt` command line: `agentrt generate "..."`, `agentrt chat`, `agentrt extract`,
`agentrt run-batch`, `agentrt serve`, `agentrt proxy`, `agentrt bench`, `agentrt tune`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from agentrt.engine.args import EngineArgs


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (from `EngineArgs`) and the sampling flags of one reply."""
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)


def _engine_options(args) -> dict:
    return dataclasses.asdict(EngineArgs.from_cli_args(args))


def _params(args):
    from agentrt.engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )


def _generate(args) -> int:
    from agentrt.engine.client.llm import LLM

    params = _params(args)  # a bad sampling flag fails before the model loads
    llm = LLM(**_engine_options(args))
    start = time.perf_counter()
    (output,) = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    completion = output.outputs[0]
    print(completion.text)
    print(
        f"[{len(completion.token_ids)} tokens in {elapsed:.2f}s, "
        f"{len(completion.token_ids) / elapsed:.1f} tokens/s, finish: "
        f"{completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _chat(args) -> int:
    from agentrt.engine.client.llm import LLM

    params = _params(args)  # a bad sampling flag fails before the model loads
    llm = LLM(**_engine_options(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("agentrt chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        (output,) = llm.chat(messages, params)
        answer = output.outputs[0].text
        print(f"assistant> {answer}")
        messages.append({"role": "assistant", "content": answer})
    return 0


def _extract(args) -> int:
    from agentrt.extract_job import ExtractJob, run_job

    job = ExtractJob(
        schema=args.schema,
        input=args.input,
        output=args.output,
        instructions=args.instructions,
        text_field=args.text_field,
        id_field=args.id_field,
        limit=args.limit,
        resume=args.resume,
        retry_failed=args.retry_failed,
        overwrite=args.overwrite,
        value_column=args.value_column,
        concurrency=args.concurrency,
        progress=not args.quiet,
        report_json=args.report_json,
        drain_timeout_s=args.drain_timeout,
        sampling={"max_tokens": args.max_tokens, "temperature": args.temperature},
        engine_options=_engine_options(args),
        ray_address=args.ray,
        num_actors=args.num_actors,
        batch_size=args.batch_size,
    )
    _, status = run_job(job)
    return status


def _run_batch(args) -> int:
    from agentrt.server.run_batch import run_batch

    return run_batch(args)


def _serve(args) -> int:
    from agentrt.server.cli import run_serve

    return run_serve(args)


def _proxy(args) -> int:
    from agentrt.server.proxy_app import run_proxy

    return run_proxy(args)


def _bench(args) -> int:
    from agentrt.bench.cli import run_bench

    return run_bench(args)


def _tune(args) -> int:
    from agentrt.bench.cli import run_tune

    return run_tune(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    chat = commands.add_parser("chat", help="an interactive chat on stdin")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    extract = commands.add_parser(
        "extract",
        help="extract a schema from every document of a JSONL, CSV or Parquet file",
        description="Streams the input, appends each result to the output as it finishes, "
        "and resumes where a stopped run left off (see docs/sdk.md, Pipelines).",
    )
    extract.add_argument("--schema", required=True, help="pkg.module:Model or a JSON-schema file")
    extract.add_argument(
        "--input", required=True, help=".jsonl (strings or objects), .csv or .parquet"
    )
    extract.add_argument(
        "--output", required=True, help=".jsonl, .csv or .parquet: one result per document"
    )
    extract.add_argument("--text-field", default="text", help="field holding the document")
    extract.add_argument(
        "--id-field", default=None, help="field holding the document's id (default: row number)"
    )
    extract.add_argument("--limit", type=int, default=None, help="only the first N documents")
    extract.add_argument("--resume", action="store_true", help="skip the ids already in the output")
    extract.add_argument(
        "--retry-failed", action="store_true", help="redo the output's failed results only"
    )
    extract.add_argument("--overwrite", action="store_true", help="replace an existing output")
    extract.add_argument(
        "--value-column",
        choices=("flat", "json"),
        default="flat",
        help="CSV/Parquet output: a column per schema property (flat) or one JSON column",
    )
    extract.add_argument("--report-json", default=None, help="also write the report here")
    extract.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGINT/SIGTERM before being aborted",
    )
    extract.add_argument("--instructions", default=None, help="the shared instruction")
    extract.add_argument("--concurrency", type=int, default=32)
    extract.add_argument("--quiet", action="store_true", help="no progress bar")
    ray = extract.add_argument_group("ray")
    ray.add_argument(
        "--ray", default=None, metavar="ADDRESS", help="run on a Ray cluster ('auto' or host:port)"
    )
    ray.add_argument("--num-actors", type=int, default=1, help="engines (Ray actors), one each")
    ray.add_argument("--batch-size", type=int, default=16, help="documents per Ray batch")
    _add_engine_args(extract)
    from agentrt.server.batch_options import add_run_batch_args

    add_run_batch_args(
        commands.add_parser(
            "run-batch",
            help="run an OpenAI batch file (chat completions, responses) on a local engine",
        )
    )
    from agentrt.server.cli import add_serve_args

    add_serve_args(commands.add_parser("serve", help="an OpenAI-compatible HTTP server"))
    from agentrt.server.proxy_app import add_proxy_args

    add_proxy_args(
        commands.add_parser("proxy", help="a prefill/decode proxy in front of two serve instances")
    )
    from agentrt.bench.cli import add_bench_args

    add_bench_args(commands.add_parser("bench", help="benchmark the engine or a server"))
    from agentrt.bench.cli import add_tune_args

    add_tune_args(
        commands.add_parser(
            "tune", help="search engine settings for the most goodput under a latency bound"
        )
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from agentrt.engine.errors import EngineError
    from agentrt.errors import AgentrtError

    run = {
        "generate": _generate,
        "chat": _chat,
        "extract": _extract,
        "run-batch": _run_batch,
        "serve": _serve,
        "proxy": _proxy,
        "bench": _bench,
        "tune": _tune,
    }[args.command]
    try:
        return run(args)
    except (EngineError, AgentrtError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
