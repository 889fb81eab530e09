"""Package boundary: dispatch routes CUDA tensors to the Triton kernels and CPU tensors to
the references, the package imports without Triton, and it imports nothing from other
agentrt packages."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import agentrt.kernels as kernels
from agentrt.kernels import dispatch

KERNELS_DIR = pathlib.Path(kernels.__file__).parent

DISPATCHED = {
    "reshape_and_cache": "triton_reshape_and_cache",
    "paged_attention": "triton_paged_attention",
    "apply_token_bitmask": "triton_bitmask",
    "rms_norm": "triton_rms_norm",
    "rotary_embedding": "triton_rotary",
}


# The public signature of each dispatched kernel (vLLM's argument names), as callers see it.
SIGNATURES = {
    "reshape_and_cache": ["key", "value", "kv_cache", "slot_mapping"],
    "paged_attention": [
        "query",
        "kv_cache",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "scale",
        "max_query_len",
        "max_seq_len",
        "out",
    ],
    "apply_token_bitmask": ["logits", "bitmask", "indices"],
    "rms_norm": ["x", "weight", "eps", "residual"],
    "rotary_embedding": ["positions", "query", "key", "cos_sin_cache", "head_size", "is_neox"],
}


@pytest.mark.parametrize("name", sorted(DISPATCHED))
def test_dispatch_shows_the_kernels_public_signature(name):
    fn = getattr(kernels, name)
    assert list(inspect.signature(fn).parameters) == SIGNATURES[name]
    assert fn.__name__ == name and fn.__doc__.strip()  # help() shows the reference's text


@pytest.fixture
def fake_triton(monkeypatch):
    """Fake `triton_*` modules whose kernels record their calls, and a dispatch that takes
    meta tensors for CUDA ones: the routing is tested without Triton or CUDA."""
    calls = []
    for name, module in DISPATCHED.items():
        fake = types.ModuleType(module)
        kernel = functools.partial(lambda n, *a, **k: calls.append((n, a, k)) or "triton", name)
        setattr(fake, f"{name}_triton", kernel)
        monkeypatch.setitem(sys.modules, f"agentrt.kernels.{module}", fake)
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: t.device.type == "meta")
    return calls


@pytest.mark.parametrize("name", sorted(DISPATCHED))
def test_cuda_tensors_go_to_the_triton_kernel(fake_triton, name):
    fn = getattr(kernels, name)
    first = torch.zeros(1, device="meta")
    assert fn(first, 1, 2, extra=3) == "triton"
    first_param = next(iter(inspect.signature(fn).parameters))
    assert fn(**{first_param: first}) == "triton"  # all by keyword
    assert fake_triton == [(name, (first, 1, 2), {"extra": 3}), (name, (), {first_param: first})]


def test_cpu_tensors_go_to_the_references(fake_triton):
    assert not kernels.uses_triton(torch.zeros(1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))
    logits = torch.randn(2, 40, generator=gen)
    mask = torch.tensor([[5, 0], [-1, 1]], dtype=torch.int32)
    kernels.apply_token_bitmask(logits, mask)
    # Row 0 allows tokens 0 and 2; row 1 allows 0..31 and 32.
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(33))
    assert fake_triton == []


def test_require_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(kernels.TritonUnavailableError, match=r"agentrt\[triton\]"):
        dispatch.require_triton()


def test_imports_and_runs_without_triton():
    # A meta-path hook makes `import triton` fail, as on a machine without the package.
    code = textwrap.dedent(
        """
        import sys
        class BlockTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")
        sys.meta_path.insert(0, BlockTriton())
        import torch
        import agentrt.kernels as k
        assert not k.triton_available()
        assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
        x = torch.ones(2, 8)
        out = k.rms_norm(x, torch.ones(8), 1e-6)
        assert torch.allclose(out, torch.ones(2, 8), atol=1e-3)
        try:
            k.require_triton()
        except k.TritonUnavailableError:
            print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_package_imports_nothing_local():
    for path in KERNELS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("agentrt"), f"{path.name}: {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("agentrt"), f"{path.name}: {alias.name}"


def test_only_triton_modules_import_triton_at_top_level():
    for path in KERNELS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
        imports_triton = any(n == "triton" or n.startswith("triton.") for n in names)
        assert imports_triton == path.name.startswith("triton_"), path.name
