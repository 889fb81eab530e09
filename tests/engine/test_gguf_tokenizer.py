"""A GGUF's tokenizer built from its own fields (loader/gguf_tokenizer.py) behind
`FastTokenizer` (loader/fast_tokenizer.py) equals transformers' own GGUF tokenizer: token ids,
decoded text, special tokens and chat templates, on the embedded SmolLM2 file, on the real
Qwen2.5 tokenizer written as llama.cpp writes it, and on a SentencePiece vocabulary."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from agentrt.engine.loader import gguf_file
from agentrt.engine.loader.fast_tokenizer import FastTokenizer
from agentrt.engine.loader.gguf_file import load_gguf_tokenizer, open_gguf
from agentrt.engine.loader.gguf_tokenizer import (
    UnsupportedTokenizerError,
    build_tokenizer,
    tokenizer_settings,
)
from agentrt.engine.loader.tokenizer import load_tokenizer

from .tokenizer_ggufs import SP_WORDS, write_qwen_tokenizer_gguf, write_sentencepiece_gguf

TEXTS = [
    "Hello world",
    "  leading  spaces\t\ttabs and\n\n\nnewlines \r\n end  ",
    "ünïcödé Ünïcode — 日本語のテキスト, 中文 ； 🤖🚀 emoji",
    "12345 678.9 1e10 3,141,592 007",
    "don't I'M we'll THEY'RE you've",
    '{"name": "John Smith", "age": 42, "tags": ["a", "b"]}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<|endoftext|><|endoftext|>text<|im_end|>",
    "a\u00a0b\u2003c\u200bd",
    "",
    " ",
    "x" * 300,
]
MESSAGES = [
    {"role": "system", "content": "You extract facts as JSON."},
    {"role": "user", "content": 'John Smith is 42. ü {"a": 1}\n\tend'},
    {"role": "assistant", "content": '{"name": "John Smith", "age": 42}'},
    {"role": "user", "content": "And  again?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city — ünïcode kept",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def assert_same_tokenizer(ours: Any, reference: Any, texts: list[str], round_trip: str) -> None:
    """Ids, decoded text, special tokens and the vocabulary of `ours` equal `reference`'s;
    `round_trip` decodes back to itself."""
    assert len(ours) == len(reference)
    assert ours.get_added_vocab() == reference.get_added_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
        ids = reference.encode(text)
        for skip in (True, False):
            decoded = ours.decode(ids, skip_special_tokens=skip)
            assert decoded == reference.decode(ids, skip_special_tokens=skip), (text, skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    assert ours.decode(ours.encode(round_trip, add_special_tokens=False)) == round_trip


def assert_same_chat(ours: Any, reference: Any, tools: list | None = None) -> None:
    for messages in (MESSAGES[:2], MESSAGES):
        for prompt in (True, False):
            kwargs = {"add_generation_prompt": prompt, "tools": tools}
            text = reference.apply_chat_template(messages, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == text
            ids = ours.apply_chat_template(messages, tokenize=True, **kwargs)
            assert ids == reference.encode(text, add_special_tokens=False)


# --- the embedded SmolLM2 (byte-level BPE, pre-tokenizer "smollm") --------------------------


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir.parent, gguf_file=smollm2_dir.name)


def test_embedded_tokenizer_equals_transformers(smollm2_dir, smollm2_reference) -> None:
    ours = load_tokenizer(smollm2_dir)
    assert isinstance(ours, FastTokenizer)
    assert_same_tokenizer(ours, smollm2_reference, TEXTS, TEXTS[2])
    assert_same_chat(ours, smollm2_reference)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert ours.model_max_length == 8192
    assert ours.chat_template == smollm2_reference.chat_template


def test_built_from_fields_equals_the_cached_one(smollm2_dir: Path) -> None:
    """What the cache holds is what the fields build (the cache only saves the build)."""
    fields = open_gguf(smollm2_dir).reader.fields
    settings = tokenizer_settings(fields, 8192)
    built = FastTokenizer(build_tokenizer(fields, settings), settings)
    cached = load_gguf_tokenizer(smollm2_dir)
    assert built.backend_tokenizer.to_str() == cached.backend_tokenizer.to_str()
    for text in TEXTS:
        assert built.encode(text) == cached.encode(text)


def test_first_start_builds_the_tokenizer_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a new file the tokenizer the metadata writer built is the one loaded: its JSON is
    not read back (one parse of the vocabulary, not two); later starts read the cache."""
    import tokenizers

    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf")
    from_str = tokenizers.Tokenizer.from_str
    parsed = []

    def counting_from_str(text: str) -> Any:
        parsed.append(len(text))
        return from_str(text)

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", counting_from_str)
    gguf_file.gguf_metadata(path)  # the config is read first, as the engine does
    fresh = load_tokenizer(path)
    assert parsed == []
    cached = load_tokenizer(path)
    assert len(parsed) == 1
    assert fresh.backend_tokenizer.to_str() == cached.backend_tokenizer.to_str()
    assert fresh.special_tokens_map == cached.special_tokens_map
    assert fresh.chat_template == cached.chat_template
    assert fresh.model_max_length == cached.model_max_length == 4096
    for text in (" ".join(SP_WORDS), "hello world ü"):
        assert fresh.encode(text) == cached.encode(text)


