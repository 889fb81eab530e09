"""A GGUF file's tokenizer, built with the `tokenizers` library from the file's own fields.

llama.cpp stores the vocabulary under `tokenizer.ggml.*` (model, pre-tokenizer name, tokens,
token types, merges, scores, special ids). The `tokenizers.Tokenizer` built here is the one
transformers' GGUF converter builds from the same fields (`integrations/gguf`: its GPT-2 and
Llama tokenizer classes plus the per-`tokenizer.ggml.pre` split regexes), without importing
transformers (about 1 s and 60+ MiB on a start-up that needs neither):

    tokenizer.ggml.model "gpt2"   byte-level BPE (Llama 3, Qwen 2/2.5/3, SmolLM): the vocabulary
                                  in GPT-2's byte alphabet, the file's merges, a split regex by
                                  `tokenizer.ggml.pre`, ByteLevel decoding
    tokenizer.ggml.model "llama"  SentencePiece BPE (Llama 2, Mistral v1, TinyLlama): Metaspace
                                  with a prefix `▁`, byte fallback, merges from the file or
                                  recovered from the scores; by `general.architecture`:
                                  gemma*  spaces made `▁` by a normalizer, split after each,
                                          no prefix; tokens of spaces spelled in `▁`, merges
                                          recovered in file order (Gemma's scores are not it)
                                  phi3    the prefix `▁` from a normalizer, no pre-tokenizer

Token types (llama.cpp's `TokenType`): CONTROL tokens become special added tokens, USER_DEFINED
ones plain added tokens (matched whole, as llama.cpp does), so `<|im_end|>` or `<tool_call>`
is never cut into pieces. Other tokenizer models raise `UnsupportedTokenizerError`: the
caller falls back to transformers' own converter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

# llama.cpp's TokenType values.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The split regexes of llama.cpp's pre-tokenizer names, as transformers' GGUF converter maps
# them (`GGUF_PRE_TOKENIZER_SPLITS`); any other name keeps GPT-2's own ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# Architectures whose SentencePiece files transformers converts unlike Llama's
# (`GGUF_SENTENCEPIECE_BUILDERS`).
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_PHI3_ARCHITECTURES = ("phi3",)


class UnsupportedTokenizerError(ValueError):
    """The file's tokenizer is not one this module builds (the caller may fall back)."""


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """What a tokenizer needs beyond its `tokenizers.Tokenizer`: the named special tokens
    (their text, None when the file names none), whether encoding adds BOS / EOS, the chat
    template and the context length."""

    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    model_max_length: int | None


