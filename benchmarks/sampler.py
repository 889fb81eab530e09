"""The sampler over a 150k-token vocabulary (Qwen2.5's 151,936), one request and a few:
the full path (torch.argmax; softmax, top-k, top-p over the whole row, then the draw) vs
what `Sampler` runs now (kernels/cpu_sampling.c's argmax and top-k; softmax, top-p and the
draw over a top-k row's k candidates or a top-p row's 256; an untruncated row's softmax and
draw in one kernel), side by side in one process, alternating, medians. Two kinds of logits: "flat", random normal times 3 (a top-p row's
nucleus then spans thousands of tokens: the full path, after the candidates' try), and
"peaked", random normal with 30 tokens raised by 12 (the nucleus within the 256 most likely
tokens, as a trained model's often is).

    python benchmarks/sampler.py [--vocab 151936] [--rows 1,4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.worker.sampler import Sampler, draw_inverse_cdf, random_probs
from agentrt.engine.worker.sampling_metadata import SamplingMetadata

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "t=1.0 (the default)": SamplingParams(temperature=1.0),
    "top_k=20 top_p=0.8 t=0.7": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    "top_k=40 t=1.0": SamplingParams(temperature=1.0, top_k=40),
    "top_p=0.9 t=0.7": SamplingParams(temperature=0.7, top_p=0.9),
}


def full_path(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    uniform = torch.rand(logits.shape[0], 1)
    return draw_inverse_cdf(random_probs(logits, metadata, None), uniform)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("model name")), ":unknown")
    return line.split(":", 1)[1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}; {args.threads} threads, vocab {args.vocab}")
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    for rows, kind in ((int(r), k) for r in args.rows.split(",") for k in ("flat", "peaked")):
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        if kind == "peaked":
            logits /= 3
            for row in logits:
                row[torch.randperm(args.vocab, generator=gen)[:30]] += 12
        for name, params in CASES.items():
            metadata = SamplingMetadata.build(
                [params] * rows, [[]] * rows, [[]] * rows, [None] * rows, [()] * rows,
                args.vocab, "cpu",
            )  # fmt: skip
            times = {"full": [], "now": []}
            for _ in range(args.repeats + 1):
                for side, fn in (("full", full_path), ("now", sampler)):
                    x = logits.clone()
                    t0 = time.perf_counter()
                    fn(x, metadata)
                    times[side].append(time.perf_counter() - t0)
            full, now = (statistics.median(times[s][1:]) * 1e6 for s in ("full", "now"))
            print(
                f"rows {rows:2} {kind:6} {name:26} full {full:9.1f} us  now {now:9.1f} us  "
                f"x{full / now:.1f}"
            )


if __name__ == "__main__":
    main()