def test_a_copy_has_its_own_settings_and_shares_the_vocabulary(smollm2_dir: Path) -> None:
    """The engine deep-copies the tokenizer for its front-end thread: the copy's settings are
    its own, the Rust tokenizer (never changed after construction) is shared."""
    ours = load_gguf_tokenizer(smollm2_dir)
    twin = copy.deepcopy(ours)
    assert twin.backend_tokenizer is ours.backend_tokenizer
    twin.chat_template = "{{ messages[0]['content'] }}"
    twin.model_max_length = 16
    assert (ours.chat_template, ours.model_max_length) == (
        load_gguf_tokenizer(smollm2_dir).chat_template,
        8192,
    )
    assert twin.apply_chat_template(MESSAGES[1:2], tokenize=False) == MESSAGES[1]["content"]


def test_threads_share_one_tokenizer(smollm2_dir: Path) -> None:
    """Encoding, decoding and streaming decodes on four threads at once give what one
    thread gives (the engine thread and the front end share the Rust tokenizer)."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers.decoders import DecodeStream

    ours = load_gguf_tokenizer(smollm2_dir)
    texts = [t * 20 for t in TEXTS if t]

    def work(seed: int) -> list:
        twin = copy.deepcopy(ours)
        results = []
        for text in texts[seed % 3 :] * 3:
            ids = twin.encode(text)
            stream = DecodeStream(skip_special_tokens=False)
            pieces = [stream.step(twin.backend_tokenizer, i) for i in ids]
            results.append((ids, twin.decode(ids), "".join(p for p in pieces if p)))
        return results

    expected = [work(seed) for seed in range(8)]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(work, range(8))) == expected
    for _ids, decoded, streamed in expected[0]:
        assert streamed == decoded


def test_transformers_view_and_saved_copy_are_the_same_tokenizer(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """`to_transformers()` (what xgrammar and llguidance get) and `save_pretrained` (what tiny
    checkpoints copy) tokenize as the original does."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = load_gguf_tokenizer(smollm2_dir)
    view = ours.to_transformers()
    assert isinstance(view, PreTrainedTokenizerFast)
    ours.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    for other in (view, saved):
        assert_same_tokenizer(ours, other, TEXTS, TEXTS[2])
        assert_same_chat(ours, other)
        assert other.model_max_length == ours.model_max_length


def test_surface_the_engine_uses(smollm2_dir: Path) -> None:
    ours = load_gguf_tokenizer(smollm2_dir)
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2
    assert ours.convert_tokens_to_ids(["<|im_start|>", "no-such-token"]) == [1, 0]  # unk
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"
    assert ours.decode(2) == "<|im_end|>"
    assert ours.vocab_size == len(ours) == 49152
    assert 2 in ours.all_special_ids and "<|im_end|>" in ours.all_special_tokens
    assert ours("hi")["input_ids"] == ours.encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        FastTokenizer(ours.backend_tokenizer, _settings(chat_template=None)).apply_chat_template(
            MESSAGES
        )
    # continue_final_message leaves the last turn open, as transformers does
    text = ours.apply_chat_template(MESSAGES[:3], tokenize=False, continue_final_message=True)
    assert text.endswith(MESSAGES[2]["content"])


def _settings(**changes: Any) -> Any:
    import dataclasses

    from agentrt.engine.loader.gguf_tokenizer import TokenizerSettings

    base = TokenizerSettings(None, None, None, None, False, False, None, None)
    return dataclasses.replace(base, **changes)


# --- the real Qwen2.5 tokenizer (byte-level BPE, pre-tokenizer "qwen2") ----------------------


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory) -> Path:
    return write_qwen_tokenizer_gguf(tmp_path_factory.mktemp("qwen-gguf") / "qwen2.5.gguf")


