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
through the object store (rl/weight_sync/transport.py decides). Its first bytes hold the version written last, set to
-1 while a version is being written: a reader checks after its load that the version it read is
still there, so a slab rewritten under a reader fails that load instead of serving torn weights.
The learner reuses a slab only once the driver has released it (every load done); it keeps a few
(an asynchronous run has several versions in flight), each the size of the model in the engines'
dtype, for as long as it lives: memory the object store would have held for each sync anyway, kept.

A learner on a GPU whose engines run on that same GPU (configs/gpu/one_gpu.yaml: both halves of
one device) gets a slab in GPU memory instead, shared through CUDA IPC (`CudaIpc`): its cast into
the slab is a copy on the device, and the engine copies its parameters from the same device memory,
so nothing crosses PCIe. The learner waits for its writes before it hands a bucket out
(`Slab.flush`), and a reader for its copies before it checks the header. CUDA IPC handles name a
device by its index in the learner's process; a reader maps them to its own index for the same GPU
by its UUID (Ray gives each process its own CUDA_VISIBLE_DEVICES).

Not covered: processes on other nodes, or of another user; a memfd-less OS (Linux only); CUDA IPC
to an engine on another GPU of the node (those engines read a host slab).
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


@dataclass(frozen=True)
class CudaIpc:
    """Where a slab in GPU memory is (`Manifest.shared` for engines on the learner's GPU)."""

    gpu: str  # the device's UUID (`gpu_uuid`)
    rebuild: (
        tuple  # torch.multiprocessing.reductions.reduce_tensor's (function, args) for its bytes
    )


def gpu_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`: the same GPU has the same UUID in every process."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees, in its own device order (index i is `cuda:i`)."""
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Slab:
    """The learner's side: one shared-memory region of `nbytes` (plus the header), mapped writable; on
    a CUDA `device`, one allocation there shared through CUDA IPC. `address` is what readers open."""

    def __init__(self, nbytes: int, device: torch.device | None = None):
        self.nbytes = nbytes
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.bytes = torch.zeros(HEADER + nbytes, dtype=torch.uint8, device=self.device)
            self.address: str | CudaIpc = CudaIpc(
                gpu_uuid(self.bytes.device.index), reduce_tensor(self.bytes)
            )
        else:
            self.fd = os.memfd_create("longhorizon-weights", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, HEADER + nbytes)
            self._map = mmap.mmap(self.fd, HEADER + nbytes)
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
            self.address = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.version: int | None = None  # the version in flight in it (None: free for the next one)
        self.mark(-1)

    def mark(self, version: int) -> None:
        """Write the header's version (-1: being written)."""
        self.bytes[:8].view(torch.int64)[0] = version
        self.flush()

    def flush(self) -> None:
        """Wait for the writes queued on a GPU slab (a reader in another process must see them all)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def region(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The contiguous tensor of `shape` at byte `offset` (past the header), to write into."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self.bytes[HEADER + offset : HEADER + offset + nbytes].view(dtype).view(shape)


def view(slab_bytes: torch.Tensor, ref: SharedTensor) -> torch.Tensor:
    """The tensor `ref` describes, as a view of a slab's bytes (no copy)."""
    dtype = getattr(torch, ref.dtype)
    size = dtype.itemsize
    if ref.offset % size:
        raise ValueError(
            f"weight sync: a shared tensor at byte {ref.offset} is not aligned to its {ref.dtype} elements"
        )
    body = slab_bytes[HEADER:]
    typed = body[: len(body) // size * size].view(dtype)
    # offsets count from the storage's start
    return typed.as_strided(ref.shape, ref.stride, typed.storage_offset() + ref.offset // size)


class SlabReader:
    """A rollout worker's side: slabs mapped read-only, kept mapped from one sync to the next (the
    learner reuses its slabs, so later versions read pages already mapped here)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._maps: dict = {}  # (path, inode, size) -> (mmap, bytes)

    def open(self, address: str | CudaIpc) -> torch.Tensor:
        """The bytes of the slab at `address`: a memfd's path, or a GPU slab's `CudaIpc`."""
        if isinstance(address, CudaIpc):
            return self._open_cuda(address)
        path = address
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise RuntimeError(
                f"weight sync: cannot open the learner's shared-memory slab {path} ({exc.strerror}); "
                "shared-memory syncs serve only rollout workers on the learner's node "
                "(sync.shared_memory: false sends every version through Ray's object store)"
            ) from None
        try:
            st = os.fstat(fd)
            key = (path, st.st_ino, st.st_size)
            if key not in self._maps:
                m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
                import warnings

                # read-only on purpose: the engine copies what it keeps
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="The given buffer is not writable")
                    self._maps[key] = (m, torch.frombuffer(m, dtype=torch.uint8))
                # the oldest: a learner that restarted, or slabs gone
                while len(self._maps) > self.keep:
                    self._maps.pop(next(iter(self._maps)))
            return self._maps[key][1]
        finally:
            os.close(fd)

    def _open_cuda(self, address: CudaIpc) -> torch.Tensor:
        fn, args = address.rebuild
        key = (address.gpu, args[7], args[9])  # the GPU, the allocation's handle, the offset in it
        if key not in self._maps:
            seen = visible_gpus()
            if address.gpu not in seen:
                raise RuntimeError(
                    f"weight sync: the learner's slab lies on GPU {address.gpu}, which this rollout "
                    f"worker does not see (its GPUs: {', '.join(seen) or 'none'}); CUDA IPC serves "
                    "engines on the learner's own GPU"
                )
            args = list(args)
            args[6] = seen.index(address.gpu)  # the device index as this process numbers that GPU
            self._maps[key] = (None, fn(*args))
            while len(self._maps) > self.keep:
                self._maps.pop(next(iter(self._maps)))
        return self._maps[key][1]


def written_version(slab_bytes: torch.Tensor) -> int:
    """The version a slab's header names (-1 while one is being written)."""
    return int(slab_bytes[:8].view(torch.int64)[0])
