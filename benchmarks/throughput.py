"""Offline throughput: agentrt vs HF transformers `generate`, bf16 on both sides, one run
(`--dtype auto`: agentrt in its default, the GGUF's own blocks, against the same bf16 HF).

Workloads (chat-formatted prompts on the embedded SmolLM2-135M-Instruct, EOS ignored):
  fixed  64 prompts x 128 output tokens; HF runs them as one padded batch of 64.
  mixed  256 prompts of 20-400 tokens, max_tokens drawn from 16-512 (seeded); HF runs padded
         static batches of 64 in arrival order, each until its longest request is done, and
         is credited only with the tokens that were asked for.
Also agentrt's single-request decode speed. Last line: a JSON object with every figure.

    python benchmarks/throughput.py            # both workloads (several minutes on 2 cores)
    python benchmarks/throughput.py --quick    # smaller workloads, for a smoke test
    python benchmarks/throughput.py --only fixed
    python benchmarks/throughput.py --device cuda --quick --json out.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from agentrt.engine.client.llm import LLM
from agentrt.engine.sampling_params import SamplingParams

WORDS = (
    "agent runtime schema token cache block prefix scheduler batch model decode prefill "
    "kernel grammar json object field value request stream latency throughput memory page "
    "attention query key head layer weight tensor sample logit vocabulary context window"
).split()


def chat_prompts(tokenizer, lengths: list[int], seed: int) -> list[list[int]]:
    """Chat-template prompts whose token counts equal `lengths`."""
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        words = " ".join(rng.choice(WORDS) for _ in range(length))
        messages = [{"role": "user", "content": f"Summarize: {words}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        head, tail = ids[: length - 3], ids[-3:]  # keep the assistant header at the end
        prompts.append(head + tail if len(ids) > length else ids)
    return prompts


def run_agentrt(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_tokens == sum(max_tokens)
    return elapsed, num_tokens


def run_hf(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int):
    """Padded static batches (left padding), each generating its longest max_tokens."""
    device = model.device
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(max_tokens[i : i + batch_size]),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    return time.perf_counter() - start, sum(max_tokens)


def single_decode(llm: LLM, num_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate("Tell me a long story.", SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    llm.generate("Tell me a long story.", params)
    return num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    parser.add_argument("--skip-hf", action="store_true", help="agentrt only")
    parser.add_argument("--only", choices=("fixed", "mixed"), help="run one workload")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (both sides)")
    parser.add_argument("--json", metavar="PATH", help="also write the result object here")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="agentrt's dtype: bfloat16 (dense, as HF), or auto (the GGUF's own blocks on the CPU)",
    )
    args = parser.parse_args()
    scale = 4 if args.quick else 1

    llm = LLM(
        None, dtype=args.dtype, device=args.device, max_num_seqs=256, max_num_batched_tokens=2048
    )
    tokenizer = llm.tokenizer
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM, GgufConfig

        from agentrt.engine.loader.checkpoint import hf_pretrained_args

        name, kwargs = hf_pretrained_args(llm.model_path)
        hf = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kwargs
        )
        hf.to(args.device).eval()

    rng = random.Random(0)
    n_fixed = 64 // scale
    fixed = (
        chat_prompts(tokenizer, [rng.randint(20, 60) for _ in range(n_fixed)], 1),
        [128 // scale] * n_fixed,
    )
    n_mixed = 256 // scale
    mixed = (
        chat_prompts(tokenizer, [rng.randint(20, 400) for _ in range(n_mixed)], 2),
        [rng.randint(16, 512 // scale) for _ in range(n_mixed)],
    )

    llm.generate("warm up", SamplingParams(max_tokens=8))
    result: dict[str, str | float | None] = {
        "device": args.device,
        "dtype": args.dtype,
        "quantization": llm.engine.model_config.quantization,
        "attention_backend": llm.runner.attention.name,
        "threads": torch.get_num_threads(),
    }
    for name, (prompts, max_tokens) in (("fixed", fixed), ("mixed", mixed)):
        if args.only and name != args.only:
            continue
        elapsed, tokens = run_agentrt(llm, prompts, max_tokens)
        ours = tokens / elapsed
        print(f"{name}: agentrt {tokens} tokens in {elapsed:.1f}s = {ours:.1f} tok/s")
        result[f"{name}_agentrt_tok_s"] = round(ours, 1)
        if hf is not None:
            elapsed, tokens = run_hf(hf, prompts, max_tokens, batch_size=64)
            theirs = tokens / elapsed
            print(f"{name}: HF      {tokens} tokens in {elapsed:.1f}s = {theirs:.1f} tok/s")
            print(f"{name}: ratio agentrt / HF = {ours / theirs:.2f}x")
            result[f"{name}_hf_tok_s"] = round(theirs, 1)
            result[f"{name}_ratio"] = round(ours / theirs, 2)
    single = single_decode(llm, 128 // scale)
    fmt = f"{llm.engine.model_config.quantization}, {args.dtype}"
    print(f"single request decode: agentrt {single:.1f} tok/s ({fmt})")
    result["single_decode_tok_s"] = round(single, 1)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
