"""Batch extraction: agentrt `extract_many` vs HF transformers `generate` with xgrammar's HF
logits processor, on the embedded SmolLM2-135M-Instruct, side by side in one run.

Workload: seeded synthetic invoices and contact cards (100-400 tokens each) sharing one
~300-token instruction, extracted into a 6-field schema (an enum, a nested object, number
bounds). Both sides get the same chat-template prompt (system = instruction, user =
document), decode greedily with the same max_new_tokens, dtype and torch thread count.

- agentrt: `rt.extract_many(texts, schema=Record, instructions=...)`, all documents in
  flight (continuous batching; the instruction is prefilled once and served by the prefix
  cache).
- HF: what a user would write without agentrt: padded batches (left padding) through
  `model.generate`, one xgrammar `LogitsProcessor` per batch over a grammar compiled once from
  the same schema. The grammar uses compact separators (", " and ": ", as agentrt emits) so
  both sides decode the same JSON layout.

Both sides are warmed up (grammar compiled, one small batch) before timing. Reported:
documents/s, the ratio agentrt / HF (target >= 3x), the share of outputs valid against the
schema (`Record.model_validate_json`), the share of fields equal to the values the generator
put in each document ("fields true": a speed gain must not hide a quality loss), and how often
both sides extracted the same value (not 100% even in float32: agentrt forces the JSON
skeleton in canonical tokens, e.g. '{"', where the HF model picks its own split, '{' then '"',
and then conditions on it).
Last line: a JSON object with every figure.

    python benchmarks/extraction.py            # 128 documents: ~5 minutes on 2 cores
    python benchmarks/extraction.py --docs 8 --batch-size 4   # smoke test

On a shared machine, compare with `--threads 1` too: when other processes hold the cores,
HF's many small ops stall at OpenMP barriers with 2+ threads (seen: 13x slower), which
inflates the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from enum import StrEnum

import pydantic
import torch
from pydantic import BaseModel, Field

import agentrt
from agentrt.engine.loader.checkpoint import hf_pretrained_args, resolve_model
from agentrt.engine.loader.tokenizer import load_tokenizer


class DocKind(StrEnum):
    invoice = "invoice"
    contact = "contact"


# String bounds keep the worst case (a model that rambles inside strings) within max_tokens.
class Address(BaseModel):
    street: str = Field(max_length=40)
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Record(BaseModel):
    kind: DocKind
    name: str = Field(max_length=40)
    email: str = Field(max_length=40)
    address: Address
    total: float = Field(ge=0, le=1_000_000)
    num_items: int = Field(ge=0, le=50)


INSTRUCTION = """You are a careful data-entry assistant for an accounts department. You receive
one business document at a time: either an invoice sent by a supplier, or a contact card.
Read the whole document, then reply with a single JSON object and nothing else.

The object has exactly these fields:
- "kind": "invoice" if the document bills for goods or services, otherwise "contact".
- "name": for an invoice, the company that issued it (the seller, not the customer being
  billed); for a contact card, the full name of the person.
- "email": the e-mail address of that company or person, copied exactly as written.
- "address": an object with the "street" (number and street), "city" and "country" of that
  company or person, never the billing address of the customer.
- "total": for an invoice, the final amount due including tax, as a plain number without
  currency or thousands separators (for example 1234.5); for a contact card, 0.
- "num_items": for an invoice, the number of line items in the list of goods and services;
  for a contact card, 0.

