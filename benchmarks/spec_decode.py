"""Speculative decoding: drafting off vs each method, side by side in one run, bf16, greedy, on
the embedded SmolLM2-135M-Instruct through the `LLM` API.

Configurations, one engine each, built once, warmed up, and held together: each request (or
batch, or chat turn) runs on every configuration in turn, the first one rotating, so a shared
machine's load changes hit them all alike:
  off       no drafting, jump-forward on (the engine's default: the baseline of every ratio)
  off-nojf  no drafting, jump-forward off (structured workloads only)
  ngram     n-gram prompt lookup over the request's own tokens
  suffix    suffix cache over earlier outputs with the same schema and prompt head
  grammar   the tokens the grammar forces, drafted and verified (replaces jump-forward;
            structured workloads only: it has nothing to draft in free text)
  draft_model only with --draft-model PATH: no smaller model shares SmolLM2-135M's vocabulary
            (it is the smallest SmolLM2), so by default it is skipped.
Drafting is adaptive (the engine's default; --no-adaptive turns it off) with each method's
default number of draft tokens unless --num-speculative-tokens is given.

Workloads:
  (a) extraction  documents of benchmarks/extraction.py (invoices and contact cards whose
      fields are copied from the text) into its 6-field schema; the generator knows each
      document's values, so "fields true" (the share of fields equal to them) is printed for
      every configuration: a speed gain can never hide a quality loss.
  (b) chat        multi-turn conversations, free text (max_tokens --chat-tokens): each turn's
      prompt is the history (with the configuration's own replies) + a new user message.
  (c) tools       repeated agent tool calls: one system prompt and four tools, a different
      user request each time, replies constrained to one call (`GrammarSpec.from_tools`);
      "fields true" = tool name and arguments equal to the values stated in the request.
Each in three modes, on distinct inputs (so the suffix cache never sees an exact repeat):
single (requests one at a time, sequentially), batch (--batch-size at once, default 8) and,
with --batch64, one batch of 64 (no request drafts while more than the engine's
`disable_by_batch_size`, 16, run: there the check is that drafting costs nothing).

Reported per configuration: output tokens / wall time (tokens/s), the speedup over `off` in
the same workload and mode, acceptance rate and mean accepted length (of the timed requests
only), the share of outputs equal to `off`'s, the workload's quality figure and, in single
mode, decode tokens/s (prefill excluded). Targets, reported, not enforced: (a) single request
>= 2x off; (b) never slower than off; batch of 64 >= 0.95x off. Last line: a JSON object with
every figure.

    python benchmarks/spec_decode.py                # ~10 minutes on 2 idle cores
    python benchmarks/spec_decode.py --batch64      # + batches of 64 (~5 minutes more)
    python benchmarks/spec_decode.py --quick        # smaller workloads (~4 minutes)
    python benchmarks/spec_decode.py --workloads tools --configs off,suffix --single 2 --batch 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field

import torch
from extraction import (
    CITY,
    COMPANY,
    FIRST,
    INSTRUCTION,
    LAST,
    NOTES,
    Record,
    fields_true,
    make_labeled_document,
    validate,
)

from agentrt.engine import LLM, SamplingParams, StructuredOutputsParams
from agentrt.grammar import GrammarSpec
from agentrt.tool_calls import tools_instructions

# name -> (speculative_config, jump_forward)
CONFIGS: dict[str, tuple[dict | None, bool]] = {
    "off": (None, True),
    "off-nojf": (None, False),
    "ngram": ({"method": "ngram"}, True),
    "suffix": ({"method": "suffix"}, True),
    "grammar": ({"method": "grammar"}, True),  # the engine turns jump-forward off for it
}
STRUCTURED_ONLY = {"off-nojf", "grammar"}

# -- (b) chat ----------------------------------------------------------------------------------

PRODUCTS = [
    "a reusable steel water bottle",
    "a folding city bike",
    "a noise-cancelling headset",
    "an electric standing desk",
    "a home espresso machine",
    "a lightweight hiking backpack",
    "a smart radiator thermostat",
    "a cast-iron frying pan",
    "a solar phone charger",
    "a wool winter coat",
    "a robot vacuum cleaner",
    "a mechanical keyboard",
]
CHAT_TURNS = [
    "Write a short product description of {product} for an online shop.",
    "Rewrite your description in a more formal tone, keeping every fact.",
    "List the three main selling points from your description as bullet points.",
    "Repeat the description once more, word for word, then add one sentence about delivery.",
]

# -- (c) tools ---------------------------------------------------------------------------------


def _function(name: str, description: str, properties: dict) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


TOOLS = [
    _function(
        "get_weather",
        "The current weather in a city.",
        {"city": _text(30), "unit": {"enum": ["celsius", "fahrenheit"]}},
    ),
    _function(
        "search_flights",
        "Flights between two cities on a date (YYYY-MM-DD).",
        {"origin": _text(30), "destination": _text(30), "date": _text(10)},
    ),
    _function(
        "send_email",
        "Send an e-mail.",
        {"to": _text(40), "subject": _text(60), "body": _text(200)},
    ),
    _function(
        "create_event",
        "Put a meeting in the calendar (date YYYY-MM-DD, time HH:MM).",
        {
            "title": _text(40),
            "date": _text(10),
            "time": _text(5),
            "attendees": {"type": "array", "items": _text(30), "maxItems": 4},
        },
    ),
]
TOOLS_SYSTEM = (
    "You are an office assistant. For every request, call the one tool that does what the "
    "user asks, with the argument values copied exactly from the request.\n\n"
    + tools_instructions(TOOLS, parallel=False)
)
SUBJECTS = ["Quarterly report", "Invoice 4471", "Team lunch on Friday", "Contract renewal"]
TITLES = ["Budget review", "Supplier call", "Project kickoff", "Hiring panel", "Weekly sync"]


def make_tool_request(rng: random.Random) -> tuple[str, dict]:
    """A user request and the call that does it: {"name": ..., "arguments": {...}}."""
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    kind = rng.randrange(4)
    if kind == 0:
        city, unit = rng.choice(CITY)[0], rng.choice(["celsius", "fahrenheit"])
        text = f"What is the weather like in {city} right now? Give me the temperature in {unit}."
        return text, {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
    if kind == 1:
        origin, destination = (c[0] for c in rng.sample(CITY, 2))
        text = f"Find me a flight from {origin} to {destination} on {date}."
        arguments = {"origin": origin, "destination": destination, "date": date}
        return text, {"name": "search_flights", "arguments": arguments}
    if kind == 2:
        person = f"{rng.choice(FIRST).lower()}.{rng.choice(LAST).lower()}"
        to = f"{person}@{rng.choice(COMPANY).lower()}.com"
        subject, body = rng.choice(SUBJECTS), rng.choice(NOTES)
        text = f'Send an e-mail to {to} with the subject "{subject}" and this text: {body}'
        arguments = {"to": to, "subject": subject, "body": body}
        return text, {"name": "send_email", "arguments": arguments}
    title, clock = rng.choice(TITLES), f"{rng.randint(8, 17):02d}:{rng.choice([0, 30]):02d}"
    attendees = [f"{rng.choice(FIRST)} {rng.choice(LAST)}" for _ in range(rng.randint(1, 3))]
    text = (
        f'Put a meeting called "{title}" in my calendar on {date} at {clock} with '
        f"{' and '.join(attendees)}."
    )
    arguments = {"title": title, "date": date, "time": clock, "attendees": attendees}
    return text, {"name": "create_event", "arguments": arguments}


def call_quality(texts: list[str], truths: list[dict]) -> dict[str, float]:
    """The share of replies that are one call ({"name": str, "arguments": object}), and of
    tool names and argument values equal to the request's (a field missing counts wrong)."""
    num_valid = num_true = num_fields = 0
    for text, truth in zip(texts, truths, strict=True):
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            call = None
        call = call if isinstance(call, dict) else {}
        arguments = call.get("arguments") if isinstance(call.get("arguments"), dict) else None
        num_valid += isinstance(call.get("name"), str) and arguments is not None
        num_fields += 1 + len(truth["arguments"])
        num_true += call.get("name") == truth["name"]
        num_true += sum((arguments or {}).get(k) == v for k, v in truth["arguments"].items())
    return {"valid": num_valid / len(texts), "fields_true": num_true / max(1, num_fields)}


