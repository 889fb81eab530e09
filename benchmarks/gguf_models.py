"""The model files benchmarks/gguf.py measures, made the way users' files are made.

A real "Q4_K_M" is a mix that depends on the model's shape (issue 39): Qwen2.5-0.5B's hidden
size 896 is not a multiple of 256, so llama.cpp's quantizer falls back to Q5_0 for most of it
and its tied 151,936-row output is Q8_0; Qwen2.5-1.5B is Q4_K + Q6_K with a Q6_K output. So
each file here goes through the same two tools a published GGUF went through:

    random HF checkpoint (config.json of the model's shape, F16 safetensors, its tokenizer)
      -> llama.cpp's convert_hf_to_gguf.py (F16 GGUF: tensor names, metadata, tokenizer,
         rope_freqs for llama3 scaling, exactly as the converter writes them)
      -> llama.cpp's quantizer (llama_model_quantize: the type mix of each quant kind)

Weights are normal(0, WEIGHT_STD), norms 1, seeded; the tokenizers are real: Qwen2.5's
(tests/data/qwen2.5-instruct) for the Qwen shapes, the embedded SmolLM2's for the llama ones
(the converter pads its 49,152 tokens to the shape's vocabulary). The configs are the
published ones' fields that decide the file (sizes, heads, vocabulary, tying, rope).

Gemma 3's and Phi-3's converters need a SentencePiece `tokenizer.model` (without one Gemma's
falls back to tokenizer.json and cuts the embedding to that vocabulary; Phi-3's stops), and
none is available offline, so the "gemma3" and "phi3" tokenizers are written here
(`write_sentencepiece`): the family's vocabulary size, its special tokens at their ids, byte
fallback, and pieces built as concatenations, with the family's chat template. The benchmark's
prompts for Gemma 3 are the embedded SmolLM2 tokenizer's ids (valid ids of its 262,144): it
measures speed, and the text of a random model does not matter; Phi-3's 32,064 ids are fewer
than SmolLM2's, so its prompts are its own tokenizer's (read from the file).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

WEIGHT_STD = 0.02
QWEN_TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen2.5-instruct"
GEMMA3_TEMPLATE = (
    Path(__file__).resolve().parents[1] / "tests" / "data" / "chat_templates" / "gemma-3-it.jinja"
)
# Bump when the checkpoint writer changes: it is in the cached files' names.
VERSION = 2


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    tokenizer: str  # "qwen2.5", "smollm2", or one written here: "gemma3", "phi3"
    config: dict  # config.json fields
    # benchmarks/gguf.py's targets this shape is held to instead of its TARGETS' (issue 40's
    # families and MoE: decode >= 1.0x llama.cpp; a MoE's batch of 16 >= 2x its one request).
    targets: dict = field(default_factory=dict)


def _qwen2(hidden, layers, ffn, heads, kv_heads, tied) -> dict:
    return dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=151936,
        tie_word_embeddings=tied,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _llama_style(architecture, model_type, hidden, layers, ffn, heads, kv_heads) -> dict:
    return dict(
        architectures=[architecture],
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )


SHAPES = {
    s.name: s
    for s in (
        ModelShape("qwen2.5-0.5b", "qwen2.5", _qwen2(896, 24, 4864, 14, 2, tied=True)),
        # Published tied (its Q4_K_M is 1,066 MiB; untied, the Q6_K output would add 191).
        ModelShape("qwen2.5-1.5b", "qwen2.5", _qwen2(1536, 28, 8960, 12, 2, tied=True)),
        ModelShape(
            "llama-3.2-1b",
            "smollm2",
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                hidden_size=2048,
                num_hidden_layers=16,
                intermediate_size=8192,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                vocab_size=128256,
                tie_word_embeddings=True,
                rope_theta=500000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=32.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8192,
                ),
                rms_norm_eps=1e-5,
                max_position_embeddings=131072,
                bos_token_id=1,
                eos_token_id=2,
            ),
        ),
        ModelShape(
            "qwen3-0.6b",
            "qwen2.5",  # Qwen3 keeps Qwen2.5's byte-level BPE and 151,936-row vocabulary
            dict(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                hidden_size=1024,
                num_hidden_layers=28,
                intermediate_size=3072,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                tie_word_embeddings=True,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                max_position_embeddings=40960,
                bos_token_id=151643,
                eos_token_id=151645,
            ),
        ),
        # Issue 40's dense families at their real small sizes, on the llama-style tokenizer.
        ModelShape(
            "smollm3-3b",
            "smollm2",
            dict(
                _llama_style("SmolLM3ForCausalLM", "smollm3", 2048, 36, 11008, 16, 4),
                vocab_size=128256,
                tie_word_embeddings=True,
                rope_theta=5000000.0,
                no_rope_layer_interval=4,  # every fourth layer rotates nothing (NoPE)
                max_position_embeddings=65536,
            ),
            targets={"decode": 1.0},
        ),
        ModelShape(
            "granite-3.3-2b",
            "smollm2",
            dict(
                _llama_style("GraniteForCausalLM", "granite", 2048, 40, 8192, 32, 8),
                vocab_size=49159,
                tie_word_embeddings=True,
                rope_theta=10000000.0,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.015625,
                logits_scaling=8.0,
                max_position_embeddings=131072,
            ),
            targets={"decode": 1.0},
        ),
        ModelShape(
            "olmo2-1b",
            "smollm2",
            dict(
                _llama_style("Olmo2ForCausalLM", "olmo2", 2048, 16, 8192, 16, 16),
                vocab_size=100352,
                tie_word_embeddings=False,
                rope_theta=500000.0,
                max_position_embeddings=4096,
            ),
            targets={"decode": 1.0},
        ),
        # Gemma 3 1B (issue 40): 4 query heads and 1 KV head of 256, a 262,144-row tied
        # embedding, sliding window 512 on 5 of every 6 layers (rope 10k local, 1M global).
        ModelShape(
            "gemma3-1b",
            "gemma3",
            dict(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                hidden_size=1152,
                num_hidden_layers=26,
                intermediate_size=6912,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=256,
                vocab_size=262144,
                tie_word_embeddings=True,
                rope_theta=1000000.0,
                rope_local_base_freq=10000.0,
                sliding_window=512,
                sliding_window_pattern=6,
                query_pre_attn_scalar=256,
                rms_norm_eps=1e-6,
                max_position_embeddings=32768,
                bos_token_id=2,
                eos_token_id=[1, 106],
                pad_token_id=0,
            ),
            targets={"decode": 1.0},
        ),
        # Phi-3.5-mini (issue 40): q/k/v and gate/up fused, 32 heads of 96, an untied
        # 32,064-row output, LongRoPE to 128k (48 short and long factors: smooth ramps of the
        # published ones' ranges, 1-2.6 and 1.08-66).
        ModelShape(
            "phi3.5-mini",
            "phi3",
            dict(
                _llama_style("Phi3ForCausalLM", "phi3", 3072, 32, 8192, 32, 32),
                vocab_size=32064,
                tie_word_embeddings=False,
                rope_theta=10000.0,
                rope_scaling=dict(
                    type="longrope",
                    short_factor=[round(1 + 1.6 * (i / 47) ** 2, 4) for i in range(48)],
                    long_factor=[round(1.08 * 61 ** (i / 47), 4) for i in range(48)],
                ),
                max_position_embeddings=131072,
                original_max_position_embeddings=4096,
                sliding_window=262144,
                rms_norm_eps=1e-5,
                eos_token_id=32000,
                pad_token_id=32000,
            ),
            targets={"decode": 1.0},
        ),
        # A sparse MoE (issue 40): Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV
        # heads, experts of 768, top 8 renormalised) with 48 of its 128 experts and 20 of its
        # 48 layers: a ~3.4 GiB Q4_K_M, of which a token reads ~0.6 GiB.
        ModelShape(
            "qwen3-moe-48e",
            "qwen2.5",
            dict(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                hidden_size=2048,
                num_hidden_layers=20,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=48,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
                tie_word_embeddings=False,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                max_position_embeddings=40960,
                bos_token_id=151643,
                eos_token_id=151645,
            ),
            targets={"decode": 1.0, "batch": 2.0},
        ),
        # The shape the benchmark measured before the real mixes (issue 26's runs).
        ModelShape(
            "tinyllama-1.1b",
            "smollm2",
            dict(
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                hidden_size=2048,
                num_hidden_layers=22,
                intermediate_size=5632,
                num_attention_heads=32,
                num_key_value_heads=4,
                vocab_size=49152,
                tie_word_embeddings=False,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                max_position_embeddings=2048,
                bos_token_id=1,
                eos_token_id=2,
            ),
        ),
    )
}


def save_tokenizer(name: str, folder: Path) -> None:
    """The tokenizer files of `name` into `folder` (tokenizer.json, its config, template)."""
    if name == "qwen2.5":
        for path in QWEN_TOKENIZER.iterdir():
            shutil.copy(path, folder / path.name)
        return
    if name in SENTENCEPIECES:
        write_sentencepiece(folder, SENTENCEPIECES[name])
        return
    from transformers import AutoTokenizer

    from agentrt.engine.loader.checkpoint import gguf_source

    source = gguf_source(None)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(folder)


@dataclass(frozen=True, slots=True)
class SentencePiece:
    """A family's SentencePiece tokenizer as `write_sentencepiece` writes it."""

    num_pieces: int  # in tokenizer.model
    leading: dict[int, str]  # the pieces before the byte pieces, by id
    # The trainer's unk, bos, eos and pad ids in that order (None: the model has none).
    trainer_ids: tuple[int | None, int | None, int | None, int | None]
    added: dict[int, str]  # tokenizer_config's special tokens (past num_pieces: added ones)
    specials: dict[str, str]  # special_tokens_map.json
    chat_template: str
    config: dict = field(default_factory=dict)  # more of tokenizer_config.json


