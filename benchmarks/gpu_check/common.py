"""What every stage of the GPU check shares: its context (paths, device, dry run), prompts,
greedy decoding through the public `LLM` API, and the near-tie-aware comparison of two
greedy outputs.

Only public APIs of agentrt are used (`LLM`, `SamplingParams`, the tiny-checkpoint helper),
so the check keeps working while the engine's internals move.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "agent runtime schema token cache block prefix scheduler batch model decode prefill "
    "kernel grammar json object field value request stream latency throughput memory page "
    "attention query key head layer weight tensor sample logit vocabulary context window"
).split()

# Greedy outputs may differ at a near-tie: where the reference's two candidates are within
# this many logits of each other, fp32 reordering of sums can flip the argmax.
NEAR_TIE_LOGITS = 2e-3


class CheckFailed(Exception):
    """A stage's check did not hold (the message says which and by how much)."""


@dataclass(frozen=True, slots=True)
class Context:
    """Where a stage reads and writes, and on what it runs."""

    work: Path  # scratch folder of this run (checkpoints, stage results)
    out: Path  # the folder that comes back ($OUT)
    repo: Path  # the repository root (tests/, benchmarks/)
    tokenizer: Path  # a folder with the embedded model's tokenizer files
    dry_run: bool  # no CUDA: the same stages, tiny, on the CPU
    stage: str = ""  # the running stage
    stage_deadline: float = 0.0  # time.time() by which the running stage must end

    def seconds_left(self) -> float:
        return self.stage_deadline - time.time()

    def save_partial(self, result: dict) -> None:
        """What the stage has measured so far: kept in its record if it is killed."""
        save_json(self.work / "partial" / f"{self.stage}.json", result)

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def checkpoints(self) -> Path:
        return self.work / "checkpoints"

    def checkpoint(self, name: str) -> Path:
        path = self.checkpoints / name
        if not (path / "config.json").is_file():
            raise CheckFailed(
                f"checkpoint {name!r} missing at {path}: the checkpoints stage failed"
            )
        return path


def text_prompts(tokenizer, num_prompts: int, num_tokens: int, seed: int) -> list[list[int]]:
    """`num_prompts` prompts of random words, each exactly `num_tokens` token ids long."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        ids = tokenizer.encode(words, add_special_tokens=False)
        if len(ids) < num_tokens:
            raise AssertionError(f"{num_tokens} words gave only {len(ids)} tokens")
        prompts.append(ids[:num_tokens])
    return prompts


def greedy(llm, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy token ids of every prompt through the public API (EOS ignored)."""
    from agentrt.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def attention_backend_name(llm) -> str | None:
    """The attention backend the engine picked (None where the engine hides it)."""
    runner = getattr(llm.engine, "runner", None)
    attention = getattr(runner, "attention", None)
    return getattr(attention, "name", None)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(
    expected: list[list[int]],
    got: list[list[int]],
    prompts: list[list[int]],
    reference_logits=None,
) -> dict:
    """Compare greedy outputs sequence by sequence. A divergence is excused as a near-tie
    when `reference_logits(token_ids) -> [V]` (the reference's next-token logits after
    `token_ids`) puts the two candidates within NEAR_TIE_LOGITS; everything after the first
    divergence of a sequence is then unchecked. Returns a record with `ok`."""
    divergences = []
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        pos = first_divergence(want, have)
        if pos is None:
            continue
        row = {
            "prompt": i,
            "position": pos,
            "expected": want[pos : pos + 4],
            "got": have[pos : pos + 4],
        }
        if reference_logits is not None and pos < min(len(want), len(have)):
            logits = reference_logits(prompts[i] + want[:pos]).float()
            row["margin"] = round(float(logits[want[pos]] - logits[have[pos]]), 6)
            row["near_tie"] = abs(row["margin"]) <= NEAR_TIE_LOGITS
        divergences.append(row)
    failures = [d for d in divergences if not d.get("near_tie")]
    return {
        "ok": not failures,
        "equal": len(expected) - len(divergences),
        "of": len(expected),
        "divergences": divergences,
    }


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def save_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
