"""Groups of actors that exchange tensors: gloo over ``torch.distributed`` (CPU) and NCCL through CuPy (GPU).

Both have the shape of :data:`kdray.model.parallel.SINGLE` (``rank``, ``size``, ``all_reduce``,
``all_gather``, ``all_reduce_rmsnorm``), so the model layers take them as their tensor-parallel group,
plus ``broadcast``, ``send`` and ``recv`` for the drafter <-> shard link. An NCCL group made with ``peer``
(backend ``nccl-peer``) sends small all-reduces through the one-shot peer kernel (``peer_memory.py``).
Ranks meet at a ``TCPStore`` that the engine hosts: each rank announces itself and waits (bounded) for
the others, so a timeout names the ranks that never came; then the group is built and warmed with one
all-reduce.
"""
from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kdray.model.parallel import Collectives

JOIN_POLL_S = 0.02


class CommunicatorTimeout(TimeoutError):
    """Some ranks did not join a group in time; the message names them."""


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the engine's rendezvous store."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise CommunicatorTimeout(f"cannot reach the engine's rendezvous store at {host}:{port} within "
                                  f"{timeout_s:.0f} s ({e}); check that this node can open TCP connections to it"
                                  ) from None


def missing_ranks(store: dist.Store, group: str, size: int) -> list[int]:
    """Ranks of ``group`` that have not announced themselves in ``store``."""
    return [r for r in range(size) if not store.check([f"{group}/joined/{r}"])]


