"""The buffers of the one-shot peer all-reduce (``kernels/peer_all_reduce.py``) for one group of ranks on one host.

Each rank allocates and zeroes one buffer of its own (``cudaMalloc``), publishes its CUDA IPC handle in the
engine's store and maps every other rank's buffer into its address space: plain peer loads and stores over NVLink
(never multicast). Every GPU of the group must be visible to every rank's process (with ``all_reduce='peer'`` the
Ray runner shows each shard all of the node's GPUs).
"""
from __future__ import annotations

from datetime import timedelta

import torch

from kdray.kernels.peer_all_reduce import MAX_WORLD, buffer_bytes, peer_all_reduce
from kdray.kernels.rmsnorm import DTYPES, MAX_VECS

# Bytes a rank reads from its peers in one call at most: a message of up to READ_BYTES / (ranks - 1) goes one-shot
# (at TP = 2, 73 of K2's token rows), a larger one through NCCL. Ours, fused with the residual add (since removed:
# rank 0's part carries the residual) and RMSNorm, two ranks sharing one H100 (benchmarks/all_reduce.py): 6.7 us at
# 1 token, 11.9 at 65, 62.3 at 257 (one block works through its rows in turn); NCCL alone on two H200s took 13.4 /
# 17.5 / 35.6 us (design.md section 8). To be re-measured on two GPUs.
READ_BYTES = 1 << 20


class PeerAllReduce:
    """This rank's side: its own buffer, every rank's mapped, and the kernel's calls."""

    def __init__(self, store, group: str, rank: int, size: int, timeout_s: float, read_bytes: int = READ_BYTES):
        from cupy.cuda import runtime

        if not 2 <= size <= MAX_WORLD:
            raise ValueError(f"the peer all-reduce takes 2 to {MAX_WORLD} ranks; group '{group}' has {size}")
        self._runtime, self.rank, self.size = runtime, rank, size
        self.max_bytes = read_bytes // (size - 1) // 16 * 16
        n = buffer_bytes(self.max_bytes)
        self._own = runtime.malloc(n)
        runtime.memset(self._own, 0, n)
        runtime.deviceSynchronize()  # zeroed before any peer can flag it
        store.set(f"{group}/peer_buffer/{rank}", bytes(runtime.ipcGetMemHandle(self._own)))
        keys = [f"{group}/peer_buffer/{r}" for r in range(size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        self._mapped, bases = [], []
        for r, key in enumerate(keys):
            if r == rank:
                bases.append(self._own)
                continue
            try:
                ptr = runtime.ipcOpenMemHandle(store.get(key))
            except runtime.CUDARuntimeError as e:
                self.close()
                raise RuntimeError(f"group '{group}': rank {rank} cannot map rank {r}'s buffer through CUDA IPC ({e});"
                                   " the peer all-reduce needs the group's GPUs on one host, each visible to every "
                                   "rank's process; use all_reduce='nccl'") from None
            self._mapped.append(ptr)
            bases.append(ptr)
        self.bases = torch.tensor(bases, dtype=torch.int64, device="cuda")  # [size] buffer addresses

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes one-shot: a CUDA tensor of a kernel dtype, rows of whole 16-byte vectors, at most
        ``max_bytes`` (the same answer on every rank: it reads the shape and dtype only)."""
        row = x.shape[-1] * x.element_size() if x.dim() else 0
        return (x.is_cuda and x.dtype in DTYPES and row % 16 == 0 and 0 < row <= MAX_VECS * 16
                and x.numel() * x.element_size() <= self.max_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, a new tensor (``fits(x)`` must hold)."""
        return peer_all_reduce(self.bases, self.rank, self.max_bytes, _aligned(x))

    def all_reduce_rmsnorm(self, x, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(``rmsnorm(s)``, ``s``), ``s = sum(x)``, in one launch (``fits(x)`` must hold)."""
        return peer_all_reduce(self.bases, self.rank, self.max_bytes, _aligned(x), weight, eps)

    def close(self):
        """Unmap the peers' buffers and free this rank's (after every rank's last call has finished)."""
        for ptr in self._mapped:
            self._runtime.ipcCloseMemHandle(ptr)
        self._mapped = []
        if self._own:
            self._runtime.free(self._own)
            self._own = 0


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with 16-byte aligned rows of unit stride (a copy when it has not)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.dim() > 1 and t.stride(-2) * t.element_size() % 16):
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t