# -- workloads ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """Conversations to run: each is a system prompt (None: the template's) and user turns."""

    name: str
    structured: bool
    params: SamplingParams
    # mode -> conversations, and the true values of each (extraction and tools)
    items: dict[str, list[tuple[str | None, list[str]]]]
    truths: dict[str, list] = field(default_factory=dict)

    def quality(self, mode: str, texts: list[str]) -> dict[str, float]:
        if mode not in self.truths:
            return {}
        if self.name == "extraction":
            records = [validate(t) for t in texts]
            return {
                "valid": sum(r is not None for r in records) / len(records),
                "fields_true": fields_true(records, self.truths[mode]),
            }
        if self.name == "tools":
            return call_quality(texts, self.truths[mode])
        return {}


def build_workloads(args, tokenizer) -> tuple[list[Workload], dict[str, int]]:
    """The workloads asked for, each with distinct inputs per mode (and 2 to warm up), and
    the batch size of each mode."""
    rng = random.Random(args.seed)
    modes = {"warmup": 2, "single": 1, "batch": args.batch_size}
    if args.batch64:
        modes["batch64"] = 64
    # mode -> number of conversations: a few groups of the mode's size for the one-turn
    # workloads, one group for chat (each of its turns is a call).
    requests = {"warmup": 2, "single": args.single, "batch": args.batch, "batch64": 64}
    conversations = {"warmup": 2, "single": args.chat_single, "batch": args.batch_size}
    conversations["batch64"] = 64
    workloads = []
    if "extraction" in args.workloads:
        items, truths = {}, {}
        for mode in modes:
            docs = [
                make_labeled_document(rng, rng.randint(120, 400), tokenizer)
                for _ in range(requests[mode])
            ]
            items[mode] = [(INSTRUCTION, [text]) for text, _ in docs]
            truths[mode] = [truth for _, truth in docs]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=args.extraction_tokens,
            structured_outputs=StructuredOutputsParams(json=Record),
        )
        workloads.append(Workload("extraction", True, params, items, truths))
    if "chat" in args.workloads:
        turns = CHAT_TURNS[: args.turns]
        items = {
            mode: [
                (None, [turns[0].format(product=rng.choice(PRODUCTS)), *turns[1:]])
                for _ in range(conversations[mode])
            ]
            for mode in modes
        }
        params = SamplingParams(temperature=0.0, max_tokens=args.chat_tokens)
        workloads.append(Workload("chat", False, params, items))
    if "tools" in args.workloads:
        items, truths = {}, {}
        for mode in modes:
            calls = [make_tool_request(rng) for _ in range(requests[mode])]
            items[mode] = [(TOOLS_SYSTEM, [text]) for text, _ in calls]
            truths[mode] = [call for _, call in calls]
        spec = GrammarSpec.from_tools(TOOLS, "required", parallel_tool_calls=False)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=args.tool_tokens,
            structured_outputs=StructuredOutputsParams(spec=spec),
        )
        workloads.append(Workload("tools", True, params, items, truths))
    return workloads, modes


