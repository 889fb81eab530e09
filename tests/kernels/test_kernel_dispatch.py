"""Package boundary: dispatch routes CPU tensors to the references, the package imports
without Triton, and it imports nothing from other agentrt packages."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import agentrt.kernels as kernels
from agentrt.kernels import dispatch

KERNELS_DIR = pathlib.Path(kernels.__file__).parent


def test_cpu_tensors_use_the_references(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "paged_attention_ref", lambda *a, **k: calls.append("ref"))
    q = torch.zeros(1, 2, 8)
    kernels.paged_attention(q, torch.zeros(1, 2, 16, 2, 8), None, None, None)
    assert calls == ["ref"]
    assert not kernels.uses_triton(q)


def test_dispatch_results_equal_references():
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
