"""One request, as fast as it goes: agentrt (each dtype / quantization, and with speculative
decoding) vs llama-cpp-python on the same GGUF file vs HF transformers, side by side in one
run, on the embedded SmolLM2-135M-Instruct (Q4_1), 2 threads each.

  (a) decode   one request, a short prompt, 256 tokens greedy (EOS ignored): tokens/s
  (b) extract  one ~250-token document -> a validated Pydantic object (JSON schema; llama.cpp
               with its schema grammar, `response_format={"type": "json_object", "schema"}`)
  (c) agent    a 6-turn session: each turn appends a user message and one schema-constrained
               reply to the history; total wall time
  quality      per agentrt mode: perplexity of a fixed text (teacher forced) and greedy
               agreement with the fp32 reference over a prompt set (share of 32 tokens that
               equal the reference up to its first difference, averaged)

HF transformers loads the GGUF dequantized (`from_pretrained(dir, gguf_file=..., dtype=bf16)`)
and runs (a) only (it has no schema grammar of its own). llama-cpp-python is optional:
without it that column is skipped; build it for this CPU with
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python    (~10 minutes on 2 cores)
On a VM whose CPU reports AMX but does not grant it (this project's dev machines: prompt
evaluation dies with SIGILL in ggml_backend_amx_mul_mat), build without AMX instead:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
      -DLLAVA_BUILD=OFF" pip install llama-cpp-python
Ratios are agentrt / llama.cpp measured in the same run (>1 is faster). Last line: JSON.

    python benchmarks/latency.py               # every mode (~5 minutes on 2 cores)
    python benchmarks/latency.py --modes auto:auto --no-hf      # the default engine
    python benchmarks/latency.py --modes auto:auto auto:auto:suffix   # + drafting
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from pydantic import BaseModel, Field

from agentrt.engine.client.llm import LLM
from agentrt.engine.loader.checkpoint import gguf_source, resolve_model
from agentrt.engine.loader.tokenizer import load_tokenizer
from agentrt.engine.records import ScheduledChunk, SchedulerOutput
from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

# dtype:quantization[:speculative method]
MODES = (
    "float32:none",
    "bfloat16:none",
    "float32:int8",
    "float32:int4",
    "auto:auto",
    "auto:auto:suffix",
)
DECODE_PROMPT = "Write a long story about a lighthouse keeper and the sea."
DECODE_TOKENS = 256
PPL_CHUNK = 16  # tokens per perplexity step (at most quantization.DENSE_ABOVE_ROWS)
PPL_TEXT = (
    "The lighthouse stood on a rock at the edge of the harbour, and for forty years the same "
    "family had kept its lamp burning. Every evening the keeper climbed the spiral stairs, "
    "trimmed the wick, polished the great lens and wound the clockwork that turned it. Ships "
    "passing in the night saw the beam sweep across the water every ten seconds, and they "
    "knew where the reef lay. In winter the storms came from the west, and waves broke over "
    "the gallery so that the whole tower trembled. The keeper wrote in the log each night: "
    "the wind, the state of the sea, the ships that passed and the hours the lamp had burned. "
    "When electricity finally reached the island, the lamp was replaced by a bulb and a motor, "
    "and the last keeper left the rock with the logbooks under his arm."
)
AGREEMENT_PROMPTS = [
    "The history of Rome",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "Translate to French: I love cheese.",
    "Q: What is 17 * 3?\nA:",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
]
AGREEMENT_TOKENS = 32
DOCUMENT = (
    "From: Harbour Supplies Ltd, 12 Quay Street, Portsmouth, United Kingdom.\n"
    "Contact: Margaret Ellison, accounts manager, phone +44 23 9200 1234, "
    "email m.ellison@harboursupplies.co.uk.\n"
    "Invoice HS-2291, dated 3 March, for the delivery of 40 coils of mooring rope, 12 brass "
    "lanterns and 6 crates of marine varnish to the Northern Lights Trust, Lerwick. Payment "
    "is due within 30 days by bank transfer; the account number is printed overleaf. The "
    "subtotal is 2,480.00 GBP, VAT at 20% is 496.00 GBP, and the total due is 2,976.00 GBP. "
    "Goods remain the property of Harbour Supplies until paid in full. Margaret has worked "
    "for the company since 2009 and is 47 years old; questions about this invoice go to her."
)


class Contact(BaseModel):
    name: str = Field(max_length=40)
    company: str = Field(max_length=40)
    email: str = Field(max_length=60)
    age: int = Field(ge=0, le=120)
    total_due: float = Field(ge=0)


class Step(BaseModel):
    thought: str = Field(max_length=80)
    action: str = Field(pattern="^(search|read|write|answer)$")
    argument: str = Field(max_length=40)


AGENT_SYSTEM = (
    "You are an agent that plans one step at a time. Reply with a JSON object: a short "
    "thought, an action (search, read, write or answer) and its argument."
)
AGENT_TURNS = [
    "Find out who keeps the lighthouse on Muckle Flugga.",
    "The search found a page about Northern Lighthouse Board. What next?",
    "The page says the light was automated in 1995. Note that down.",
    "Now find when it was built.",
    "The page says 1854, by Thomas and David Stevenson. Record it.",
    "Give the final answer in one sentence.",
]
MAX_STEP_TOKENS = 96


def extract_messages() -> list[dict]:
    return [
        {"role": "system", "content": "Extract the contact person's details as JSON."},
        {"role": "user", "content": DOCUMENT},
    ]


# -- agentrt ------------------------------------------------------------------------------------


def constrained(schema: type[BaseModel], max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=schema.model_json_schema()),
    )


def agentrt_decode(llm: LLM) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": DECODE_PROMPT}], params)[0]
    assert len(out.outputs[0].token_ids) == DECODE_TOKENS
    return DECODE_TOKENS / (time.perf_counter() - start)


def agentrt_extract(llm: LLM) -> tuple[float, bool]:
    start = time.perf_counter()
    text = llm.chat(extract_messages(), constrained(Contact, 160))[0].outputs[0].text
    valid = _validates(Contact, text)
    return time.perf_counter() - start, valid


def agentrt_agent(llm: LLM) -> tuple[float, int]:
    messages = [{"role": "system", "content": AGENT_SYSTEM}]
    num_valid = 0
    start = time.perf_counter()
    for turn in AGENT_TURNS:
        messages.append({"role": "user", "content": turn})
        text = llm.chat(messages, constrained(Step, MAX_STEP_TOKENS))[0].outputs[0].text
        num_valid += _validates(Step, text)
        messages.append({"role": "assistant", "content": text})
    return time.perf_counter() - start, num_valid


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """Teacher-forced perplexity of `token_ids` (see `teacher_forced_logits`)."""
    logprobs = torch.log_softmax(teacher_forced_logits(llm, token_ids)[:-1].float(), dim=-1)
    targets = torch.tensor(token_ids[1:])
    return math.exp(-logprobs.gather(1, targets[:, None]).mean().item())


def teacher_forced_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """(n, vocab) logits of `token_ids` (row i predicts token i + 1), straight through the
    model in chunks of PPL_CHUNK tokens with a logits row per position (the runner's
    draft-verification rows): steps of the size a decode or a verification has, so
    quantization "int4+dense" (auto) is measured on its int4 weights, not on the dense ones
    a long prefill runs."""
    engine = llm.engine
    block_size = engine.cache_config.block_size
    n = len(token_ids)
    blocks = list(range(math.ceil(n / block_size)))
    rows = []
    for start in range(0, n, PPL_CHUNK):
        ids = token_ids[start : start + PPL_CHUNK]
        chunk = ScheduledChunk("ppl", ids, start, blocks, True, num_draft_tokens=len(ids) - 1)
        rows.append(engine.runner.execute(SchedulerOutput([chunk], len(ids))))
    engine.reset_prefix_cache()  # those blocks now hold this text's KV
    return torch.cat(rows)  # (n, vocab)


def greedy_ids(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(AGREEMENT_PROMPTS, params)]


def agreement(ids: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of tokens equal to the reference before the first difference."""
    shares = []
    for a, b in zip(ids, reference, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        shares.append(same / len(b))
    return sum(shares) / len(shares)


def run_agentrt(mode: str, reference: list[list[int]] | None) -> dict:
    dtype, quantization, *method = mode.split(":")
    spec = {"method": method[0]} if method else None
    llm = LLM(
        None,
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory_gb=0.5,
        speculative_config=spec,
    )
    ppl = perplexity(llm, llm.tokenizer.encode(PPL_TEXT))
    ids = greedy_ids(llm)
    agentrt_extract(llm)  # warm-up: grammar compiled, caches touched
    llm.engine.reset_prefix_cache()
    result = {
        "decode_tok_s": agentrt_decode(llm),
        "extract_s": agentrt_extract(llm)[0],
        "extract_valid": agentrt_extract(llm)[1],
        "perplexity": ppl,
        "greedy_agreement": 1.0 if reference is None else agreement(ids, reference),
    }
    llm.engine.reset_prefix_cache()
    result["agent_s"], result["agent_valid"] = agentrt_agent(llm)
    return result | {"ids": ids}


# -- llama.cpp and HF ----------------------------------------------------------------------------


def run_llama_cpp(threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print(
            "llama-cpp-python is not installed: its column is skipped. Install it with\n"
            '    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'
        )
        return None
    llm = Llama(str(gguf_source(None)), n_ctx=2048, n_threads=threads, verbose=False, seed=0)

    def chat(messages, schema=None, max_tokens=MAX_STEP_TOKENS):
        fmt = {"type": "json_object", "schema": schema.model_json_schema()} if schema else None
        reply = llm.create_chat_completion(
            messages, temperature=0.0, max_tokens=max_tokens, response_format=fmt
        )
        return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

    chat(extract_messages(), Contact, 160)  # warm-up
    tokenizer = load_tokenizer(resolve_model(None))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": DECODE_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    start = time.perf_counter()
    out = llm.create_completion(
        prompt, max_tokens=DECODE_TOKENS, temperature=0.0, logit_bias={llm.token_eos(): -1e9}
    )
    assert out["usage"]["completion_tokens"] == DECODE_TOKENS
    decode = DECODE_TOKENS / (time.perf_counter() - start)
    start = time.perf_counter()
    text, _ = chat(extract_messages(), Contact, 160)
    extract_s, extract_valid = time.perf_counter() - start, _validates(Contact, text)
    messages = [{"role": "system", "content": AGENT_SYSTEM}]
    num_valid = 0
    start = time.perf_counter()
    for turn in AGENT_TURNS:
        messages.append({"role": "user", "content": turn})
        text, _ = chat(messages, Step)
        num_valid += _validates(Step, text)
        messages.append({"role": "assistant", "content": text})
    agent_s = time.perf_counter() - start
    return {
        "decode_tok_s": decode,
        "extract_s": extract_s,
        "extract_valid": extract_valid,
        "agent_s": agent_s,
        "agent_valid": num_valid,
    }


def run_hf() -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_source(None)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": DECODE_PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=DECODE_TOKENS, **kwargs)
    assert out.shape[1] == ids.shape[1] + DECODE_TOKENS
    return {"decode_tok_s": DECODE_TOKENS / (time.perf_counter() - start)}


def _validates(schema: type[BaseModel], text: str) -> bool:
    try:
        schema.model_validate_json(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), help="dtype:quantization")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama-cpp-python")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    agentrt: dict[str, dict] = {}
    reference = None
    for mode in ["float32:none"] + [m for m in args.modes if m != "float32:none"]:
        agentrt[mode] = run_agentrt(mode, reference)
        reference = reference or agentrt[mode]["ids"]
        r = agentrt[mode]
        print(
            f"agentrt {mode:20s} decode {r['decode_tok_s']:6.1f} tok/s | extract "
            f"{r['extract_s']:5.2f} s (valid {r['extract_valid']}) | agent {r['agent_s']:5.2f} s "
            f"({r['agent_valid']}/6 valid) | ppl {r['perplexity']:6.2f} | greedy agreement "
            f"{r['greedy_agreement']:.0%}",
            flush=True,
        )
    for r in agentrt.values():
        del r["ids"]
    if "float32:none" not in args.modes:
        del agentrt["float32:none"]
    llama = None if args.no_llama_cpp else run_llama_cpp(args.threads)
    if llama:
        print(
            f"llama.cpp Q4_1       decode {llama['decode_tok_s']:6.1f} tok/s | extract "
            f"{llama['extract_s']:5.2f} s (valid {llama['extract_valid']}) | agent "
            f"{llama['agent_s']:5.2f} s ({llama['agent_valid']}/6 valid)"
        )
        for mode, r in agentrt.items():
            r["vs_llama_cpp"] = {
                "decode": r["decode_tok_s"] / llama["decode_tok_s"],
                "extract": llama["extract_s"] / r["extract_s"],
                "agent": llama["agent_s"] / r["agent_s"],
            }
            print(
                f"ratio agentrt {mode} / llama.cpp: decode {r['vs_llama_cpp']['decode']:.2f}x "
                f"(target >= 0.8x), extract {r['vs_llama_cpp']['extract']:.2f}x, agent "
                f"{r['vs_llama_cpp']['agent']:.2f}x (targets >= 2x)"
            )
    hf = None if args.no_hf else run_hf()
    if hf:
        print(f"HF transformers bf16 decode {hf['decode_tok_s']:6.1f} tok/s")
    print(json.dumps({"threads": args.threads, "agentrt": agentrt, "llama_cpp": llama, "hf": hf}))


if __name__ == "__main__":
    main()