# -- measuring ---------------------------------------------------------------------------------


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    stats = llm.engine.stats().spec_decode
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


@dataclass(slots=True)
class Tally:
    """What one configuration did in one mode."""

    seconds: float = 0.0
    num_tokens: int = 0
    decode_s: float = 0.0  # first token to finish, summed over requests
    num_decode_tokens: int = 0  # the tokens after the first
    texts: list[str] = field(default_factory=list)  # replies, conversation by conversation

    def add(self, outputs) -> None:
        for out in outputs:
            completion, m = out.outputs[0], out.metrics
            self.num_tokens += len(completion.token_ids)
            if m is not None and m.first_token_time is not None and m.finished_time:
                self.num_decode_tokens += max(0, len(completion.token_ids) - 1)
                self.decode_s += m.finished_time - m.first_token_time


def run_mode(engines: dict[str, LLM], workload: Workload, mode: str, batch_size: int) -> dict:
    """The mode's conversations in groups of `batch_size`, turn by turn: each turn of a group
    is one timed `llm.chat` call per engine, the engines taking turns (the first one rotates
    by group), so a shared machine's load changes hit every configuration alike."""
    conversations = workload.items[mode]
    before = {name: spec_counts(llm) for name, llm in engines.items()}
    tallies = {name: Tally() for name in engines}
    for num_group, start in enumerate(range(0, len(conversations), batch_size)):
        group = conversations[start : start + batch_size]
        names = list(engines)
        names = names[num_group % len(names) :] + names[: num_group % len(names)]
        histories = {
            name: [[{"role": "system", "content": s}] if s else [] for s, _ in group]
            for name in names
        }
        replies = {name: [[] for _ in group] for name in names}
        for turn in range(len(group[0][1])):
            for name in names:
                for history, (_, turns) in zip(histories[name], group, strict=True):
                    history.append({"role": "user", "content": turns[turn]})
                tick = time.perf_counter()
                outputs = engines[name].chat(histories[name], workload.params)
                tallies[name].seconds += time.perf_counter() - tick
                tallies[name].add(outputs)
                for history, reply, out in zip(
                    histories[name], replies[name], outputs, strict=True
                ):
                    history.append({"role": "assistant", "content": out.outputs[0].text})
                    reply.append(out.outputs[0].text)
        for name in names:
            tallies[name].texts += [text for reply in replies[name] for text in reply]
    rows = {}
    for name, llm in engines.items():
        tally = tallies[name]
        drafts, drafted, accepted = (
            b - a for a, b in zip(before[name], spec_counts(llm), strict=True)
        )
        rows[name] = {
            "tok_s": tally.num_tokens / tally.seconds,
            "seconds": tally.seconds,
            "output_tokens": tally.num_tokens,
            "num_drafts": drafts,
            "draft_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "texts": tally.texts,
            **workload.quality(mode, tally.texts),
        }
        if batch_size == 1 and tally.decode_s > 0:
            rows[name]["decode_tok_s"] = tally.num_decode_tokens / tally.decode_s
    return rows


