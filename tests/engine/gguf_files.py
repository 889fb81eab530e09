"""Synthetic llama.cpp-style GGUF files for the loader tests, written with gguf-py.

A tiny Llama or Qwen2 (q/k/v biases) with random weights in any GGML block type: Q4_0 /
Q4_1 / Q5_0 / Q5_1 / Q8_0 quantized by gguf-py from random fp32 values, K-quants written as
raw random blocks whose fp16 scales are set so the weights have an RMS of ~0.05 (random
bytes are valid blocks of every type otherwise). The tokenizer is the embedded SmolLM2's cut to its first
TINY_VOCAB tokens (specials, bytes and the merges among them), so the files stay small.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from agentrt.engine.loader.gguf_file import embedded_gguf_path, open_gguf

Q = gguf.GGMLQuantizationType
TINY_VOCAB = 1024
# Byte offsets of each block type's fp16 scales (d, dmin ...) within one block.
_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
BLOCK_TYPES = (*QUANTIZABLE, *_SCALE_OFFSETS)


def random_blocks(rows: int, cols: int, qtype: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 (rows, row bytes) of `qtype` blocks holding random weights of RMS ~0.05."""
    qtype = Q(qtype)
    if qtype in QUANTIZABLE:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        return gguf.quants.quantize(values, qtype)
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)

    def set_scales(scale: np.ndarray) -> None:  # (rows, blocks) fp32 -> every fp16 scale
        raw = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // elems, 2)
        for offset in _SCALE_OFFSETS[qtype]:
            blocks[..., offset : offset + 2] = raw

    # Weights are linear in the scales: measure the RMS with scales of 1, then set each
    # block's to what gives ~0.05, times a random factor per block.
    set_scales(np.ones((rows, cols // elems), np.float32))
    rms = float(np.sqrt(np.mean(gguf.quants.dequantize(blocks.reshape(rows, -1), qtype) ** 2)))
    set_scales(0.05 / rms * (0.5 + rng.random((rows, cols // elems))))
    return blocks.reshape(rows, -1)


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (the loader undoes it)."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, 2, half, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    projection_type: int = Q.Q8_0,
    v_type: int | None = None,
    vocab_type: int = Q.Q8_0,
    hidden: int = 256,
    intermediate: int = 512,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
    seed: int = 0,
) -> Path:
    """A GGUF file of a random `arch` ("llama", "qwen2" or "qwen3") model; its projections in
    `projection_type` (attn_v in `v_type` if given, as Q4_K_M mixes Q4_K and Q6_K), the
    embedding (and untied output) in `vocab_type`, norms and biases F32."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY_VOCAB)
    _add_tokenizer(writer)

    def add(name: str, rows: int, cols: int, qtype: int) -> None:
        if Q(qtype) == Q.F32:
            values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
            writer.add_tensor(name, values)
            return
        blocks = random_blocks(rows, cols, qtype, rng)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=Q(qtype))

    def vector(name: str, size: int, center: float) -> None:
        writer.add_tensor(name, (center + 0.1 * rng.standard_normal(size)).astype(np.float32))

    add("token_embd.weight", TINY_VOCAB, hidden, vocab_type)
    vector("output_norm.weight", hidden, 1.0)
    if not tied:
        add("output.weight", TINY_VOCAB, hidden, vocab_type)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0)
        vector(p + "ffn_norm.weight", hidden, 1.0)
        add(p + "attn_q.weight", q_rows, hidden, projection_type)
        add(p + "attn_k.weight", kv_rows, hidden, projection_type)
        add(p + "attn_v.weight", kv_rows, hidden, projection_type if v_type is None else v_type)
        add(p + "attn_output.weight", hidden, q_rows, projection_type)
        add(p + "ffn_gate.weight", intermediate, hidden, projection_type)
        add(p + "ffn_up.weight", intermediate, hidden, projection_type)
        add(p + "ffn_down.weight", hidden, intermediate, projection_type)
        if arch == "qwen2":
            for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                vector(f"{p}{part}.bias", rows, 0.0)
        if arch == "qwen3":  # RMSNorm weights of each query and key head
            vector(p + "attn_q_norm.weight", head_dim, 1.0)
            vector(p + "attn_k_norm.weight", head_dim, 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    fields = open_gguf(embedded_gguf_path()).reader.fields
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    tokens = fields["tokenizer.ggml.tokens"][:TINY_VOCAB]
    kept = set(tokens)
    merges = [
        m
        for m in fields["tokenizer.ggml.merges"]
        if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept
    ]
    writer.add_token_list(tokens)
    writer.add_token_types(fields["tokenizer.ggml.token_type"][:TINY_VOCAB])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(fields["tokenizer.chat_template"])
