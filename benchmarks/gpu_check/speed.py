"""Throughput of the ~1B-shaped model, agentrt vs HF `generate`, bf16 on both sides, one
run, after a warm-up of each:

- batch: 256 prompts of 128 tokens x 256 new tokens (EOS ignored; one padded-free HF batch);
- batch-1 decode: one prompt, 256 new tokens.

Then a profiled agentrt run of each shape splits the step time into scheduling
(`schedule` + `update_from_output`), input preparation (`prepare_input`: the flat batch and
its host-to-device copies), forward (the rest of `ModelRunner.execute`), sampling (bitmask,
sampler, tokens back to the host) and other (output processing), with a device sync after
each part: the profiled run is slower than the timed one, its shares are what it tells.
Last, the host-device synchronisations per step, by the source line that asked for them.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from common import Context, greedy, sync, text_prompts

FULL = {"batch": 256, "prompt": 128, "new": 256, "single_new": 256, "profile_new": 32}
DRY = {"batch": 4, "prompt": 16, "new": 8, "single_new": 8, "profile_new": 4}


class StepTimer:
    """Wall time of the parts of each engine step, by wrapping the engine's methods on its
    instances (and `prepare_input` in its module) for as long as it is installed."""

    def __init__(self, llm, device: str) -> None:
        self.device = device
        self.current: dict[str, float] = defaultdict(float)  # the step under way
        self.samples: list[dict[str, float]] = []  # one per finished step
        self._undo: list[tuple[object, str, object]] = []
        engine = llm.engine
        core = engine.engine_core
        self._wrap(engine, "step", "step")
        self._wrap(core.scheduler, "schedule", "scheduling")
        self._wrap(core.scheduler, "update_from_output", "scheduling")
        self._wrap(core.runner, "execute", "execute")
        self._wrap(core, "_sample", "sampling")
        import agentrt.engine.worker.model_runner as model_runner

        # Where the runner no longer calls a module-level prepare_input, forward includes it.
        self.times_prepare_input = hasattr(model_runner, "prepare_input")
        if self.times_prepare_input:
            self._wrap(model_runner, "prepare_input", "input_preparation")

    def _wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else False
        self._undo.append((owner, name, original if had_own else None))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            value = original(*args, **kwargs)
            sync(self.device)
            self.current[key] += time.perf_counter() - start
            if key == "step":
                self.samples.append(self.current)
                self.current = defaultdict(float)
            return value

        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)

    def split_ms(self) -> dict[str, float]:
        """Median milliseconds per step of each part (decode steps outnumber prefills)."""
        rows = []
        for t in self.samples:
            prep = t["input_preparation"]
            row = {
                "scheduling": t["scheduling"],
                "input_preparation": prep,
                "forward": t["execute"] - prep,
                "sampling": t["sampling"],
            }
            row["other"] = t["step"] - sum(row.values())
            row["step"] = t["step"]
            rows.append(row)
        if not rows:
            return {}
        return {k: round(1000 * statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def time_agentrt(llm, prompts, num_tokens: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    outputs = greedy(llm, prompts, num_tokens)
    elapsed = time.perf_counter() - start
    assert all(len(ids) == num_tokens for ids in outputs)
    return elapsed


@torch.inference_mode()
def time_hf(model, prompts, num_tokens: int, device: str) -> float:
    input_ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + num_tokens
    return elapsed


def profile(llm, prompts, num_tokens: int, device: str) -> dict:
    timer = StepTimer(llm, device)
    try:
        greedy(llm, prompts, num_tokens)
    finally:
        timer.remove()
    return {
        "steps": len(timer.samples),
        "median_ms_per_step": timer.split_ms(),
        "input_preparation_timed": timer.times_prepare_input,
    }


def count_syncs(llm, prompts, num_tokens: int, device: str) -> dict:
    """Host-device synchronisations per engine step, by the source line that asked for them
    (torch's sync debug mode: `.item()`, `.tolist()`, `nonzero`, copies from pageable
    memory ...). One per step is the minimum: the sampled tokens come back to the host."""
    if not device.startswith("cuda"):
        return {"steps": 0, "note": "CUDA only"}
    engine, steps = llm.engine, [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                greedy(llm, prompts, num_tokens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        del engine.step
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    by_source = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {
        "steps": steps[0],
        "syncs_per_step": round(len(syncs) / max(steps[0], 1), 2),
        "by_source": dict(by_source.most_common(12)),
    }


def run(ctx: Context) -> dict:
    from transformers import AutoModelForCausalLM

    from agentrt.engine.client.llm import LLM

    size = DRY if ctx.dry_run else FULL
    path, device = ctx.checkpoint("big"), ctx.device
    llm = LLM(
        str(path),
        device=device,
        dtype="bfloat16",
        max_num_seqs=size["batch"],
        kv_cache_memory_gb=0.1 if ctx.dry_run else 6.0,
    )
    prompts = text_prompts(llm.tokenizer, size["batch"], size["prompt"], seed=11)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
    greedy(llm, prompts[:8], 16)  # warm-up: kernels compiled, allocator primed
    time_hf(hf, prompts[:8], 16, device)

    result: dict = {"shape": size}
    # Batch-1 first: quick, and it shows the per-step cost if the batch runs out of time.
    ours = time_agentrt(llm, prompts[:1], size["single_new"], device)
    theirs = time_hf(hf, prompts[:1], size["single_new"], device)
    result["single"] = {
        "agentrt_tok_s": round(size["single_new"] / ours, 1),
        "hf_tok_s": round(size["single_new"] / theirs, 1),
        "ratio": round(theirs / ours, 2),
    }
    print(result, flush=True)
    ctx.save_partial(result)
    batch_tokens = size["batch"] * size["new"]
    ours = time_agentrt(llm, prompts, size["new"], device)
    result["batch"] = {"agentrt_tok_s": round(batch_tokens / ours, 1)}
    print(result, flush=True)
    ctx.save_partial(result)
    theirs = time_hf(hf, prompts, size["new"], device)
    result["batch"].update(hf_tok_s=round(batch_tokens / theirs, 1), ratio=round(theirs / ours, 2))
    print(result, flush=True)
    ctx.save_partial(result)
    del hf
    result["profile_single"] = profile(llm, prompts[:1], 2 * size["profile_new"], device)
    ctx.save_partial(result)
    result["profile_batch"] = profile(llm, prompts, size["profile_new"], device)
    ctx.save_partial(result)
    try:
        result["syncs"] = count_syncs(llm, prompts[:8], 16, device)
    except Exception as exc:  # a measurement, not a check: the figures above stand
        result["syncs"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result
