"""Shared fixtures: the embedded model, one fp32 LLM on it per session (loading takes
seconds; SDK tests drive its `engine` too), and tiny random checkpoints.

`smollm2_dir` is the embedded .gguf file; its config and tokenizer are cached in the real
user cache (`AGENTRT_CACHE_DIR`, else `$XDG_CACHE_HOME/agentrt`, else `~/.cache/agentrt`),
so only the first test run ever pays for reading them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agentrt.engine.client.llm import LLM
from agentrt.engine.loader.checkpoint import resolve_model
from agentrt.engine.model.tiny import make_tiny_checkpoint


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`: -n 2) the workers share the cores: each gets
    cores // workers torch and OpenMP threads (set before the workers start, which inherit
    it; an explicit OMP_NUM_THREADS / AGENTRT_NUM_THREADS wins). Two workers of 2 threads
    each on 2 cores ran the embedded model's batch 3.75x slower than two of 1 thread
    (30.5 vs 8.1 s): oversubscribed OpenMP threads spin against each other."""
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 2 or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(max(1, (cores or 1) // workers))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    os.environ.setdefault("AGENTRT_NUM_THREADS", threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker (`make test`: --dist loadfile --no-loadscope-reorder), files that
    hold a `slow` test are handed out first, then the rest by number of tests (xdist's own
    order): a long file started last keeps one worker busy alone at the end. Simulated on
    the suite's JUnit times (+-25% noise a file), the two workers' finishing gap: median
    12.0 -> 0.9 s, p90 24.8 -> 2.5 s. Within a file the order stays as collected."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)

    def order(path: Path) -> tuple[bool, int]:
        tests = by_file[path]
        return (not any(t.get_closest_marker("slow") for t in tests), -len(tests))

    items[:] = [item for path in sorted(by_file, key=order) for item in by_file[path]]


@pytest.fixture(scope="session", autouse=True)
def _transformers_imported() -> None:
    """Every engine builds its grammar compiler on a background thread from its start, which
    imports transformers (engine/core/structured_output.py). A test that first imports it
    on its own thread meanwhile (a tiny checkpoint, an HF tokenizer) can fail on
    transformers' lazy modules ("cannot import name ..."): imported once here first."""
    import transformers.tokenization_utils_fast  # noqa: F401


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct's .gguf file (what resolve_model(None) gives)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir: Path) -> LLM:
    """The embedded model in fp32 with a small KV pool. Tests must leave it idle."""
    return LLM(None, dtype="float32", kv_cache_memory_gb=0.25)


@pytest.fixture(scope="session")
def smollm2_default_llm(smollm2_dir: Path) -> LLM:
    """The embedded model as users run it (`LLM(None)`: the GGUF's own Q4_1 blocks, float32
    activations), with a small KV pool: a decode step several times cheaper than
    `smollm2_llm`'s dense fp32. For tests whose asserts do not need fp32 exactness (SDK
    behaviour, structured validity); equivalence with HF or between two fp32 paths stays on
    `smollm2_llm`. Tests must leave it idle."""
    return LLM(None, kv_cache_memory_gb=0.25)


@pytest.fixture(scope="session")
def tiny_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[[str], Path]:
    """`tiny_checkpoint(arch)` → a tiny random checkpoint directory (seed 0), built once per
    session per arch ("llama", "qwen2", "qwen3", "mistral"; see agentrt.engine.model.tiny)."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_tiny_checkpoint(arch, root / arch, tokenizer_from=smollm2_dir)
        return built[arch]

    return build


QWEN_TOKENIZER_DIR = Path(__file__).parent / "data" / "qwen2.5-instruct"


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """The real Qwen2.5 Instruct tokenizer and chat template (`<tool_call>` is one token)."""
    return QWEN_TOKENIZER_DIR


@pytest.fixture(scope="session")
def tiny_qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint with the real Qwen2.5 tokenizer (vocab 151,665)."""
    root = tmp_path_factory.mktemp("tiny-qwen")
    return make_tiny_checkpoint("qwen2", root, tokenizer_from=QWEN_TOKENIZER_DIR)


# Qwen3's reasoning switch, reduced: with enable_thinking false the template closes an empty
# block; otherwise the model opens `<think>` itself. Past turns are rendered as given.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
    " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is"
    " false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="session")
def tiny_think_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 checkpoint whose tokenizer (Qwen2.5's) has Qwen3's `<think>` and
    `</think>` as single tokens and a Qwen3-style template that takes enable_thinking."""
    from agentrt.engine.loader.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("tiny-think")
    tokenizer = load_tokenizer(QWEN_TOKENIZER_DIR)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(root / "tokenizer")
    return make_tiny_checkpoint("qwen3", root / "model", tokenizer_from=root / "tokenizer")
