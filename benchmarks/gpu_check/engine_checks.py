"""The engine's CUDA path against its CPU path on tiny random models (fp32, greedy: tiny
models have peaked logits, so tokens must agree exactly):

- greedy tokens, CUDA (attention backends auto = Triton, and torch) vs CPU, llama and qwen3;
- a JSON-schema constrained output: valid against the schema, and the same text as on the CPU;
- chunked prefill (a 300-token prompt in chunks of 64) with a prefix-cache hit on the
  second request: the same tokens as the CPU's unchunked run, the hit reported;
- n-gram drafting: the same tokens as without it, drafts proposed and some accepted.

The dry run runs the same code with the CPU on both sides (there: the C kernel vs the torch
backend, a real comparison too).
"""

from __future__ import annotations

import json

from common import Context, attention_backend_name, compare_greedy, greedy, require, text_prompts

OPTIONS = {"dtype": "float32", "kv_cache_memory_gb": 0.05}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def llm(path, device: str, **options):
    from agentrt.engine.client.llm import LLM

    return LLM(str(path), device=device, **{**OPTIONS, **options})


def greedy_check(ctx: Context, arch: str) -> dict:
    cpu = llm(ctx.checkpoint(f"tiny-{arch}"), "cpu")
    prompts = text_prompts(cpu.tokenizer, 4, 9, seed=1)
    cpu_ids = greedy(cpu, prompts, 24)
    result: dict = {"ok": True}
    for backend in ("auto", "torch"):
        engine = llm(ctx.checkpoint(f"tiny-{arch}"), ctx.device, attention_backend=backend)
        cmp = compare_greedy(cpu_ids, greedy(engine, prompts, 24), prompts)
        cmp["backend"] = attention_backend_name(engine)
        result[backend] = cmp
        require(cmp["ok"], f"{arch} {backend}: CUDA greedy != CPU greedy: {cmp['divergences'][:2]}")
    return result


def json_output(ctx: Context, cpu) -> dict:
    import jsonschema

    from agentrt.engine.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(
        temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    prompt = "Extract the person as JSON: Ada Lovelace, 36, mathematician."
    gpu = llm(ctx.checkpoint("tiny-llama"), ctx.device)
    (out,) = gpu.generate(prompt, params)
    (cpu_out,) = cpu.generate(prompt, params)
    text = out.outputs[0].text
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    require(out.outputs[0].structured_errors == [], f"errors: {out.outputs[0].structured_errors}")
    require(text == cpu_out.outputs[0].text, f"CUDA {text!r} != CPU {cpu_out.outputs[0].text!r}")
    return {"ok": True, "text": text, "steered": out.outputs[0].num_steered_tokens}


def chunked_prefix(ctx: Context, cpu, tokenizer) -> dict:
    (head,) = text_prompts(tokenizer, 1, 300, seed=3)
    tails = text_prompts(tokenizer, 2, 20, seed=4)
    prompts = [head + tails[0], head + tails[1]]
    expected = greedy(cpu, prompts, 16)
    gpu = llm(ctx.checkpoint("tiny-llama"), ctx.device, max_num_batched_tokens=64)
    from agentrt.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = gpu.generate([prompts[0]], params)[0]
    second = gpu.generate([prompts[1]], params)[0]  # shares the 300-token head
    got = [first.outputs[0].token_ids, second.outputs[0].token_ids]
    cmp = compare_greedy(expected, got, prompts)
    cmp["cached_tokens"] = [first.num_cached_tokens, second.num_cached_tokens]
    require(cmp["ok"], f"chunked + prefix hit != CPU: {cmp['divergences'][:2]}")
    require(second.num_cached_tokens >= 256, f"no prefix hit: {cmp['cached_tokens']}")
    return cmp


def ngram_drafting(ctx: Context, tokenizer) -> dict:
    # A repeated phrase: prompt lookup finds drafts, and random models loop on their own.
    phrase = text_prompts(tokenizer, 1, 12, seed=5)[0]
    prompts = [phrase * 4, text_prompts(tokenizer, 1, 40, seed=6)[0]]
    path = ctx.checkpoint("tiny-llama")
    plain = greedy(llm(path, ctx.device), prompts, 96)
    spec = llm(
        path, ctx.device, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
    )
    from agentrt.engine.sampling_params import SamplingParams

    outs = spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    cmp = compare_greedy(plain, [o.outputs[0].token_ids for o in outs], prompts)
    stats = [o.metrics.spec_decode if o.metrics else None for o in outs]
    drafted = sum(s.num_draft_tokens for s in stats if s is not None)
    accepted = sum(s.num_accepted_tokens for s in stats if s is not None)
    cmp.update(drafted=drafted, accepted=accepted)
    require(cmp["ok"], f"n-gram drafting changed greedy tokens: {cmp['divergences'][:2]}")
    require(drafted > 0, "n-gram drafting proposed nothing")
    return cmp


def run(ctx: Context) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    checks = []
    for arch in ("llama",) if ctx.dry_run else ("llama", "qwen3"):
        checks.append((f"greedy_{arch}", lambda arch=arch: greedy_check(ctx, arch)))
    cpu = llm(ctx.checkpoint("tiny-llama"), "cpu")
    checks += [
        ("json_schema", lambda: json_output(ctx, cpu)),
        ("chunked_prefill_prefix_hit", lambda: chunked_prefix(ctx, cpu, cpu.tokenizer)),
        ("ngram_drafting", lambda: ngram_drafting(ctx, cpu.tokenizer)),
    ]
    result = {}
    for name, check in checks:
        try:
            result[name] = check()
        except Exception as exc:  # record it, run the other checks, fail the stage at the end
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {json.dumps(result[name], default=str)}", flush=True)
        ctx.save_partial(result)
    failed = [name for name, row in result.items() if not row.get("ok", True)]
    result["ok"] = not failed
    if failed:
        result["error"] = f"failed: {', '.join(failed)}"
    return result
