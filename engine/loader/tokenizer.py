"""`load_tokenizer(path)`: a resolved checkpoint's tokenizer, read offline.

    a .gguf file      -> FastTokenizer from the file's cached metadata (gguf_file.py): no
                         transformers import, so a GGUF start-up pays only for torch
    an HF directory   -> transformers' AutoTokenizer (tokenizer.json + tokenizer_config.json)

Both have the surface the engine, the SDK and the grammar use (fast_tokenizer.py lists it).
"""

from __future__ import annotations

import os
from typing import Any

from agentrt.engine.errors import ModelLoadError
from agentrt.engine.loader.gguf_file import is_gguf, load_gguf_tokenizer


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's tokenizer with its chat template. Raises `ModelLoadError` when a
    directory holds no usable tokenizer."""
    if is_gguf(path):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"no usable tokenizer in {path} (expected tokenizer.json / tokenizer_config.json "
            f"as written by `save_pretrained`): {exc}"
        ) from exc