def tokenizer_settings(fields: dict[str, Any], model_max_length: int | None) -> TokenizerSettings:
    """The special tokens and flags of a GGUF's tokenizer (transformers' `get_gguf_tokenizer`)."""
    tokens = fields["tokenizer.ggml.tokens"]

    def named(key: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = fields.get(
        "tokenizer.ggml.add_bos_token", fields.get("tokenizer.ggml.model") == "llama"
    )
    return TokenizerSettings(
        bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"),
        pad_token=named("padding_token_id"),
        unk_token=named("unknown_token_id"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
        model_max_length=model_max_length,
    )


def build_tokenizer(fields: dict[str, Any], settings: TokenizerSettings) -> Any:
    """The `tokenizers.Tokenizer` of a GGUF's `tokenizer.ggml.*` fields.

    Raises `UnsupportedTokenizerError` for a tokenizer model this module does not build.
    """
    model = fields.get("tokenizer.ggml.model")
    architecture = fields.get("general.architecture")
    if model == "gpt2":
        tokenizer, vocab = _byte_level(fields)
        default_specials: tuple[str, ...] = ("<|endoftext|>",)
    elif model == "llama" and architecture in _GEMMA_ARCHITECTURES:
        tokenizer, vocab = _gemma(fields)
        default_specials = ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>")
    elif model == "llama":
        tokenizer, vocab = _sentencepiece(fields, phi3=architecture in _PHI3_ARCHITECTURES)
        default_specials = ("<unk>", "<s>", "</s>")
    else:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {model!r} of architecture {architecture!r} is not built "
            "natively (supported: 'gpt2' and 'llama')"
        )
    # CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens; then
    # the tokenizer classes' default specials and the file's named ones, as special added
    # tokens (only those the vocabulary has: a new id would outgrow the model).
    control, user_defined = _file_added_tokens(fields, vocab, byte_level=model == "gpt2")
    named = (settings.bos_token, settings.eos_token, settings.unk_token, settings.pad_token)
    registered = set(control) | set(user_defined)
    specials = [
        t
        for t in dict.fromkeys([*default_specials, *(t for t in named if t is not None)])
        if t in vocab and t not in registered
    ]
    _add(tokenizer, control, special=True)
    _add(tokenizer, user_defined, special=False)
    _add(tokenizer, specials, special=True)
    tokenizer.post_processor = _post_processor(settings, tokenizer)
    return tokenizer


def _byte_level(fields: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = bytes_to_unicode()
    alphabet = frozenset(spelling.values())
    vocab = {}
    for index, token in enumerate(fields["tokenizer.ggml.tokens"]):
        if not set(token) <= alphabet:  # a token stored as text: spell its bytes
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(m.split(" ")) for m in fields.get("tokenizer.ggml.merges", ())]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _sentencepiece(fields: dict[str, Any], *, phi3: bool) -> tuple[Any, dict[str, int]]:
    """transformers' LlamaTokenizer of the file's vocabulary; with `phi3`, the `▁` prefix and
    spaces from a normalizer instead of Metaspace (a text that starts with spaces keeps one
    more `▁`: "  hi" -> ▁▁▁hi)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _file_merges(fields)
    if merges is None:
        merges = _merges_from_scores(
            vocab, dict(zip(tokens, fields["tokenizer.ggml.scores"], strict=True))
        )
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    if phi3:
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tokenizer.pre_tokenizer = None
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tokenizer, vocab


def _gemma(fields: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """transformers' GemmaTokenizer of the file's vocabulary: a token of two or more spaces,
    stored as spaces, is spelled in `▁` (as the normalizer writes them), and missing merges are
    recovered best-first in file order (Gemma's scores do not follow its merges)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = [
        "▁" * len(t) if " " in t and not t.strip() else t for t in fields["tokenizer.ggml.tokens"]
    ]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _file_merges(fields)
    if merges is None:
        merges = _merges_from_scores(vocab, {t: -i for i, t in enumerate(tokens)})
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            unk_token="<unk>",
            dropout=None,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer, vocab


def _file_merges(fields: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The file's merges; None when it has none (a SentencePiece vocabulary's are recovered)."""
    if "tokenizer.ggml.merges" not in fields:
        return None
    return [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best-scored token first, then the longer left and right pieces (transformers'
    `generate_merges`)."""
    merges = []
    for merge, piece_score in scores.items():
        local = []
        for index in range(1, len(merge)):
            left, right = merge[:index], merge[index:]
            if left in vocab and right in vocab:
                local.append((left, right, piece_score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _file_added_tokens(
    fields: dict[str, Any], vocab: dict[str, int], *, byte_level: bool
) -> tuple[list[str], list[str]]:
    """(CONTROL, USER_DEFINED) tokens of the file, in id order. In a byte-level vocabulary a
    CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped,
    as transformers does."""
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or ()
    alphabet = frozenset(bytes_to_unicode().values()) if byte_level else None
    control = [
        token
        for token, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    user_defined = [
        token
        for token, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    return control, user_defined


def _add(tokenizer: Any, texts: list[str], *, special: bool) -> None:
    from tokenizers import AddedToken

    if texts:
        added = [AddedToken(t, normalized=False, special=special) for t in texts]
        if special:
            tokenizer.add_special_tokens(added)
        else:
            tokenizer.add_tokens(added)


def _post_processor(settings: TokenizerSettings, tokenizer: Any) -> Any:
    """BOS / EOS around each sequence as the settings ask (transformers'
    `update_post_processor`)."""
    from tokenizers import processors

    bos, eos = settings.bos_token, settings.eos_token
    add_bos = settings.add_bos_token and bos is not None
    add_eos = settings.add_eos_token and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = (
        f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    )
    special = []
    if add_bos:
        special.append((bos, tokenizer.token_to_id(bos)))
    if add_eos:
        special.append((eos, tokenizer.token_to_id(eos)))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as one printable character (byte-level BPE spells
    every token in it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))
