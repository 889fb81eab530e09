"""The main job on the embedded model: chat answers, a batch extraction pipeline into a
Pydantic model, and a tool-calling agent — with what it did and how fast.

Run with `make demo` (or `python examples/demo.py`). The first run builds agentrt's C kernels
for this CPU into the user cache (~12 s on 2 cores); later runs load in 2-3 s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio

import agentrt

sys.path.insert(0, str(Path(__file__).parent))
import agent  # noqa: E402  (examples/agent.py)
import extraction  # noqa: E402  (examples/extraction.py)

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear Python code.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]


async def chat(rt: agentrt.Runtime) -> None:
    """Four conversations at once: the engine batches them continuously."""
    sessions = [rt.session(max_tokens=96) for _ in QUESTIONS]
    answers: list[str] = [""] * len(QUESTIONS)

    async def ask(i: int) -> None:
        answers[i] = await sessions[i].generate(QUESTIONS[i])

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(QUESTIONS)):
            tg.start_soon(ask, i)
    elapsed = time.perf_counter() - start
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"\n> {question}\n{answer.strip()}")
    num_tokens = sum(s.usage.completion_tokens for s in sessions)
    print(f"\nchat: {num_tokens} tokens in {elapsed:.2f}s = {num_tokens / elapsed:.1f} tokens/s")


async def main() -> None:
    start = time.perf_counter()
    # Embedded SmolLM2-135M-Instruct on the CPU, its weights dequantized exactly (fp32): the
    # default runs the file's own Q4_1 blocks with int8 activations (llama.cpp's arithmetic),
    # which tips this 135M model's near-tie on the first question away from Paris.
    async with agentrt.Runtime(dtype="float32") as rt:
        print(f"loaded the embedded model in {time.perf_counter() - start:.1f}s")
        await chat(rt)
        print("\n== extraction ==")
        start = time.perf_counter()
        await extraction.run(rt)
        print(f"extraction: {time.perf_counter() - start:.1f}s")
        print("\n== agent ==")
        await agent.run(rt)


if __name__ == "__main__":
    anyio.run(main)