def build_engine(name: str, args) -> LLM:
    spec, jump_forward = CONFIGS[name]
    if spec is not None:
        spec = {**spec, "adaptive": args.adaptive}
        if args.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
    return LLM(
        None,
        dtype=args.dtype,
        seed=args.seed,
        kv_cache_memory_gb=args.kv_cache_gb,
        jump_forward=jump_forward,
        speculative_config=spec,
    )


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_table(workload: Workload, mode: str, batch: int, rows: dict[str, dict]) -> None:
    conversations = workload.items[mode]
    what = "one at a time" if batch == 1 else f"batches of {batch}"
    turns = len(conversations[0][1])
    print(
        f"\n({'abc'[['extraction', 'chat', 'tools'].index(workload.name)]}) {workload.name}, "
        f"{mode}: {len(conversations)} conversations x {turns} turns, {what}"
    )
    quality = [k for k in ("valid", "fields_true") if k in rows["off"]]
    header = f"{'config':11} {'tok/s':>7} {'speedup':>7} {'accept':>6} {'mean len':>8} "
    header += f"{'same as off':>11} " + " ".join(f"{k:>11}" for k in quality)
    header += f" {'tokens':>6} {'seconds':>7}" + (" decode tok/s" if batch == 1 else "")
    print(header)
    for name, r in rows.items():
        line = (
            f"{name:11} {r['tok_s']:7.1f} {r['speedup']:6.2f}x "
            f"{fmt(r['acceptance_rate'], '6.1%'):>6} {fmt(r['mean_accepted_length'], '8.2f'):>8} "
            f"{r['same_as_off']:11.1%} " + " ".join(f"{r[k]:11.1%}" for k in quality)
        )
        line += f" {r['output_tokens']:6d} {r['seconds']:7.1f}"
        if "decode_tok_s" in r:
            line += f" {r['decode_tok_s']:12.1f}"
        print(line)


def check_targets(results: dict, methods: list[str]) -> dict:
    """The issue's targets against what was measured (reported, never enforced)."""

    def target(rows: dict[str, float], bound: float) -> dict:
        return {
            "speedup": rows,
            "target": bound,
            "met_by": [m for m, x in rows.items() if x >= bound],
        }

    targets: dict[str, dict] = {}
    if "single" in results.get("extraction", {}):
        rows = results["extraction"]["single"]
        targets["a_single"] = target({m: rows[m]["speedup"] for m in methods if m in rows}, 2.0)
    chat = results.get("chat", {})
    if chat:  # the worst mode of each method
        worst = {
            m: min(rows[m]["speedup"] for rows in chat.values())
            for m in methods
            if m in chat["single"]
        }
        targets["b_never_slower"] = target(worst, 1.0)
    for workload, modes in results.items():
        if "batch64" in modes:
            rows = modes["batch64"]
            targets[f"batch64_{workload}"] = target(
                {m: rows[m]["speedup"] for m in methods if m in rows}, 0.95
            )
    return targets


