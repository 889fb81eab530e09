"""The `agentrt serve` command line: server and engine options, then `serve(...)`."""

from __future__ import annotations

import argparse
import os


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="local HF checkpoint dir or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("AGENTRT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $AGENTRT_API_KEY; none = open)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests that may wait beyond --max-num-seqs; past it the server answers 429",
    )
    parser.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="else 413")
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests"
    )
    parser.add_argument("--log-level", default="info")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--no-jump-forward", action="store_true", help="sample even the tokens a grammar forces"
    )
    engine.add_argument(
        "--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"]
    )
    engine.add_argument("--seed", type=int, default=0)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (exit 0 after draining) or an engine fault (exit 1)."""
    import logging

    import anyio

    from agentrt.server.serve import serve
    from agentrt.server.state import ServerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        engine_options={
            "dtype": args.dtype,
            "device": args.device,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory_gb": args.kv_cache_memory_gb,
            "num_kv_blocks": args.num_kv_blocks,
            "block_size": args.block_size,
            "scheduling_policy": args.scheduling_policy,
            "enable_prefix_caching": not args.no_prefix_caching,
            "jump_forward": not args.no_jump_forward,
            "attention_backend": args.attention_backend,
            "seed": args.seed,
        },
    )
    return anyio.run(
        lambda: serve(config, host=args.host, port=args.port, log_level=args.log_level.lower())
    )