# sentencepiece_model.proto's piece types and BPE model type.
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_BYTE, _SP_BPE = 1, 2, 3, 4, 6, 2
_GEMMA3_SPECIALS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    105: "<start_of_turn>",
    106: "<end_of_turn>",
}
# Phi-3.5-mini's added tokens (its other ids up to 32,063 the converter pads).
_PHI3_ADDED = {
    32000: "<|endoftext|>",
    32001: "<|assistant|>",
    32006: "<|system|>",
    32007: "<|end|>",
    32010: "<|user|>",
}
_PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == "
    "'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
)
SENTENCEPIECES = {
    # Gemma 3's 262,144 ids: its specials at their ids, the rest of 0-106 its <unusedN>.
    "gemma3": SentencePiece(
        262144,
        {i: _GEMMA3_SPECIALS.get(i, f"<unused{i - 5}>") for i in range(107)},
        (3, 2, 1, 0),
        {i: piece for i, piece in _GEMMA3_SPECIALS.items() if i != 4},
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
        GEMMA3_TEMPLATE.read_text(),
    ),
    # Phi-3's (Llama 2's): <unk> <s> </s>, 32,000 pieces, then its added chat tokens.
    "phi3": SentencePiece(
        32000,
        {0: "<unk>", 1: "<s>", 2: "</s>"},
        (0, 1, 2, None),
        _PHI3_ADDED,
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>"}
        | {"pad_token": "<|endoftext|>"},
        _PHI3_TEMPLATE,
        {"tokenizer_class": "LlamaTokenizer"},  # Phi-3's converter reads it
    ),
}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, value: int | float | bytes | str) -> bytes:
    """One protobuf field: a varint (int, bool), a 32-bit float or a length-delimited one."""
    import struct

    if isinstance(value, float):
        return _varint(number << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode("utf-8") if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def sentencepiece_pieces(spec: SentencePiece) -> list[tuple[str, float, int]]:
    """`spec.num_pieces` (piece, score, type): the leading pieces at their ids (<unk> unknown,
    chat tokens and <unusedN> user-defined, the others control), the 256 byte pieces, then
    single characters and pieces of 2-4 letters (each the concatenation of two earlier ones,
    so BPE merges exist for all), scored by rank as a BPE model's are."""
    pieces = []
    for piece in spec.leading.values():
        kind = _SP_UNKNOWN if piece == "<unk>" else _SP_CONTROL
        if piece in ("<start_of_turn>", "<end_of_turn>") or piece.startswith("<unused"):
            kind = _SP_USER_DEFINED
        pieces.append((piece, 0.0, kind))
    pieces += [(f"<0x{b:02X}>", 0.0, _SP_BYTE) for b in range(256)]
    chars = ["\u2581", "\n", *(chr(c) for c in range(33, 127))]
    letters = ["\u2581", *"etaoinshrdlcumwfgypbvkjxqz", *"ETAOINSHRDLCUMWFGYPBVKJXQZ"]
    need, known = spec.num_pieces - len(pieces), set(chars)
    words: list[str] = list(chars)
    level = letters
    while len(words) < need:
        level = [a + b for a in level for b in letters[1:]][: need - len(words) + len(chars)]
        words += [w for w in level if w not in known]
    words = words[:need]
    pieces += [(w, -float(rank), _SP_NORMAL) for rank, w in enumerate(words)]
    return pieces


def write_sentencepiece(folder: Path, spec: SentencePiece) -> None:
    """A `tokenizer.model` of `spec` (a sentencepiece ModelProto, written by hand: the
    protobuf fields of sentencepiece_model.proto), its tokenizer_config.json (the specials
    and the chat template) and special_tokens_map.json into `folder`."""
    pieces = sentencepiece_pieces(spec)
    proto = bytearray()
    for piece, score, kind in pieces:
        proto += _field(1, _field(1, piece) + _field(2, score) + _field(3, kind))
    trainer = _field(3, _SP_BPE) + _field(4, len(pieces)) + _field(35, 1)  # byte_fallback
    for number, index in enumerate(spec.trainer_ids):  # unk, bos, eos, pad: id, piece
        if index is not None:
            trainer += _field(40 + number, index) + _field(45 + number, spec.leading[index])
    proto += _field(2, trainer)
    normalizer = _field(1, "identity") + _field(3, 0) + _field(4, 0) + _field(5, 1)
    proto += _field(3, normalizer)
    (folder / "tokenizer.model").write_bytes(bytes(proto))
    decoder = {str(i): {"content": piece, "special": True} for i, piece in spec.added.items()}
    tokenizer_config = {
        **spec.specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "chat_template": spec.chat_template,
        **spec.config,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "special_tokens_map.json").write_text(json.dumps(spec.specials))


def write_checkpoint(folder: Path, shape: ModelShape, seed: int) -> None:
    """A random HF checkpoint of `shape`: config.json, F16 safetensors (2-D and 3-D weights
    and biases normal(0, WEIGHT_STD), norms 1) and the tokenizer. The tensor names and shapes
    are transformers' own for the architecture (its model built on the meta device). Written
    a shard per layer (model.safetensors.index.json), so a model of several GiB never sits in
    memory whole."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    fields = dict(shape.config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}

    def write(key: str, tensors: dict[str, torch.Tensor]) -> None:
        file = f"model-{key}.safetensors"
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))

    rest: dict[str, torch.Tensor] = {}  # embedding, final norm, output: written last
    layer, tensors = None, {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            tensor = torch.ones(param.shape, dtype=torch.float16)
        else:
            tensor = (torch.randn(param.shape, generator=generator) * WEIGHT_STD).half()
        if not name.startswith("model.layers."):
            rest[name] = tensor
            continue
        if name.split(".")[2] != layer and tensors:  # the layer before is whole: write it
            write(layer, tensors)
            tensors = {}
        layer = name.split(".")[2]
        tensors[name] = tensor
    write(layer, tensors)
    write("rest", rest)
    index_json = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json))
    (folder / "config.json").write_text(json.dumps(shape.config | {"torch_dtype": "float16"}))
    save_tokenizer(shape.tokenizer, folder)


def convert(llama_python: str, llama_cpp_dir: Path, checkpoint: Path, target: Path) -> None:
    """llama.cpp's own converter: `checkpoint` -> an F16 GGUF at `target`. It runs in
    `llama_python`, which needs the converter's requirements (torch, transformers,
    safetensors, sentencepiece, numpy); its gguf-py is the one beside it."""
    script = llama_cpp_dir / "convert_hf_to_gguf.py"
    command = [llama_python, str(script), str(checkpoint), "--outfile", str(target)]
    done = subprocess.run(command + ["--outtype", "f16"], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{script} exited {done.returncode} on {checkpoint}:\n{tail}")
