"""Building the kernels package's C sources (cpu_attention.c, cpu_ops.c) into shared libraries.

A source is compiled with the system C compiler (`$CC`, else `cc`) for this CPU
(-march=native, then any flags in `$AGENTRT_CPU_KERNEL_CFLAGS`, e.g. `-mno-avx512bf16`) into
`build_dir`, keyed by a hash of the source, the headers beside it (cpu_vec.h), the flags and
the CPU's feature flags, so a rebuilt or moved checkout never loads a stale or foreign
library. The build is atomic (compile to a temporary name, then rename), so concurrent
processes are safe. The libraries link against the libgomp torch already loaded, so
`torch.set_num_threads` governs them too.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from .errors import KernelBuildError

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compiler_flags(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return FLAGS + extra + tuple(os.environ.get("AGENTRT_CPU_KERNEL_CFLAGS", "").split())


def build_library(source_path: Path, build_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The built library of `source_path` (compiled now unless built before), with
    `extra_flags` after the defaults (one source built per instruction set, e.g.
    `("-mno-avx512f", "-DAGENTRT_ISA=1")`); raises KernelBuildError with the compiler's message
    when it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    flags = _compiler_flags(extra_flags)
    texts = [path.read_bytes() for path in (source_path, *sorted(source_path.parent.glob("*.h")))]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), _cpu_flags().encode()]))
    target = build_dir / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=build_dir)
    os.close(fd)
    try:
        _compile(compiler, flags, source_path, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile(compiler: str, flags: tuple[str, ...], source: Path, output: str) -> None:
    try:
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", output],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError as exc:
        raise KernelBuildError(
            f"no C compiler {compiler!r} to build {source.name} (set $CC or install gcc)."
        ) from exc
    if done.returncode != 0:
        raise KernelBuildError(
            f"compiling {source.name} with {compiler!r} failed:\n{done.stderr.strip()[-2000:]}"
        )
