"""Cost of grammar-constrained decoding: a batch of 32 on the embedded model, JSON-schema
constrained vs unconstrained, side by side in one run.

Both sides decode exactly the same number of tokens per request (the constrained run goes
first; the unconstrained run then asks for each request's constrained length with EOS
ignored), so the time per output token compares like with like. Grammars are compiled (and
cached) before timing. Last line: a JSON object.

    python benchmarks/structured_overhead.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

from pydantic import BaseModel, Field

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams


class Item(BaseModel):
    name: str = Field(max_length=30)
    quantity: int = Field(ge=0, le=1000)
    price: float


class Order(BaseModel):
    customer: str = Field(max_length=40)
    email: str = Field(pattern=r"^[a-z0-9.]+@[a-z0-9]+\.[a-z]{2,4}$")
    items: list[Item] = Field(max_length=4)
    express: bool


def timed(llm: LLM, conversations, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    llm = LLM(None, dtype=args.dtype, enable_prefix_caching=False)
    conversations = [
        [{"role": "user", "content": f"Write order number {i} for a customer as JSON."}]
        for i in range(args.batch)
    ]
    constrained = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=160,
            structured_outputs=StructuredOutputsParams(json=Order),
        )
        for i in range(args.batch)
    ]
    llm.chat(conversations[:1], constrained[0])  # compile + cache the grammar, warm up

    t_json, outs = timed(llm, conversations, constrained)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    t_free, _ = timed(llm, conversations, free)
    tokens = sum(lengths)
    tpot_json, tpot_free = t_json / tokens * 1e3, t_free / tokens * 1e3
    valid = sum(o.outputs[0].structured_errors == [] for o in outs)
    print(f"batch {args.batch}, {tokens} output tokens each side ({args.dtype})")
    print(f"unconstrained: {t_free:.2f}s  {tpot_free:.2f} ms/token")
    print(f"JSON schema:   {t_json:.2f}s  {tpot_json:.2f} ms/token  ({valid} valid)")
    print(f"ratio constrained / unconstrained = {tpot_json / tpot_free:.3f} (target <= 1.05)")
    print(
        json.dumps(
            {
                "batch": args.batch,
                "tokens": tokens,
                "ms_per_token_unconstrained": round(tpot_free, 3),
                "ms_per_token_json": round(tpot_json, 3),
                "ratio": round(tpot_json / tpot_free, 3),
                "valid": valid,
            }
        )
    )


if __name__ == "__main__":
    main()
