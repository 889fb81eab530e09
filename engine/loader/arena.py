"""Memory for a GGUF file's interleaved weights, faulted in while torch is being imported.

On the CPU the loader copies each block-type weight into the kernels' interleaved layout
(load.py's `_Repacker`): new anonymous memory about the size of the file (0.9 GiB for
Qwen2.5-1.5B Q4_K_M). The kernel faults it in page by page as the repack threads first write
it, and those faults were most of the repack's CPU time: ~1 s of system time a GiB of 4 KiB
pages on the benchmark's virtual machine, against ~0.6 s of user time for the copy itself.
A fresh process spends its first 1.5-2 s importing torch on one core (the import holds the
GIL), and the other core idles meanwhile.

`prefaulted(model, options)` (LLM.__init__, before the engine and torch are imported) maps
one arena of the size the file's interleaved weights take and populates it on a thread of
its own (MADV_POPULATE_WRITE in ctypes calls, no GIL held): the faults are taken on the idle
core while torch imports. The repack takes its buffers from the arena in the order it asks
for them (`claim`, `WeightArena.empty`), and returns the part it did not use once the walk
is done (`WeightArena.finish`), before it copies. Whatever the arena cannot hold is
allocated as before; an arena nothing claims is unmapped when the engine is built or failed.

Only where that is what the load does: a .gguf file (or the embedded model), on the CPU,
in its own block formats (quantization "auto" or "gguf", dtype "auto"), one rank, on Linux;
and only for weights of at most half the available memory, as the engine's fit check
(fit.py, after torch's import) refuses a model too large before allocating anything.
Torch-free: importing this module, or preparing an arena, imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; refused before (the repack then faults as before)
_CHUNK = 16 << 20  # populated per call: `finish` waits for at most one
_ALIGN = 64  # each buffer's start, as torch's allocator aligns
# Q4_K's interleaved group of 16 rows is 2,368 bytes a 256-element block (its scales unpacked),
# the file's 16 blocks 2,304; every other type keeps its size.
_Q4_K_GROWTH = 2368 / 2304

_arenas: dict[str, WeightArena] = {}  # resolved file path -> an arena not yet claimed
_lock = threading.Lock()


class WeightArena:
    """`size` bytes of anonymous memory, populated from its start on a thread of its own
    until `finish`; `empty` hands out its bytes in order."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Private: the process's own anonymous memory (RssAnon), returned by MADV_DONTNEED.
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._used = 0
        self._tensor: torch.Tensor | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._populate, name="agentrt-prefault", daemon=True)
        self._thread.start()

    def _populate(self) -> None:
        madvise = _madvise()
        for start in range(0, self.size, _CHUNK):
            if self._stop.is_set():
                return
            if madvise(self._address + start, min(_CHUNK, self.size - start), _MADV_POPULATE_WRITE):
                return  # an older kernel: the pages are faulted in when first written

    def empty(self, rows: int, width: int) -> torch.Tensor | None:
        """A uint8 (rows, width) tensor of the arena's next bytes, or None when they do not
        fit (the caller allocates it)."""
        import torch

        start = -(-self._used // _ALIGN) * _ALIGN
        if start + rows * width > self.size:
            return None
        if self._tensor is None:  # holds the map: each view of it keeps the arena mapped
            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._used = start + rows * width
        return self._tensor[start : self._used].view(rows, width)

    def finish(self) -> None:
        """Stop populating and return the pages no buffer uses to the system (the mapping
        stays, unpopulated)."""
        self._stop.set()
        self._thread.join()
        page = mmap.PAGESIZE
        first = -(-self._used // page) * page
        if first < self.size:
            _madvise()(self._address + first, self.size - first, _MADV_DONTNEED)

    def close(self) -> None:
        """Finish, and unmap the arena if no buffer was taken from it."""
        self.finish()
        if self._tensor is None:
            self._map.close()


def arena_size(path: str | os.PathLike[str]) -> int:
    """The bytes the file's weights take interleaved on this machine: every 2-D block-type
    tensor of a type the CPU kernels interleave (`GGMLKernels.interleaves`), rows a multiple
    of 16, less an untied embedding (read for lookups, not interleaved). Reads the header
    only (the parsed file is cached for the loader)."""
    from agentrt.engine.loader.gguf_file import open_gguf
    from agentrt.kernels.ggml_library import default_kernels
    from agentrt.kernels.ggml_types import GGMLType

    kernels = default_kernels()
    tensors = open_gguf(path).tensors
    tied = "lm_head.weight" not in tensors
    size = 0
    for name, tensor in tensors.items():
        qtype = int(tensor.tensor_type)
        if len(tensor.shape) != 2 or int(tensor.shape[1]) % 16 or not kernels.interleaves(qtype):
            continue
        if name == "model.embed_tokens.weight" and not tied:
            continue
        stored = int(tensor.n_bytes)
        grown = int(stored * _Q4_K_GROWTH) if qtype == GGMLType.Q4_K else stored
        size += -(-grown // _ALIGN) * _ALIGN
    return size


@contextlib.contextmanager
def prefaulted(model: str | os.PathLike[str] | None, options: Mapping[str, Any]) -> Iterator[None]:
    """Around the build of an engine of `model` with `options` (EngineArgs' fields): an arena
    for its weights, populating while the body runs (module doc), closed after it unless
    the loader claimed it. Nothing when the load would not interleave a GGUF on the CPU."""
    key = _start(model, options)
    try:
        yield
    finally:
        if key is not None:
            with _lock:
                arena = _arenas.pop(key, None)
            if arena is not None:
                arena.close()


def claim(path: str | os.PathLike[str]) -> WeightArena | None:
    """The arena prepared for the file at `path`, once (the next claim gets None)."""
    with _lock:
        return _arenas.pop(str(Path(path).resolve()), None)


def _start(model: str | os.PathLike[str] | None, options: Mapping[str, Any]) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    if options.get("device", "cpu") != "cpu" or options.get("dtype", "auto") != "auto":
        return None
    if options.get("quantization", "auto") not in ("auto", "gguf"):
        return None
    if (options.get("tensor_parallel_size") or 1) != 1:
        return None
    try:
        if model is None:
            from agentrt.engine.loader.gguf_file import embedded_gguf_path

            model = embedded_gguf_path()
        path = Path(model).resolve()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            return None
        size = arena_size(path)
    except Exception:  # the engine's own load reports what is wrong with the file
        return None
    if not size or size > (available_memory() or 0) // 2:
        return None  # nothing to take; or a file the fit check (fit.py) may yet refuse
    key = str(path)
    with _lock:
        if key in _arenas:  # another engine of the file is being built: it takes that one
            return None
        _arenas[key] = WeightArena(size)
    return key


def available_memory() -> int | None:
    """The OS's MemAvailable in bytes (page cache it may reclaim included; None where it
    cannot be read). Torch-free: fit.py's CPU figure too."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