def join(store: dist.Store, group: str, rank: int, size: int, timeout_s: float):
    """Announce ``rank`` and wait until all ``size`` ranks of ``group`` have; raise naming the absent ones."""
    store.set(f"{group}/joined/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    while missing := missing_ranks(store, group, size):
        if time.monotonic() > deadline:
            raise CommunicatorTimeout(f"group '{group}': rank(s) {missing} of {size} did not join within "
                                      f"{timeout_s:.0f} s (rank {rank} waited); those actors failed to start or "
                                      "cannot reach the engine's store")
        time.sleep(JOIN_POLL_S)


class GlooGroup(Collectives):
    """A gloo process group (``torch.distributed``) of its own, not the process-global default group.

    Tensors on a GPU are staged through host memory, which is how a drafter that shares its GPU with a
    shard talks to it (NCCL refuses two ranks on one GPU).
    """

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, timeout_s: float):
        join(store, name, rank, size, timeout_s)
        self.name, self.rank, self.size = name, rank, size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timedelta(seconds=timeout_s))
        self.all_reduce(torch.zeros(1))

    @staticmethod
    def _staged(t: torch.Tensor, op) -> torch.Tensor:
        """Run ``op`` on ``t`` in place, through a host copy when ``t`` is on a GPU."""
        if not t.is_cuda:
            op(t)
            return t
        host = t.cpu()
        op(host)
        return t.copy_(host)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group; returns the sum (in ``t`` itself only when ``t`` is contiguous)."""
        return self._staged(t.contiguous(), lambda x: self._pg.allreduce([x]).wait())

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order."""
        host = t.contiguous().cpu()
        parts = [torch.empty_like(host) for _ in range(self.size)]
        self._pg.allgather([parts], [host]).wait()
        return torch.cat(parts, dim=dim).to(t.device)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``t`` (contiguous) on every rank with rank ``src``'s."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._staged(_contiguous(t), lambda x: self._pg.broadcast([x], opts).wait())

    def send(self, t: torch.Tensor, dst: int):
        self._pg.send([t.contiguous().cpu()], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``t`` (contiguous) with what rank ``src`` sends."""
        return self._staged(_contiguous(t), lambda x: self._pg.recv([x], src, 0).wait())


class NcclGroup(Collectives):
    """An NCCL communicator through ``cupy.cuda.nccl``; every op is enqueued on torch's current stream.

    Rank 0 makes the unique id and publishes it through the engine's store; ``ncclCommInitRank``
    starts only once every rank has announced itself, so a missing rank is named instead of hanging.
    With ``peer``, all-reduces that fit the peer buffers (a few tokens' rows) run the one-shot peer kernel,
    the layers' fused with the RMSNorm after them; larger ones run NCCL.
    """

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, timeout_s: float, peer: bool = False):
        from cupy.cuda import nccl

        self._nccl, self.name, self.rank, self.size = nccl, name, rank, size
        self._dtypes = {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16,
                        torch.bfloat16: nccl.NCCL_BFLOAT16, torch.float64: nccl.NCCL_FLOAT64,
                        torch.int32: nccl.NCCL_INT32, torch.int64: nccl.NCCL_INT64, torch.uint8: nccl.NCCL_UINT8}
        join(store, name, rank, size, timeout_s)
        key = f"{name}/nccl_unique_id"
        if rank == 0:
            uid = nccl.get_unique_id()  # bytes from CuPy 14 on; a tuple of 128 signed chars before
            store.set(key, bytes(b & 0xFF for b in uid) if isinstance(uid, tuple) else uid)
        store.wait([key], timedelta(seconds=timeout_s))
        unique_id = store.get(key)
        try:
            self._comm = nccl.NcclCommunicator(size, unique_id, rank)
        except TypeError:  # older CuPy takes the id as a tuple of signed chars (rejected before any NCCL call)
            self._comm = nccl.NcclCommunicator(size, tuple(b - 256 if b > 127 else b for b in unique_id), rank)
        self.peer = None
        if peer and size > 1:
            from kdray.actors.peer_memory import PeerAllReduce

            self.peer = PeerAllReduce(store, name, rank, size, timeout_s)
        self.all_reduce(torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()

    def _args(self, t: torch.Tensor) -> tuple[int, int, int]:
        if not t.is_cuda:
            raise ValueError(f"NCCL group '{self.name}' got a {t.device} tensor; it moves CUDA tensors only")
        if t.dtype not in self._dtypes:
            raise ValueError(f"NCCL group '{self.name}' has no mapping for {t.dtype}")
        return t.data_ptr(), t.numel(), self._dtypes[t.dtype]

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group; returns the sum (in ``t`` itself only when ``t`` is contiguous and goes through
        NCCL)."""
        if self.peer is not None and self.peer.fits(t):
            return self.peer.all_reduce(t)
        t = t.contiguous()
        ptr, n, dt = self._args(t)
        self._comm.allReduce(ptr, ptr, n, dt, self._nccl.NCCL_SUM, self._stream())
        return t

    def all_reduce_rmsnorm(self, x, weight, eps, out_k=None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.peer is not None and self.peer.fits(x) and out_k is None:  # (the peer kernel's norm has no out_k)
            return self.peer.all_reduce_rmsnorm(x, weight, eps)
        return super().all_reduce_rmsnorm(x, weight, eps, out_k)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)  # [size, *t.shape]
        ptr, n, dt = self._args(t)
        self._comm.allGather(ptr, out.data_ptr(), n, dt, self._stream())
        return torch.cat(out.unbind(0), dim=dim)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``t`` (contiguous) on every rank with rank ``src``'s."""
        ptr, n, dt = self._args(_contiguous(t))
        self._comm.broadcast(ptr, ptr, n, dt, src, self._stream())
        return t

    def send(self, t: torch.Tensor, dst: int):
        ptr, n, dt = self._args(t.contiguous())
        self._comm.send(ptr, n, dt, dst, self._stream())

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``t`` (contiguous) with what rank ``src`` sends."""
        ptr, n, dt = self._args(_contiguous(t))
        self._comm.recv(ptr, n, dt, src, self._stream())
        return t


BACKENDS = {"gloo": GlooGroup, "nccl": NcclGroup, "nccl-peer": functools.partial(NcclGroup, peer=True)}


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a receive buffer must be contiguous")
    return t
