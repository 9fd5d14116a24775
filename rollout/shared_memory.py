"""A weight sync on one node without Ray's object store: the learner writes a version straight into
a shared-memory slab, and the rollout workers of its node read their tensors from it in place.

Why: `ray.put` of a bucket cost about 3× a memcpy of its bytes here (64 MiB: 31 ms against 11),
so a sync through the object store could never come near a copy. Here the learner casts its
weights into the slab in one pass (the cast is the copy), and a worker's engine reads them from
the same pages (`SharedTensor` views, no fetch), so the only copies left are that one and the
engine's own load.

A slab is a memfd (anonymous shared memory, freed when the last process holding it closes it or
dies: a crashed learner leaks nothing). Workers open it through the learner's `/proc/<pid>/fd/<n>`,
so it serves only processes of the learner's node and user; a version for workers elsewhere goes
through the object store (rl/sync.py decides). Its first bytes hold the version written last, set to
-1 while a version is being written: a reader checks after its load that the version it read is
still there, so a slab rewritten under a reader fails that load instead of serving torn weights.
The learner reuses a slab only once the driver has released it (every load done); it keeps a few
(an asynchronous run has several versions in flight), each the size of the model in the engines'
dtype, for as long as it lives: memory the object store would have held for each sync anyway, kept.

Not covered: processes on other nodes, or of another user; a memfd-less OS (Linux only).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

HEADER = 64  # bytes before the tensors: the version (int64), and alignment
ALIGN = 64  # every tensor starts at a multiple of this many bytes


@dataclass(frozen=True)
class SharedTensor:
    """Where a tensor of a version lies in its slab (`Manifest.shared`): what a bucket carries instead
    of the array itself."""

    offset: int  # bytes from the end of the slab's header to the tensor's storage (its element 0)
    shape: tuple
    stride: tuple  # in elements
    dtype: str  # torch dtype name ("bfloat16")


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Slab:
    """The learner's side: one shared-memory region of `nbytes` (plus the header), mapped writable."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.fd = os.memfd_create("longhorizon-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER + nbytes)
        self._map = mmap.mmap(self.fd, HEADER + nbytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.version: int | None = None  # the version in flight in it (None: free for the next one)
        self.mark(-1)

    def mark(self, version: int) -> None:
        """Write the header's version (-1: being written)."""
        self.bytes[:8].view(torch.int64)[0] = version

    def region(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The contiguous tensor of `shape` at byte `offset` (past the header), to write into."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self.bytes[HEADER + offset:HEADER + offset + nbytes].view(dtype).view(shape)


def view(slab_bytes: torch.Tensor, ref: SharedTensor) -> torch.Tensor:
    """The tensor `ref` describes, as a view of a slab's bytes (no copy)."""
    dtype = getattr(torch, ref.dtype)
    size = dtype.itemsize
    if ref.offset % size:
        raise ValueError(f"weight sync: a shared tensor at byte {ref.offset} is not aligned to its {ref.dtype} elements")
    body = slab_bytes[HEADER:]
    typed = body[:len(body) // size * size].view(dtype)
    return typed.as_strided(ref.shape, ref.stride, typed.storage_offset() + ref.offset // size)  # offsets count from the storage's start


class SlabReader:
    """A rollout worker's side: slabs mapped read-only, kept mapped from one sync to the next (the
    learner reuses its slabs, so later versions read pages already mapped here)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._maps: dict = {}  # (path, inode, size) -> (mmap, bytes)

    def open(self, path: str) -> torch.Tensor:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise RuntimeError(f"weight sync: cannot open the learner's shared-memory slab {path} ({exc.strerror}); "
                               "shared-memory syncs serve only rollout workers on the learner's node "
                               "(sync.shared_memory: false sends every version through Ray's object store)") from None
        try:
            st = os.fstat(fd)
            key = (path, st.st_ino, st.st_size)
            if key not in self._maps:
                m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
                import warnings

                with warnings.catch_warnings():  # read-only on purpose: the engine copies what it keeps
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    self._maps[key] = (m, torch.frombuffer(m, dtype=torch.uint8))
                while len(self._maps) > self.keep:  # the oldest: a learner that restarted, or slabs gone
                    self._maps.pop(next(iter(self._maps)))
            return self._maps[key][1]
        finally:
            os.close(fd)


def written_version(slab_bytes: torch.Tensor) -> int:
    """The version a slab's header names (-1 while one is being written)."""
    return int(slab_bytes[:8].view(torch.int64)[0])
