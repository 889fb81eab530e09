"""Engine fixtures: HF reference models for equivalence tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


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
