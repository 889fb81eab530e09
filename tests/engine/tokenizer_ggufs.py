"""GGUF files that carry a real tokenizer, written with gguf-py as llama.cpp's
convert_hf_to_gguf.py writes them (`get_vocab_base` + `SpecialVocab`), for tokenizer tests:

- `write_qwen_tokenizer_gguf`: the real Qwen2.5 Instruct tokenizer (tests/data) in a qwen2
  file of `vocab_size` ids (151,936 as the released models: ids past the tokenizer's are
  `[PAD<id>]`, UNUSED), with one tiny layer of random weights so the engine loads it.
- `write_sentencepiece_gguf`: a small SentencePiece-style ("llama" model) vocabulary with
  scores and no merges, as Llama 2 / Mistral v1 files have (`architecture="phi3"`: a Phi-3
  file); `write_gemma_gguf`: Gemma's SentencePiece vocabulary in a gemma3 file.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

QWEN_DIR = Path(__file__).parents[1] / "data" / "qwen2.5-instruct"
QWEN_FILE_VOCAB = 151_936
TokenType = gguf.TokenType


def _looks_special(token: str) -> bool:
    """llama.cpp's `does_token_look_special`, for added tokens not marked special."""
    return (
        token in ("<pad>", "<mask>")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def qwen_vocab(vocab_size: int = QWEN_FILE_VOCAB) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the Qwen2.5 tokenizer as llama.cpp writes them."""
    data = json.loads((QWEN_DIR / "tokenizer.json").read_text())
    by_id = {index: token for token, index in data["model"]["vocab"].items()}
    added = {t["id"]: t for t in data["added_tokens"]}
    for index, token in added.items():
        by_id[index] = token["content"]
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            special = added[index]["special"] or _looks_special(by_id[index])
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def add_qwen_tokenizer(writer: gguf.GGUFWriter, vocab_size: int = QWEN_FILE_VOCAB) -> None:
    tokens, types, merges = qwen_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(151643)
    writer.add_eos_token_id(151645)
    writer.add_pad_token_id(151643)
    writer.add_add_bos_token(False)
    writer.add_chat_template((QWEN_DIR / "chat_template.jinja").read_text())


def write_qwen_tokenizer_gguf(path: Path, vocab_size: int = QWEN_FILE_VOCAB) -> Path:
    """A qwen2 GGUF with the real Qwen2.5 tokenizer and one tiny random F16 layer (tied)."""
    hidden, heads = 64, 2
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("tiny qwen2.5 tokenizer")
    writer.add_block_count(1)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(128)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_qwen_tokenizer(writer, vocab_size)
    head_dim = hidden // heads
    _write_one_layer(writer, vocab_size, hidden, (hidden, head_dim, head_dim), qkv_bias=True)
    return path


def _write_one_layer(
    writer: gguf.GGUFWriter,
    vocab_size: int,
    hidden: int,
    qkv_rows: tuple[int, int, int],
    qkv_bias: bool,
) -> None:
    """One tiny random F16 layer (FFN 128, tied embedding; q/k/v of `qkv_rows` rows, zero
    biases with `qkv_bias`), then the file written and closed."""
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float16))

    add("token_embd.weight", vocab_size, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for part, rows in zip(("attn_q", "attn_k", "attn_v"), qkv_rows, strict=True):
        add(f"blk.0.{part}.weight", rows, hidden)
        if qkv_bias:
            writer.add_tensor(f"blk.0.{part}.bias", np.zeros(rows, np.float32))
    add("blk.0.attn_output.weight", hidden, hidden)
    add("blk.0.ffn_gate.weight", 128, hidden)
    add("blk.0.ffn_up.weight", 128, hidden)
    add("blk.0.ffn_down.weight", hidden, 128)
    for norm in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SP_WORDS = ("hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog")


def sentencepiece_fields() -> dict:
    """A SentencePiece BPE vocabulary as llama.cpp stores one: `<unk>`, `<s>`, `</s>`, the 256
    byte tokens, single characters and word pieces with `▁`, scored (higher merges first)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces: list[str] = ["▁"] + sorted(set("".join(SP_WORDS)))
    for word in SP_WORDS:
        spelled = "▁" + word
        pieces += [spelled[:n] for n in range(2, len(spelled) + 1)]
    for piece in dict.fromkeys(pieces):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(len(tokens)))
    return {
        "tokens": tokens,
        "types": types,
        "scores": scores,
    }


def gemma_fields() -> dict:
    """A Gemma-style SentencePiece vocabulary as llama.cpp stores one: `<pad>`, `<eos>`,
    `<bos>`, `<unk>`, `<mask>`, turn markers (CONTROL and USER_DEFINED), the byte tokens, then
    pieces with and without `▁`, tokens of spaces stored as spaces and a newline run. Scores
    rise with the id, against the merge order (the file order is it: Gemma's scores are not)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [TokenType.CONTROL] * 5 + [TokenType.CONTROL, TokenType.USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces: list[str] = ["▁", "\n", "\n\n", "  ", "   ", "    "] + sorted(set("".join(SP_WORDS)))
    for word in SP_WORDS:
        for spelled in (word, "▁" + word):
            pieces += [spelled[:n] for n in range(2, len(spelled) + 1)]
    for piece in dict.fromkeys(pieces):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
    return {"tokens": tokens, "types": types, "scores": [float(i) for i in range(len(tokens))]}


def write_gemma_gguf(path: Path) -> Path:
    """A gemma3 GGUF whose tokenizer is `gemma_fields()` (no merges, BOS added, `<eos>` the
    end), with one tiny random F16 layer."""
    template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
        "{% endif %}"
    )
    return write_sentencepiece_gguf(
        path, "gemma3", gemma_fields(), bos_eos_unk_pad=(2, 1, 3, 0), template=template
    )


def write_sentencepiece_gguf(
    path: Path,
    architecture: str = "llama",
    fields: dict | None = None,
    bos_eos_unk_pad: tuple[int, int, int, int | None] = (1, 2, 0, None),
    template: str = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
        "{% endfor %}"
    ),
) -> Path:
    """An `architecture` GGUF whose tokenizer is `fields` (default `sentencepiece_fields()`;
    no merges, BOS added), with one tiny random F16 layer."""
    fields = fields or sentencepiece_fields()
    vocab = len(fields["tokens"])
    hidden = 64
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny sentencepiece")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_scores(fields["scores"])
    bos, eos, unk, pad = bos_eos_unk_pad
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(unk)
    if pad is not None:
        writer.add_pad_token_id(pad)
    writer.add_chat_template(template)
    _write_one_layer(writer, vocab, hidden, (hidden, hidden, hidden), qkv_bias=False)
    return path
