"""The main job on the embedded model: answer a batch of chat questions and report speed.

Run with `make demo` (or `python examples/demo.py`). The first run converts the embedded
GGUF once into the user cache (~20 s); later runs start in a few seconds.
"""

from __future__ import annotations

import time

import agentrt

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear Python code.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]


def main() -> None:
    start = time.perf_counter()
    llm = agentrt.LLM()  # embedded SmolLM2-135M-Instruct, fp32 on the CPU
    print(f"loaded {llm.model_path.name} in {time.perf_counter() - start:.1f}s")

    params = agentrt.SamplingParams(temperature=0.0, max_tokens=96)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start

    num_tokens = 0
    for question, output in zip(QUESTIONS, outputs, strict=True):
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"\n> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    print(
        f"\n{len(QUESTIONS)} chats, {num_tokens} tokens in {elapsed:.2f}s: "
        f"{num_tokens / elapsed:.1f} tokens/s (continuous batching on the CPU)"
    )


if __name__ == "__main__":
    main()
