"""Engine fixtures: HF reference models for equivalence tests."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: Path):
    """HF transformers' model of the embedded GGUF, in fp32 (as agentrt runs
    dtype="float32"): transformers' LlamaForCausalLM from the file's config, with the
    file's weights dequantized, which equal transformers' own GGUF read exactly
    (test_gguf_file.py::test_dequantized_weights_equal_transformers_gguf_load). Its GGUF
    loader would parse and dequantize the file again: 20.5 s vs 4.5 s a process here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrt.engine.loader.checkpoint import load_state_dict
    from agentrt.engine.loader.gguf_file import gguf_metadata

    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(gguf_metadata(smollm2_dir)), dtype=torch.float32
    )
    keys = model.load_state_dict(load_state_dict(smollm2_dir), strict=False)
    assert keys.missing_keys == ["lm_head.weight"] and not keys.unexpected_keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the file
    return model.eval()


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


def hf_greedy_batch(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuations of `prompts` in one left-padded `generate` call,
    EOS ignored (its position ids follow the attention mask). In fp32 on the CPU every token
    equals `hf_greedy`'s one prompt at a time: checked on the embedded model (9 prompts x 64
    tokens of test_hf_equivalence) and on the tiny Llama / Qwen2 / Qwen3 / Mistral models
    (x 24), in 9.5 s instead of 43.6 s on the embedded model, one thread."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.shape == (len(prompts), width + max_new_tokens)
    return out[:, width:].tolist()


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
