"""Applying a step's grammar bitmask on the CPU: the reference kernel (every bit of every row
unpacked into a [R, V] bool tensor) vs engine/worker/grammar_mask.py (a word at a time),
side by side in one process, alternating, medians of CPU time (the thread's: on a shared
machine wall time mostly measures the other processes; one torch thread by default, since the
thread's CPU time then holds all the work).

Masks: the real ones of a batched extraction (extraction.py's schema and documents on the
embedded SmolLM2, all requests in flight; each step's bitmask recorded as the engine made
it), and grammar-like rows over Qwen2.5's 151,936 tokens ("few": 5 tokens allowed, as
between JSON tokens; "most": all but 50, as inside a string) at 1-64 rows.

    python benchmarks/grammar_mask.py [--docs 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# This folder goes last on the module path: its gguf.py must not hide gguf-py.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from extraction import INSTRUCTION, Record, make_labeled_document  # noqa: E402

from agentrt.engine.core.structured_output import StructuredOutputManager  # noqa: E402
from agentrt.engine.worker.grammar_mask import apply_grammar_bitmask  # noqa: E402
from agentrt.kernels import apply_token_bitmask_ref  # noqa: E402


def recorded_masks(num_docs: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(bitmask, rows, vocab) of every step of a batched extraction on the embedded model."""
    from agentrt.engine.client.llm import LLM
    from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

    steps = []
    original = StructuredOutputManager.bitmask

    def record(self, requests, drafts=None):
        grammar = original(self, requests, drafts)
        if grammar is not None and len(grammar.rows):
            steps.append((grammar.bitmask.clone(), grammar.rows.clone(), self.vocab_size))
        return grammar

    StructuredOutputManager.bitmask = record
    try:
        llm = LLM()
        rng = random.Random(0)
        tokenizer = llm.get_tokenizer()
        docs = [
            make_labeled_document(rng, rng.randint(120, 400), tokenizer)[0] for _ in range(num_docs)
        ]
        params = SamplingParams(
            max_tokens=256,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=Record.model_json_schema()),
        )
        llm.chat(
            [
                [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": d}]
                for d in docs
            ],
            params,
        )
    finally:
        StructuredOutputManager.bitmask = original
    return steps


def synthetic(kind: str, num_rows: int, vocab: int) -> torch.Tensor:
    import numpy as np

    gen = torch.Generator().manual_seed(num_rows)
    allowed = torch.full((num_rows, -(-vocab // 32) * 32), kind == "most", dtype=torch.bool)
    count = 5 if kind == "few" else 50
    ids = torch.randint(0, vocab, (num_rows * count,), generator=gen)
    allowed[torch.arange(num_rows).repeat_interleave(count), ids] = kind == "few"
    packed = np.packbits(allowed.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


def timed(fn, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> float:
    work = logits.clone()
    start = time.thread_time()
    fn(work, bitmask, rows)
    return time.thread_time() - start


def compare(cases, rounds: int) -> tuple[float, float]:
    """Total ms a pass over `cases` (bitmask, rows, vocab) takes, median of `rounds`, each
    side in turn."""
    logits = {v: torch.randn(64, v) for v in {v for _, _, v in cases}}
    totals = {"ref": [], "words": []}
    for i in range(rounds):
        sides = [("ref", apply_token_bitmask_ref), ("words", apply_grammar_bitmask)]
        for name, fn in sides[:: 1 - 2 * (i % 2)]:
            total = 0.0
            for bitmask, rows, vocab in cases:
                total += timed(fn, logits[vocab][: bitmask.shape[0]], bitmask, rows)
            totals[name].append(total * 1e3)
    return statistics.median(totals["ref"]), statistics.median(totals["words"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "unknown CPU",
    )
    print(f"CPU: {cpu}, torch threads {args.threads}; load average {os.getloadavg()}")
    steps = recorded_masks(args.docs)
    torch.set_num_threads(args.threads)
    ref, words = compare(steps, args.rounds)
    num_rows = statistics.mean(len(rows) for _, rows, _ in steps)
    mixed = statistics.median(
        float(((bitmask[rows] != 0) & (bitmask[rows] != -1)).float().mean())
        for bitmask, rows, _ in steps
    )
    print(
        f"extraction on the embedded model, {len(steps)} steps ({num_rows:.1f} rows a step, "
        f"{mixed:.0%} of words mixed, median; "
        f"vocab {steps[0][2]}): reference {ref:.1f} ms, by words {words:.1f} ms, "
        f"{ref / words:.2f}x"
    )
    vocab = 151936
    for kind in ("few", "most"):
        for num_rows in (1, 8, 16, 64):
            case = [(synthetic(kind, num_rows, vocab), torch.arange(num_rows), vocab)]
            ref, words = compare(case * 10, args.rounds)
            print(
                f"{kind:4s} allowed, {num_rows:2d} rows, vocab {vocab}: reference "
                f"{ref / 10:.2f} ms, by words {words / 10:.2f} ms, {ref / words:.2f}x"
            )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