def rounded(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "texts"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (~4 minutes)")
    parser.add_argument("--workloads", default="extraction,chat,tools", help="comma-separated")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated; 'off' is always run"
    )
    parser.add_argument(
        "--draft-model", help="a smaller model with the same vocabulary: adds draft_model"
    )
    parser.add_argument("--single", type=int, default=6, help="(a), (c): requests one at a time")
    parser.add_argument("--batch", type=int, default=16, help="(a), (c): requests in batches")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batch64", action="store_true", help="also one batch of 64 per workload")
    parser.add_argument(
        "--chat-single", type=int, default=2, help="(b): conversations one at a time"
    )
    parser.add_argument("--turns", type=int, default=3, choices=range(1, len(CHAT_TURNS) + 1))
    parser.add_argument("--chat-tokens", type=int, default=128, help="(b): max_tokens per turn")
    parser.add_argument("--extraction-tokens", type=int, default=256, help="(a): max_tokens")
    parser.add_argument("--tool-tokens", type=int, default=256, help="(c): max_tokens")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="default: the method's"
    )
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    parser.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="per engine (all are held at once)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.single, args.batch, args.chat_single, args.turns, args.chat_tokens = 3, 8, 1, 2, 64
    for name in ("single", "batch", "batch_size", "chat_single"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.workloads = [w for w in args.workloads.split(",") if w]
    names = ["off"] + [c for c in args.configs.split(",") if c and c != "off"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}: choose among {list(CONFIGS)}")
    if args.draft_model:
        CONFIGS["draft_model"] = ({"method": "draft_model", "model": args.draft_model}, True)
        names.append("draft_model")
    else:
        print(
            "draft_model: skipped (no smaller model shares SmolLM2-135M's vocabulary; "
            "--draft-model PATH adds one)"
        )

    engines: dict[str, LLM] = {}
    for name in names:
        tick = time.perf_counter()
        engines[name] = build_engine(name, args)
        print(f"engine {name}: built in {time.perf_counter() - tick:.1f}s")
    workloads, modes = build_workloads(args, engines["off"].tokenizer)
    print(
        f"{args.dtype}, torch threads {torch.get_num_threads()}, greedy, adaptive {args.adaptive}"
    )

    results: dict[str, dict[str, dict]] = {}
    for workload in workloads:
        configs = [n for n in names if workload.structured or n not in STRUCTURED_ONLY]
        # Warm-up: the first turn of 2 other conversations, at most 32 tokens each: the
        # grammar compiled, one request alone, then both in one batch.
        first_turns = [(system, turns[:1]) for system, turns in workload.items["warmup"]]
        warmup = Workload(
            workload.name,
            workload.structured,
            dataclasses.replace(workload.params, max_tokens=min(32, workload.params.max_tokens)),
            {"warmup": first_turns, "warmup_single": first_turns[:1]},
        )
        active = {name: engines[name] for name in configs}
        run_mode(active, warmup, "warmup_single", 1)
        run_mode(active, warmup, "warmup", 2)
        results[workload.name] = {}
        for mode, batch_size in modes.items():
            if mode == "warmup":
                continue
            rows = run_mode(active, workload, mode, batch_size)
            base = rows["off"]
            for row in rows.values():
                row["speedup"] = row["tok_s"] / base["tok_s"]
                pairs = list(zip(row["texts"], base["texts"], strict=True))
                row["same_as_off"] = sum(a == b for a, b in pairs) / len(pairs)
            print_table(workload, mode, batch_size, rows)
            if workload.structured and "off-nojf" in rows:
                print(f"jump-forward on / off: {base['tok_s'] / rows['off-nojf']['tok_s']:.2f}x")
            if "grammar" in rows:
                print(f"grammar drafts / jump-forward: {rows['grammar']['speedup']:.2f}x")
            results[workload.name][mode] = {name: rounded(row) for name, row in rows.items()}

    methods = [n for n in names if n not in ("off", "off-nojf")]
    targets = check_targets(results, methods)
    print()
    for key, t in targets.items():
        figures = ", ".join(f"{m} {x:.2f}x" for m, x in t["speedup"].items())
        worst = " (its worst mode)" if key == "b_never_slower" else ""
        print(f"target {key} >= {t['target']}x{worst}: {figures}; met by {t['met_by'] or 'none'}")
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "adaptive": args.adaptive,
                "num_speculative_tokens": args.num_speculative_tokens,
                "batch_size": args.batch_size,
                "sizes": {
                    "single": args.single,
                    "batch": args.batch,
                    "chat_single": args.chat_single,
                    "turns": args.turns,
                    "batch64": args.batch64,
                },
                "max_tokens": {
                    "extraction": args.extraction_tokens,
                    "chat": args.chat_tokens,
                    "tools": args.tool_tokens,
                },
                "draft_model": args.draft_model,
                "results": results,
                "targets": targets,
            }
        )
    )


if __name__ == "__main__":
    main()
