"""The ~1B-shaped random model against HF transformers on the same device:

- fp32 greedy: agentrt's tokens equal HF `generate`'s (TF32 off on both sides); a
  divergence counts only where HF's own logits do not make it a near-tie.
- bf16 teacher-forced: along HF fp32's greedy sequences, agentrt bf16's next-token
  logprobs (its top 20, through `logprobs=20`, one request per position, sharing the
  prefix cache) against HF fp32's: max-abs difference and top-1 agreement, next to the same
  figures for HF's own bf16 model, the baseline a bf16 run can be held to.
"""

from __future__ import annotations

import torch
from common import Context, compare_greedy, greedy, require, text_prompts

NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 24, 32
DRY = (2, 8, 8)
TOP = 20
# agentrt bf16 may trail HF bf16 by this much top-1 agreement, and exceed its max-abs
# logprob error by this factor (plus a floor), before the check fails.
TOP1_SLACK, MAX_ABS_FACTOR, MAX_ABS_FLOOR = 0.1, 2.0, 0.05


def hf_model(path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """HF `generate`, greedy, EOS never stops it; prompts of one length (no padding)."""
    input_ids = torch.tensor(prompts, device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, input_ids.shape[1] :].tolist()


@torch.inference_mode()
def hf_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """fp32 log-softmax of the next-token logits at every position `[len, V]`."""
    logits = model(torch.tensor([sequence], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def agreement(top: list[dict[int, float]], reference: torch.Tensor) -> dict:
    """Top-1 agreement and logprob errors of `top` (per position: token -> logprob, the
    first key the argmax) against `reference` `[positions, V]`."""
    hits, errors = 0, []
    for row, ref in zip(top, reference, strict=True):
        hits += next(iter(row)) == int(ref.argmax())
        errors.extend(abs(lp - float(ref[t])) for t, lp in row.items())
    return {
        "top1_agreement": round(hits / len(top), 4),
        "max_abs": round(max(errors), 4),
        "mean_abs": round(sum(errors) / len(errors), 5),
    }


def engine_top(engine, sequences: list[list[int]], start: int) -> list[dict[int, float]]:
    """agentrt's top-TOP next-token logprobs at positions start..end-1 of each sequence."""
    from agentrt.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP, ignore_eos=True)
    prefixes = [seq[:p] for seq in sequences for p in range(start, len(seq))]
    rows = []
    for out in engine.generate(prefixes, params):
        completion = out.outputs[0]
        logprobs = completion.logprobs[0]
        ranked = sorted(logprobs.items(), key=lambda kv: -kv[1].logprob)[:TOP]
        row = {completion.token_ids[0]: logprobs[completion.token_ids[0]].logprob}
        row.update((t, lp.logprob) for t, lp in ranked)
        rows.append(row)
    return rows


def hf_top(reference: torch.Tensor) -> list[dict[int, float]]:
    values, ids = reference.topk(TOP, dim=-1)
    return [
        dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)
    ]


def run(ctx: Context) -> dict:
    from agentrt.engine.client.llm import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    num_prompts, prompt_tokens, new_tokens = (
        DRY if ctx.dry_run else (NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS)
    )
    path, device = ctx.checkpoint("big"), ctx.device
    engine = LLM(str(path), device=device, dtype="float32", kv_cache_memory_gb=1.0)
    prompts = text_prompts(engine.tokenizer, num_prompts, prompt_tokens, seed=7)
    hf32 = hf_model(path, torch.float32, device)
    expected = hf_greedy(hf32, prompts, new_tokens)
    require(all(len(ids) == new_tokens for ids in expected), "HF generate stopped early")
    cmp = compare_greedy(
        expected, greedy(engine, prompts, new_tokens), prompts,
        reference_logits=lambda ids: hf_logprobs(hf32, ids)[-1],
    )  # fmt: skip
    engine = None
    ctx.save_partial({"fp32_greedy_vs_hf": cmp})
    sequences = [p + e for p, e in zip(prompts, expected, strict=True)]
    reference = torch.cat([hf_logprobs(hf32, s)[prompt_tokens - 1 : -1] for s in sequences])
    hf32 = None  # free its memory before the bf16 models load
    hf16 = hf_model(path, torch.bfloat16, device)
    baseline = torch.cat([hf_logprobs(hf16, s)[prompt_tokens - 1 : -1] for s in sequences])
    hf16 = None
    if device == "cuda":
        torch.cuda.empty_cache()
    engine16 = LLM(str(path), device=device, dtype="bfloat16", kv_cache_memory_gb=1.0)
    ours = agreement(engine_top(engine16, sequences, prompt_tokens), reference)
    theirs = agreement(hf_top(baseline), reference)
    result = {
        "fp32_greedy_vs_hf": cmp,
        "bf16_teacher_forced": {"agentrt": ours, "hf_bf16": theirs, "positions": len(reference)},
    }
    problems = []
    if not cmp["ok"]:
        problems.append(f"fp32 greedy != HF: {cmp['divergences'][:2]}")
    if ours["top1_agreement"] < theirs["top1_agreement"] - TOP1_SLACK:
        problems.append(
            f"bf16 top-1 agreement {ours['top1_agreement']} vs HF bf16 {theirs['top1_agreement']}"
        )
    if ours["max_abs"] > MAX_ABS_FACTOR * theirs["max_abs"] + MAX_ABS_FLOOR:
        problems.append(
            f"bf16 max-abs logprob error {ours['max_abs']} vs HF bf16 {theirs['max_abs']}"
        )
    result["ok"] = not problems
    if problems:
        result["error"] = "; ".join(problems)
    return result
