"""The offline API on the embedded model: chat, stop conditions, logprobs, seeds,
detokenization, and the CLI. The API's own behaviour runs on the default engine (the GGUF's
Q4_1 blocks, `smollm2_default_llm`); what names the fp32 model's answer ("Paris") on fp32."""

from __future__ import annotations

import math
import subprocess
import sys

import torch

from agentrt.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_chat_answers_and_reports_prompt(smollm2_llm):
    (out,) = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], GREEDY
    )
    assert "Paris" in out.outputs[0].text
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.prompt_token_ids[-4:] == smollm2_llm.tokenizer.encode("<|im_start|>assistant\n")
    # EOS ends the request: it is the last token id and does not appear in the text.
    assert out.outputs[0].token_ids[-1] in smollm2_llm.processor.eos_token_ids


def test_token_id_prompts_equal_string_prompts(smollm2_default_llm):
    text = "The three primary colors are"
    ids = smollm2_default_llm.tokenizer.encode(text)
    by_text, by_ids = smollm2_default_llm.generate([text, ids], GREEDY)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_ids.prompt_token_ids == ids
    metrics = by_text.metrics
    assert 0 < metrics.time_to_first_token < metrics.finished_time - metrics.arrival_time
    assert metrics.time_per_output_token > 0


def test_stop_string_is_removed_and_reported(smollm2_default_llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    (free,) = smollm2_default_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))
    assert " 8," in free.outputs[0].text
    (out,) = smollm2_default_llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[" 8,"])
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == " 8,"
    assert completion.text == free.outputs[0].text.split(" 8,")[0]
    assert not smollm2_default_llm.engine_core.has_unfinished_requests()
    (kept,) = smollm2_default_llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=20, stop=[" 8,"], include_stop_str_in_output=True
        ),
    )
    assert kept.outputs[0].text == completion.text + " 8,"


def test_stop_token_ids_max_tokens_and_ignore_eos(smollm2_default_llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    (free,) = smollm2_default_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    ids = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(ids) == 12
    stop_id = ids[5]
    (out,) = smollm2_default_llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    )
    first = ids.index(stop_id)
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_min_tokens_holds_off_eos(smollm2_default_llm):
    messages = [{"role": "user", "content": "Reply with just the word yes."}]
    (short,) = smollm2_default_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=40))
    n = len(short.outputs[0].token_ids)
    assert short.outputs[0].finish_reason == "stop" and n < 30
    (longer,) = smollm2_default_llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n + 5)
    )
    assert len(longer.outputs[0].token_ids) >= n + 5
    eos = smollm2_default_llm.processor.eos_token_ids
    assert not eos & set(longer.outputs[0].token_ids[: n + 5 - 1])
    (ignored,) = smollm2_default_llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=n + 6, ignore_eos=True)
    )
    assert len(ignored.outputs[0].token_ids) == n + 6
    assert ignored.outputs[0].finish_reason == "length"


def test_logprobs(smollm2_default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    (out,) = smollm2_default_llm.generate("The sky is", params)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    total = 0.0
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert entry[token_id].decoded_token == smollm2_default_llm.tokenizer.decode([token_id])
        total += entry[token_id].logprob
    assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6)


def test_seeded_sampling_is_reproducible_across_batches(smollm2_default_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=42)
    (alone,) = smollm2_default_llm.generate("Write a story about a dragon.", seeded)
    other = SamplingParams(temperature=1.0, max_tokens=16)
    batch = smollm2_default_llm.generate(
        ["Hello", "Write a story about a dragon.", "Why?"], [other, seeded, other]
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    (different,) = smollm2_default_llm.generate(
        "Write a story about a dragon.", SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    )
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_detokenized_text_equals_decode_for_emoji_and_cjk(smollm2_default_llm):
    prompts = ["Emoji: 🎉🚀🌍 and", "日本語の文章を書いてください:", "Ünïcödé façade naïve"]
    outs = smollm2_default_llm.generate(
        prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=30)
    )
    for out in outs:
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == smollm2_default_llm.tokenizer.decode(
            ids, skip_special_tokens=True
        )


def test_cli_generate(smollm2_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrt",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


def test_cli_reports_bad_input(tmp_path, capsys):
    # A model that is not there: the sampling flag is refused before any model is looked for.
    # In this process (test_cli_generate runs `python -m agentrt`): a process would spend
    # ~2.4 s of CPU importing torch for this.
    from agentrt.cli import main

    missing = str(tmp_path / "no-such-model.gguf")
    assert main(["generate", "hi", "--temperature", "-1", "--model", missing]) == 2
    assert "temperature=-1.0 is invalid" in capsys.readouterr().err


def test_bf16_engine_answers_like_fp32(smollm2_dir):
    from agentrt.engine.client.llm import LLM

    llm = LLM(None, dtype="bfloat16", kv_cache_memory_gb=0.1)
    assert llm.runner.kv_caches[0].dtype == torch.bfloat16
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, GREEDY)
    assert "Paris" in out.outputs[0].text


def test_cli_chat_reads_turns_from_stdin(smollm2_dir):
    # --dtype float32: the exact weights. The default native Q4_1 path answers this 135M
    # model's near-tie off Paris, as llama.cpp does on the same file ("L'Étoile, la Cité...").
    result = subprocess.run(
        [sys.executable, "-m", "agentrt", "chat", "--dtype", "float32", "--max-tokens", "24"],
        input="What is the capital of France?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "assistant> " in result.stdout and "Paris" in result.stdout
