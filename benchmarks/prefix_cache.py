"""Prefix caching on a multi-turn agent session, on vs off, side by side in one run.

Session: a ~1,000-token system prompt and 8 turns on the embedded model; every turn re-sends
the whole history (as an agent loop does). Prints the time to first token of each turn with
prefix caching on and off, the on/off ratio over turns 2-8, and the hit rate. Then a batch
of 32 requests sharing the system prompt: prompt tokens actually computed, on vs off.
Last line: a JSON object with the figures.

    python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import json
import statistics

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams

RULES = [
    "Always answer in JSON when a schema is given.",
    "Call a tool only when the user's request needs fresh data.",
    "Never invent tool results; wait for the tool message.",
    "Keep answers short and precise, and cite the tool that produced each fact.",
    "If a request is ambiguous, ask one clarifying question.",
]
QUESTIONS = [
    "What is the weather in Paris?",
    "Now compare it with Berlin.",
    "Which city is warmer on average in July?",
    "Book a table for two in the warmer one.",
    "Make it 8 pm instead.",
    "Add a reminder an hour before.",
    "Summarize everything we planned.",
    "Thanks, that is all.",
]


def system_prompt(tokenizer, num_tokens: int) -> str:
    text = "You are an agent with tools (search, weather, calendar, booking).\n"
    i = 0
    while len(tokenizer.encode(text)) < num_tokens:
        text += f"Rule {i + 1}: {RULES[i % len(RULES)]}\n"
        i += 1
    return text


def run_session(llm: LLM, system: str) -> tuple[list[float], list[int], list[int]]:
    messages = [{"role": "system", "content": system}]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ttfts, cached, prompt_lens = [], [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        (out,) = llm.chat(messages, params)
        ttfts.append(out.metrics.time_to_first_token)
        cached.append(out.num_cached_tokens)
        prompt_lens.append(len(out.prompt_token_ids))
        messages.append({"role": "assistant", "content": out.outputs[0].text})
    return ttfts, cached, prompt_lens


def run_batch(llm: LLM, system: str) -> int:
    """Prompt tokens computed for 32 requests that share the system prompt."""
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}: {q}"}]
        for i, q in enumerate(QUESTIONS * 4)
    ]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=4))
    return sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)


def main() -> None:
    engines = {
        "on": LLM(None, dtype="float32", enable_prefix_caching=True),
        "off": LLM(None, dtype="float32", enable_prefix_caching=False),
    }
    system = system_prompt(engines["on"].tokenizer, 1000)
    for llm in engines.values():  # warm up both
        llm.generate("warm up", SamplingParams(max_tokens=2))

    sessions = {name: run_session(llm, system) for name, llm in engines.items()}
    (on_ttft, on_cached, prompt_lens), (off_ttft, _, _) = sessions["on"], sessions["off"]
    print(f"system prompt: {prompt_lens[0]} tokens with the first question; 8 turns")
    print("turn  prompt  cached   TTFT on (ms)  TTFT off (ms)  ratio")
    for turn in range(len(QUESTIONS)):
        ratio = on_ttft[turn] / off_ttft[turn]
        print(
            f"{turn + 1:>4}  {prompt_lens[turn]:>6}  {on_cached[turn]:>6}  "
            f"{on_ttft[turn] * 1e3:>12.1f}  {off_ttft[turn] * 1e3:>13.1f}  {ratio:>5.2f}"
        )
    ratio_later = statistics.mean(on_ttft[1:]) / statistics.mean(off_ttft[1:])
    hit_rate = sum(on_cached) / sum(prompt_lens)
    print(f"turns 2-8: mean TTFT on / off = {ratio_later:.3f} (target <= 0.2)")
    print(f"session hit rate: {hit_rate:.1%} of prompt tokens")

    computed = {name: run_batch(llm, system) for name, llm in engines.items()}
    print(
        f"batch of 32 sharing the system prompt: prompt tokens computed "
        f"on={computed['on']} off={computed['off']} ({computed['on'] / computed['off']:.3f}x)"
    )
    print(
        json.dumps(
            {
                "ttft_on_ms": [round(t * 1e3, 1) for t in on_ttft],
                "ttft_off_ms": [round(t * 1e3, 1) for t in off_ttft],
                "ttft_ratio_turns_2_8": round(ratio_later, 3),
                "session_hit_rate": round(hit_rate, 3),
                "batch_prefill_tokens_on": computed["on"],
                "batch_prefill_tokens_off": computed["off"],
            }
        )
    )


if __name__ == "__main__":
    main()