Copy names, streets and cities exactly as they appear. Never invent a value that is not in
the document. Ignore payment terms, notes and phone numbers."""

FIRST = "Anna Ben Carla David Elena Farid Grace Hugo Ines Jonas Kenji Lena Marco Nadia".split()
LAST = "Meyer Rossi Novak Silva Tanaka Dubois Larsen Okafor Kowalski Haddad Berg Ito".split()
COMPANY = "Northwind Bluepeak Copperleaf Ironbridge Suncrest Greenfield Brightwave".split()
SUFFIX = ["Ltd", "GmbH", "Supplies", "Trading Co", "Logistics", "Systems"]
CITY = [("Berlin", "Germany"), ("Lyon", "France"), ("Porto", "Portugal"), ("Osaka", "Japan")]
CITY += [("Leeds", "United Kingdom"), ("Gdansk", "Poland"), ("Austin", "USA")]
STREET = ["Harbour Road", "Mill Lane", "Station Street", "Kingsway", "Park Avenue", "Rue Verte"]
GOODS = ["printer paper", "toner cartridge", "office chair", "desk lamp", "network cable"]
GOODS += ["consulting hours", "software licence", "cleaning service", "delivery fee"]
NOTES = [
    "Payment is due within 30 days of the invoice date.",
    "Please quote the invoice number on all correspondence.",
    "Late payments may incur interest at the statutory rate.",
    "Goods remain our property until paid in full.",
    "Thank you for your business, we look forward to working with you again.",
    "Bank transfer details are printed on the back of this page.",
    "Met at the regional trade fair; interested in a quote for next quarter.",
    "Prefers to be contacted by e-mail in the morning.",
    "Follow up after the budget meeting in the autumn.",
    "Our warehouse is closed on public holidays; deliveries resume the next working day.",
    "Prices include packaging; shipping to islands is charged separately.",
    "Returns are accepted within 14 days in the original packaging.",
    "Assistant to the board until last year, now responsible for regional purchasing.",
    "Speaks English, German and some Japanese.",
    "Introduced by a colleague from the logistics team.",
]


def make_document(rng: random.Random, num_tokens: int, tokenizer) -> str:
    """One invoice or contact card, filled with line items and notes up to num_tokens."""
    return make_labeled_document(rng, num_tokens, tokenizer)[0]


def make_labeled_document(rng: random.Random, num_tokens: int, tokenizer) -> tuple[str, Record]:
    """`make_document` (the same text for the same rng state) and the values it put in the
    document: the record a perfect extraction returns."""
    city, country = rng.choice(CITY)
    street = f"{rng.randint(1, 250)} {rng.choice(STREET)}"
    if rng.random() < 0.6:
        seller = f"{rng.choice(COMPANY)} {rng.choice(SUFFIX)}"
        email = f"billing@{seller.split()[0].lower()}.com"
        head = [
            f"INVOICE No. {rng.randint(10000, 99999)}  Date: 2024-{rng.randint(1, 12):02d}-"
            f"{rng.randint(1, 28):02d}",
            f"From: {seller}, {street}, {city}, {country}. E-mail: {email}",
            f"Bill to: {rng.choice(FIRST)} {rng.choice(LAST)}, {rng.randint(1, 99)} "
            f"{rng.choice(STREET)}, {rng.choice(CITY)[0]}",
            "Items:",
        ]
        items: list[str] = []
        while len(tokenizer.encode("\n".join(head + items))) < num_tokens * 0.6 and len(items) < 20:
            qty, price = rng.randint(1, 20), rng.randint(2, 900) + rng.choice([0, 0.5, 0.99])
            items.append(f"{len(items) + 1}. {rng.choice(GOODS)}  qty {qty} x {price:.2f} EUR")
        total = f"{rng.randint(50, 90000)}.{rng.randint(0, 99):02d}"
        body = head + items + [f"Total due (incl. VAT): {total} EUR"]
        kind, name, num_items = DocKind.invoice, seller, len(items)
    else:
        person = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        email = f"{person.lower().replace(' ', '.')}@{rng.choice(COMPANY).lower()}.com"
        body = [
            "Contact card",
            f"Name: {person}",
            f"Position: {rng.choice(['Buyer', 'Head of Procurement', 'Sales Manager'])}",
            f"Address: {street}, {city}, {country}",
            f"E-mail: {email}  Phone: +{rng.randint(10, 99)} {rng.randint(100000, 999999)}",
        ]
        kind, name, total, num_items = DocKind.contact, person, "0", 0
    notes: list[str] = []
    deck = rng.sample(NOTES, len(NOTES))  # shuffled rounds of NOTES, so repeats are rare
    while len(tokenizer.encode("\n".join(body + notes + deck[-1:]))) <= num_tokens:
        notes.append(deck.pop())
        deck = deck or rng.sample(NOTES, len(NOTES))
    address = Address(street=street, city=city, country=country)
    truth = Record(
        kind=kind, name=name, email=email, address=address, total=float(total), num_items=num_items
    )
    return "\n".join(body + notes), truth


def flat_fields(record: Record) -> dict:
    """The record's 8 values by field name ("address.city", ...)."""
    flat = record.model_dump(mode="json")
    flat.update({f"address.{k}": v for k, v in flat.pop("address").items()})
    return flat


