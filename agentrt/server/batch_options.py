"""The options of the Files and Batch APIs (`agentrt serve --state-dir ...`, a frozen record
and its flags) and of `agentrt run-batch`. Kept apart from the routes so the server's config
and the CLI import them without FastAPI."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from agentrt.engine.args import EngineArgs

MAX_FILE_BYTES = 200 * 2**20  # OpenAI's cap on one batch input file
MAX_STORAGE_BYTES = 2 * 2**30
MAX_CONCURRENCY = 32
COMPLETION_WINDOWS = ("24h",)  # OpenAI's only value
_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(window: str) -> int | None:
    """The seconds of a completion window written as OpenAI's "24h" is ("90s", "30m", "2h");
    None when it is not one."""
    match = _WINDOW.fullmatch(window)
    return None if match is None else int(match[1]) * _UNIT_S[match[2]]


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """`state_dir`: where files and batches live; None keeps them in a temporary directory
    removed when the server stops (no batch survives a restart). `max_storage_bytes` bounds
    everything under it (uploads, batch journals, output files): past it uploads get a 413
    and a running batch fails. `max_concurrency`: requests of all batches in flight at once.
    `completion_windows`: the `completion_window` values a batch may ask for (OpenAI accepts
    "24h" only; others, such as "1h" or "90s", shorten the window, for tests above all)."""

    state_dir: str | None = None
    max_file_bytes: int = MAX_FILE_BYTES
    max_storage_bytes: int = MAX_STORAGE_BYTES
    max_concurrency: int = MAX_CONCURRENCY
    completion_windows: tuple[str, ...] = COMPLETION_WINDOWS

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_storage_bytes", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected >= 1.")
        bad = [w for w in self.completion_windows if window_seconds(w) is None]
        if bad or not self.completion_windows:
            raise ValueError(
                f"completion_windows={list(self.completion_windows)} is invalid: expected one "
                'or more durations written as "24h", "30m" or "90s".'
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BatchConfig:
        return cls(
            state_dir=args.state_dir,
            max_file_bytes=args.max_file_bytes,
            max_storage_bytes=args.max_storage_bytes,
            max_concurrency=args.max_batch_concurrency,
            completion_windows=tuple(args.batch_completion_windows),
        )


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("files and batches (/v1/files, /v1/batches)")
    group.add_argument(
        "--state-dir",
        default=None,
        help="keep uploaded files and batches here, and resume unfinished batches from it on "
        "start (default: a temporary directory, gone when the server stops)",
    )
    group.add_argument(
        "--max-file-bytes", type=int, default=MAX_FILE_BYTES, help="the largest upload"
    )
    group.add_argument(
        "--max-storage-bytes",
        type=int,
        default=MAX_STORAGE_BYTES,
        help="bytes the state directory may hold (uploads, journals, outputs)",
    )
    group.add_argument(
        "--max-batch-concurrency",
        type=int,
        default=MAX_CONCURRENCY,
        help="requests of all batches in flight at once",
    )
    group.add_argument(
        "--batch-completion-windows",
        nargs="+",
        default=list(COMPLETION_WINDOWS),
        metavar="WINDOW",
        help="completion_window values a batch may ask for (default: OpenAI's only one, 24h; "
        'e.g. "24h 1h"); a batch not finished by its window expires',
    )


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="OpenAI batch input (.jsonl)")
    parser.add_argument("-o", "--output-file", required=True, help="batch output (.jsonl)")
    parser.add_argument("--resume", action="store_true", help="skip the lines already in -o")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--concurrency", type=int, default=32, help="lines in flight at once")
    parser.add_argument("--served-model-name", default=None, help="the model lines name")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight lines may finish after SIGINT/SIGTERM before being aborted",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
