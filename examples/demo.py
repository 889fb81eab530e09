"""The main job on the embedded model: chat answers and grammar-constrained extraction into
a Pydantic model, with what it did and how fast.

Run with `make demo` (or `python examples/demo.py`). The first run converts the embedded
GGUF once into the user cache (~20 s); later runs start in a few seconds.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

import agentrt

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear Python code.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about the sea.",
]
FACTS = [
    "John Smith is 42 years old and works as a plumber in Boston.",
    "Maria Garcia, 29, is a software engineer living in Madrid.",
    "The retired teacher Li Wei (67) lives in Shanghai.",
]


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    occupation: str = Field(max_length=40)
    city: str = Field(max_length=40)


def main() -> None:
    start = time.perf_counter()
    llm = agentrt.LLM()  # embedded SmolLM2-135M-Instruct, fp32 on the CPU
    print(f"loaded {llm.model_path.name} in {time.perf_counter() - start:.1f}s")

    # 1. Chat: four conversations in one continuous batch.
    params = agentrt.SamplingParams(temperature=0.0, max_tokens=96)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for question, output in zip(QUESTIONS, outputs, strict=True):
        completion = output.outputs[0]
        print(f"\n> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    print(f"\nchat: {num_tokens} tokens in {elapsed:.2f}s = {num_tokens / elapsed:.1f} tokens/s")

    # 2. Extraction: decoding is constrained to Person's JSON schema, so it always parses.
    extract = agentrt.SamplingParams(
        temperature=0.0,
        max_tokens=80,
        structured_outputs=agentrt.StructuredOutputsParams(json=Person),
    )
    system = {"role": "system", "content": "Extract the person described as JSON."}
    start = time.perf_counter()
    outputs = llm.chat([[system, {"role": "user", "content": f}] for f in FACTS], extract)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print()
    for fact, output in zip(FACTS, outputs, strict=True):
        person = Person.model_validate_json(output.outputs[0].text)
        print(f"{fact}\n  -> {person!r}")
    print(f"extraction: {len(FACTS)} objects, {num_tokens} tokens in {elapsed:.2f}s")


if __name__ == "__main__":
    main()
