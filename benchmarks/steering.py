"""Budget steering's cost in quality: the extraction workload of benchmarks/extraction.py run
twice on the same documents, once with a max_tokens below the schema's worst case (the
grammar steers the reply to close within it) and once with room to spare (nothing steered:
the reference). Steering should shorten only what would not fit; every field the model
wrote the same way within the budget is one steering left alone.

Reported: replies steered, steered tokens per reply, the share of fields equal to the
reference's, and whole replies equal to it. Last line: a JSON object with every figure.

    python benchmarks/steering.py                    # 32 documents, budget 120 vs 400
    python benchmarks/steering.py --docs 8 --budget 96
"""

from __future__ import annotations

import argparse
import json
import random
import time

import pydantic
from extraction import INSTRUCTION, Record, make_document

from agentrt.engine import LLM, SamplingParams, StructuredOutputsParams


def extract(llm: LLM, texts: list[str], max_tokens: int) -> list:
    """Greedy, all documents in one batch; the engine's completion outputs."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=Record),
    )
    conversations = [
        [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}]
        for text in texts
    ]
    return [out.outputs[0] for out in llm.chat(conversations, params)]


def fields(text: str) -> dict:
    try:
        record = Record.model_validate_json(text)
    except pydantic.ValidationError:
        return {}
    flat = record.model_dump(mode="json")
    flat.update({f"address.{k}": v for k, v in flat.pop("address").items()})
    return flat


def run(args) -> dict:
    rng = random.Random(args.seed)
    llm = LLM(dtype=args.dtype)
    texts = [make_document(rng, rng.randint(100, 400), llm.tokenizer) for _ in range(args.docs)]
    start = time.perf_counter()
    reference = extract(llm, texts, args.reference)
    budgeted = extract(llm, texts, args.budget)
    elapsed = time.perf_counter() - start
    same_fields = total_fields = same_replies = 0
    for ref, got in zip(reference, budgeted, strict=True):
        want, have = fields(ref.text), fields(got.text)
        total_fields += len(want)
        same_fields += sum(have.get(k) == v for k, v in want.items())
        same_replies += bool(want) and want == have
    steered = [c.num_steered_tokens for c in budgeted]
    return {
        "docs": args.docs,
        "budget": args.budget,
        "reference": args.reference,
        "reference_steered": sum(c.num_steered_tokens > 0 for c in reference),
        "valid": sum(bool(fields(c.text)) for c in budgeted),
        "steered_replies": sum(n > 0 for n in steered),
        "steered_tokens_per_reply": round(sum(steered) / len(steered), 1),
        "field_agreement": round(same_fields / max(1, total_fields), 3),
        "reply_agreement": round(same_replies / args.docs, 3),
        "seconds": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--budget", type=int, default=120, help="max_tokens under test")
    parser.add_argument("--reference", type=int, default=400, help="max_tokens with room")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    result = run(parser.parse_args())
    print(
        f"{result['docs']} documents, max_tokens {result['budget']} vs {result['reference']}: "
        f"{result['steered_replies']} replies steered ({result['steered_tokens_per_reply']} "
        f"tokens each), fields equal to the unsteered reply: {result['field_agreement']:.1%}, "
        f"whole replies: {result['reply_agreement']:.1%}, valid {result['valid']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
