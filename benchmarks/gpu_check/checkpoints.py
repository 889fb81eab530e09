"""Random checkpoints for the GPU check, built where it runs from the embedded model's
tokenizer (the embedded 98 MB GGUF does not travel to the GPU machine; its 3.5 MB
tokenizer does, in the carried folder that `make gpu-carry` fills).

- tiny-llama, tiny-qwen3: `agentrt.engine.model.tiny.make_tiny_checkpoint` (peaked logits).
- big: a Llama-3.2-1B-shaped random model (hidden 2048, 16 layers, 32 query / 8 KV heads,
  head_dim 64, MLP 8192, tied embeddings, the SmolLM2 vocabulary of 49,152: 1.07B
  parameters), written as an HF checkpoint in bf16 (2.1 GB) so fp32 and bf16 runs read
  the same values. The dry run writes the same architecture at toy width.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import Context

# The tokenizer files of a checkpoint directory that `load_tokenizer` reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_ARCHS = ("llama", "qwen3")

BIG_SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
}
# The dry run's stand-in: the same head_dim and GQA ratio, a toy width and depth.
DRY_BIG_SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 256,
}


def export_tokenizer(dest: Path) -> Path:
    """Write the embedded model's tokenizer files into `dest` (read from the embedded GGUF's
    metadata). Run here, where the embedded model is installed."""
    from agentrt.engine.loader.checkpoint import resolve_model
    from agentrt.engine.loader.tokenizer import load_tokenizer

    source = resolve_model(None)
    dest.mkdir(parents=True, exist_ok=True)
    load_tokenizer(source).save_pretrained(dest)
    if not (dest / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{source}'s tokenizer wrote no tokenizer.json")
    return dest


def tokenizer_source(ctx: Context) -> Path:
    """The carried tokenizer folder; the dry run exports one when none was carried."""
    if (ctx.tokenizer / "tokenizer.json").is_file():
        return ctx.tokenizer
    if not ctx.dry_run:
        raise FileNotFoundError(
            f"no tokenizer.json in {ctx.tokenizer}: run `make gpu-carry` on the machine the "
            "check is started from and carry the folder it fills"
        )
    return export_tokenizer(ctx.work / "tokenizer")


def build_big(path: Path, tokenizer_dir: Path, shape: dict, device: str, seed: int = 0) -> Path:
    """Write a random Llama checkpoint of `shape` (bf16 safetensors + tokenizer) to `path`,
    initialised on `device` (fast on a GPU) with HF's own initialisation (std 0.02)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from agentrt.engine.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        **shape,
    )
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # HF initialises norms to one, which would hide a missing norm
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=0.1)
    model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(ctx: Context) -> dict:
    from agentrt.engine.model.tiny import make_tiny_checkpoint

    tokenizer_dir = tokenizer_source(ctx)
    result: dict = {"tokenizer": str(tokenizer_dir)}
    archs = TINY_ARCHS[:1] if ctx.dry_run else TINY_ARCHS
    for arch in archs:
        start = time.perf_counter()
        make_tiny_checkpoint(arch, ctx.checkpoints / f"tiny-{arch}", tokenizer_from=tokenizer_dir)
        result[f"tiny-{arch}_s"] = round(time.perf_counter() - start, 1)
    shape = DRY_BIG_SHAPE if ctx.dry_run else BIG_SHAPE
    start = time.perf_counter()
    big = build_big(ctx.checkpoints / "big", tokenizer_dir, shape, ctx.device)
    result["big_s"] = round(time.perf_counter() - start, 1)
    result["big_shape"] = shape
    result["big_gb"] = round(sum(f.stat().st_size for f in big.glob("*.safetensors")) / 1e9, 2)
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return result
