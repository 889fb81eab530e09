"""Choosing the attention backend: `auto` takes the compiled CPU kernel when it builds and
falls back to the torch path, with a warning, when it cannot."""

from __future__ import annotations

import logging

import pytest
import torch

from agentrt.engine.attention import (
    CpuAttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
)
from agentrt.engine.errors import ConfigError
from agentrt.kernels import cpu_attention

CPU = torch.device("cpu")


@pytest.fixture
def no_compiler(tmp_path, monkeypatch):
    """A fresh kernel cache and a C compiler that always fails."""
    monkeypatch.setenv("AGENTRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    cpu_attention.cache_clear()
    yield
    cpu_attention.cache_clear()


def test_auto_picks_the_cpu_kernel_on_the_cpu():
    backend = get_attention_backend("auto", CPU)
    assert isinstance(backend, CpuAttentionBackend) and backend.name == "cpu"


def test_auto_falls_back_to_torch_when_the_kernel_cannot_build(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="agentrt.engine.attention"):
        backend = get_attention_backend("auto", CPU)
    assert type(backend) is TorchAttentionBackend
    assert "compiling cpu_attention.c with 'false' failed" in caplog.text
    assert "Falling back to the slower 'torch' attention backend" in caplog.text


def test_explicit_cpu_backend_raises_when_the_kernel_cannot_build(no_compiler):
    with pytest.raises(ConfigError, match="attention_backend='cpu' is unavailable"):
        get_attention_backend("cpu", CPU)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ConfigError, match="expected 'auto' or one of"):
        get_attention_backend("flash", CPU)