def fields_true(records: list[Record | None], truths: list[Record]) -> float:
    """The share of fields, over all documents, equal to the values the generator put in
    the document (an invalid or missing output counts all its fields as wrong)."""
    num_true = num_fields = 0
    for record, truth in zip(records, truths, strict=True):
        want = flat_fields(truth)
        have = flat_fields(record) if record is not None else {}
        num_fields += len(want)
        num_true += sum(have.get(k) == v for k, v in want.items())
    return num_true / max(1, num_fields)


def validate(text: str) -> Record | None:
    try:
        return Record.model_validate_json(text)
    except pydantic.ValidationError:
        return None


async def run_agentrt(args, texts: list[str], warmup: list[str]) -> tuple[float, list, int]:
    options = dict(
        schema=Record,
        instructions=INSTRUCTION,
        concurrency=args.concurrency,
        progress=False,
        max_tokens=args.max_tokens,
    )
    async with agentrt.Runtime(dtype=args.dtype, seed=args.seed) as rt:
        await rt.extract_many(warmup, **options)  # compile the grammar, warm up
        start = time.perf_counter()
        results = await rt.extract_many(texts, **options)
        elapsed = time.perf_counter() - start
    return elapsed, results, torch.get_num_threads()


def run_hf(model, tokenizer, grammar, texts: list[str], args):
    """Padded static batches (left padding), one xgrammar processor per batch. Returns the
    time, the output texts, the number of output tokens and each prompt's length."""
    import xgrammar as xgr

    outputs: list[str] = []
    num_tokens, prompt_lens = 0, []
    start = time.perf_counter()
    for i in range(0, len(texts), args.batch_size):
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for text in texts[i : i + args.batch_size]
        ]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_lens += batch["attention_mask"].sum(dim=1).tolist()
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=args.max_tokens,
                do_sample=False,
                logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, batch["input_ids"].shape[1] :]  # (B, T_new), EOS then padding when done
        for row in new.tolist():
            n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            num_tokens += n
            outputs.append(tokenizer.decode(row[:n], skip_special_tokens=True))
    return time.perf_counter() - start, outputs, num_tokens, prompt_lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="HF padded batch size")
    parser.add_argument("--concurrency", type=int, default=None, help="agentrt (default: --docs)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or args.docs
    if args.threads:
        torch.set_num_threads(args.threads)

    import xgrammar as xgr
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    path, hf_kwargs = hf_pretrained_args(resolve_model(None))
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.padding_side = "left"
    rng = random.Random(args.seed)
    labeled = [
        make_labeled_document(rng, rng.randint(120, 400), tokenizer) for _ in range(args.docs)
    ]
    texts, truths = [text for text, _ in labeled], [truth for _, truth in labeled]
    warmup = [make_document(rng, 120, tokenizer) for _ in range(2)]
    doc_tokens = [len(tokenizer.encode(t)) for t in texts]
    print(
        f"{args.docs} documents, {min(doc_tokens)}-{max(doc_tokens)} tokens "
        f"(mean {sum(doc_tokens) / len(doc_tokens):.0f}); instruction "
        f"{len(tokenizer.encode(INSTRUCTION))} tokens; max_tokens {args.max_tokens}; {args.dtype}"
    )

    ours_s, results, threads = asyncio.run(run_agentrt(args, texts, warmup))
    # extract_many already validated each value with Pydantic; check it again the same way.
    ours_valid = [validate(r.value.model_dump_json()) if r.ok else None for r in results]
    usages = [r.usage for r in results if r.usage is not None]
    ours_tokens = sum(u.completion_tokens for u in usages)
    prompt_tokens = max(sum(u.prompt_tokens for u in usages), 1)
    cached_share = sum(u.cached_tokens for u in usages) / prompt_tokens

    torch.set_num_threads(threads)  # the engine may have set it (AGENTRT_NUM_THREADS)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=GgufConfig(dequantize=True), **hf_kwargs
    ).eval()
    vocab_size = AutoConfig.from_pretrained(path, **hf_kwargs).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        Record, any_whitespace=False, separators=(", ", ": ")
    )
    run_hf(model, tokenizer, grammar, warmup, args)
    hf_s, hf_texts, hf_tokens, hf_prompt_lens = run_hf(model, tokenizer, grammar, texts, args)
    hf_valid = [validate(t) for t in hf_texts]
    ours_prompt_lens = [r.usage.prompt_tokens if r.usage else None for r in results]
    if ours_prompt_lens != hf_prompt_lens:  # both sides must see the very same prompts
        print(f"WARNING: prompt lengths differ: {ours_prompt_lens} vs {hf_prompt_lens}")

    n = args.docs
    ours, theirs = n / ours_s, n / hf_s
    ours_share = sum(v is not None for v in ours_valid) / n
    hf_share = sum(v is not None for v in hf_valid) / n
    same = sum(a is not None and a == b for a, b in zip(ours_valid, hf_valid, strict=True)) / n
    ours_true, hf_true = fields_true(ours_valid, truths), fields_true(hf_valid, truths)
    print(
        f"agentrt: {ours_s:6.1f}s  {ours:6.2f} docs/s  {ours_tokens} output tokens  "
        f"valid {ours_share:.1%}  fields true {ours_true:.1%}  prompt tokens cached "
        f"{cached_share:.1%} "
        f"(concurrency {args.concurrency})"
    )
    print(
        f"HF:      {hf_s:6.1f}s  {theirs:6.2f} docs/s  {hf_tokens} output tokens  "
        f"valid {hf_share:.1%}  fields true {hf_true:.1%}  (batches of {args.batch_size})"
    )
    print(f"ratio agentrt / HF = {ours / theirs:.2f}x (target >= 3x); same value {same:.1%}")
    for r in [r for r in results if ours_valid[r.index] is None][:3]:
        print(
            f"agentrt doc {r.index} invalid: {r.error!r}\n  output: {getattr(r.error, 'text', None)!r}"
        )
    for i in [i for i, v in enumerate(hf_valid) if v is None][:3]:
        print(f"HF doc {i} invalid: {hf_texts[i]!r}")
    print(
        json.dumps(
            {
                "docs": n,
                "dtype": args.dtype,
                "threads": threads,
                "max_tokens": args.max_tokens,
                "batch_size": args.batch_size,
                "concurrency": args.concurrency,
                "agentrt_s": round(ours_s, 2),
                "agentrt_docs_s": round(ours, 3),
                "agentrt_output_tokens": ours_tokens,
                "agentrt_valid": round(ours_share, 4),
                "agentrt_fields_true": round(ours_true, 4),
                "agentrt_cached_prompt_share": round(cached_share, 4),
                "hf_s": round(hf_s, 2),
                "hf_docs_s": round(theirs, 3),
                "hf_output_tokens": hf_tokens,
                "hf_valid": round(hf_share, 4),
                "hf_fields_true": round(hf_true, 4),
                "ratio": round(ours / theirs, 2),
                "same_value": round(same, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