@pytest.fixture()
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_qwen_tokenizer_equals_transformers(qwen_gguf: Path, private_cache: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    ours = load_tokenizer(qwen_gguf)
    assert len(ours) == 151_936  # the file's ids: the tokenizer's 151,665 plus [PAD] rows
    assert_same_tokenizer(ours, reference, TEXTS, TEXTS[2])
    assert_same_chat(ours, reference, tools=TOOLS)
    assert_same_chat(ours, reference)
    # <tool_call> is USER_DEFINED in the file: one token, not special (kept by skip_special)
    call_id = ours.convert_tokens_to_ids("<tool_call>")
    assert ours.encode("<tool_call>", add_special_tokens=False) == [call_id]
    assert ours.decode([call_id], skip_special_tokens=True) == "<tool_call>"
    assert ours.get_added_vocab()["<tool_call>"] == call_id


def test_qwen_tokenizer_equals_its_own_tokenizer_json(qwen_gguf, private_cache, qwen_tokenizer_dir):
    """Without transformers in the comparison: the GGUF's tokenizer tokenizes as Qwen2.5's own
    tokenizer.json, the file it was written from (digits one by one, whitespace runs,
    CJK, special and tool tokens), and renders its chat template the same."""
    import tokenizers

    own = tokenizers.Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))
    ours = load_tokenizer(qwen_gguf)
    for text in TEXTS:
        assert ours.encode(text) == own.encode(text).ids, text
        ids = own.encode(text).ids
        assert ours.decode(ids) == own.decode(ids, skip_special_tokens=False)
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text())
    assert ours.eos_token == config["eos_token"] == "<|im_end|>"
    assert ours.chat_template == (qwen_tokenizer_dir / "chat_template.jinja").read_text()
    assert "<tools>" in ours.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)


# --- SentencePiece ("llama" model, merges recovered from the scores) -------------------------


@pytest.mark.slow
def test_sentencepiece_tokenizer_equals_transformers(tmp_path: Path, private_cache: Path) -> None:
    from transformers import AutoTokenizer

    path = write_sentencepiece_gguf(tmp_path / "sp.gguf")
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_tokenizer(path)
    texts = [
        " ".join(SP_WORDS),
        "the  quick\nbrown",
        " hello",
        "hello world ü 😀",  # bytes by fallback
        "<s>the</s> dog",
        "",
    ]
    assert_same_tokenizer(ours, reference, texts, texts[3])
    assert ours.encode("the dog")[0] == ours.bos_token_id == 1  # llama.cpp adds BOS here
    assert_same_chat(ours, reference)


SP_TEXTS = [
    " ".join(SP_WORDS),
    "the  quick\nbrown",
    "  hello   world    fox",  # leading spaces, runs of spaces (tokens of spaces in Gemma)
    " hello",
    "hello\n\nworld\n",
    "hello world ü 😀",  # bytes by fallback
    "<start_of_turn>user\nthe dog<end_of_turn>",
    "",
]


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["gemma3", "phi3"])
def test_gemma_and_phi3_tokenizers_equal_transformers(
    architecture: str, tmp_path: Path, private_cache: Path
) -> None:
    """Gemma's and Phi-3's SentencePiece files are built without transformers (no fallback to
    its converter), as transformers builds them: Gemma's spaces, tokens of spaces and merges in
    file order, Phi-3's prefix from a normalizer."""
    from transformers import AutoTokenizer

    from .tokenizer_ggufs import write_gemma_gguf

    if architecture == "gemma3":
        path = write_gemma_gguf(tmp_path / "gemma.gguf")
    else:
        path = write_sentencepiece_gguf(tmp_path / "phi3.gguf", "phi3")
    fields = open_gguf(path).reader.fields
    built = build_tokenizer(fields, tokenizer_settings(fields, None))  # never falls back
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_tokenizer(path)
    assert built.to_str() == ours.backend_tokenizer.to_str()
    assert_same_tokenizer(ours, reference, SP_TEXTS, SP_TEXTS[2])
    assert ours.encode("the dog")[0] == ours.bos_token_id == reference.bos_token_id
    assert_same_chat(ours, reference)


def test_unsupported_tokenizer_model_falls_back(smollm2_dir: Path) -> None:
    fields = dict(open_gguf(smollm2_dir).reader.fields, **{"tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedTokenizerError, match="'t5'"):
        build_tokenizer(fields, tokenizer_settings(fields, None))


def test_config_keys_are_transformers_own() -> None:
    """The GGUF -> config key table read without transformers is transformers' table, for
    every architecture transformers reads GGUFs of."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    shared = [s for s in gguf_file.CONFIG_KEYS if s in GGUF_CONFIG_MAPPING]
    assert {"general", "tokenizer", "llama", "mistral", "qwen2", "qwen3"} <= set(shared)
    for section in shared:
        theirs = GGUF_CONFIG_MAPPING[section]
        assert gguf_file.CONFIG_KEYS[section] == {
            k: v for k, v in theirs.items() if v not in (None, -1)
        }, section


def test_template_helpers_render_as_transformers_renders_them(smollm2_dir: Path) -> None:
    """`{% generation %}` blocks, `tojson` of non-ASCII text, loop controls, and
    `raise_exception` (a jinja2 TemplateError, as in transformers) in a chat template."""
    import jinja2

    ours = load_gguf_tokenizer(smollm2_dir)
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}{{ raise_exception('no prompt here') }}{% endif %}"
    )
    text = ours.apply_chat_template(MESSAGES[:2], chat_template=template, tokenize=False)
    assert text == json.dumps(MESSAGES[1]["content"], ensure_ascii=False)
    with pytest.raises(jinja2.TemplateError, match="no prompt here"):
        ours.apply_chat_template(
            MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True
        )
