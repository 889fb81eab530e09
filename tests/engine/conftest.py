"""Engine fixtures: HF reference models for equivalence tests."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path):
    """transformers' own read of the embedded GGUF, dequantized to fp32 (as agentrt runs
    dtype="float32")."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        smollm2_dir.parent,
        gguf_file=smollm2_dir.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy continuation, EOS ignored."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,  # never stop early, and never suppress EOS either
            pad_token_id=0,
        )
    assert out.shape[1] == len(prompt_ids) + max_new_tokens
    return out[0, len(prompt_ids) :].tolist()


async def stream_all(engine, prompts: list[str], params) -> tuple[list[str], list]:
    """Run `prompts` on an AsyncEngine at once, streaming: each request's text put together
    from its deltas, and its final RequestOutput."""
    texts = [""] * len(prompts)
    finals = [None] * len(prompts)

    async def consume(i: int) -> None:
        async for delta in engine.add_request(prompts[i], params):
            texts[i] += delta.text
            if delta.finished:
                finals[i] = delta.output

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(consume, i)
    return texts, finals
