"""Compile-once loader for the CUDA sources in ``kernels/cuda`` and launches on torch's current stream.

Kernels are compiled by CuPy (NVRTC) the first time an op needs them and cached per (file, arch). CuPy's disk cache
keys a module on its source text and options, not on the headers it includes, so the options carry a digest of the
``cuda/*.cuh`` headers the file includes: a changed header compiles anew instead of loading a stale cached kernel.
Launches go to ``torch.cuda.current_stream()``, so they order with torch work and can be captured
in a CUDA graph; nothing here synchronises the host or allocates device memory.

Inside a graph capture each kernel is launched as a programmatic dependent launch (``cuLaunchKernelEx``, sm_90+):
the GPU may start it while the kernel ahead of it on the stream still runs, and the kernel waits for that one in
``griddep_wait()`` (``cuda/griddep.cuh``) before it touches memory. In a replayed pass of a few tokens this hides
the gap between one kernel's end and the next one's start. Eager launches stay plain CuPy launches: there the host,
not the gap, sets the pace, so they go to CuPy's compiled function with the stream given outright rather than through
its device and stream context managers (H100: 26.9 instead of 46.8 us of host time a launch; an eager 4k-token K2
shard pass 69-73 instead of 131 ms of host time, and GPU-bound).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import re
from pathlib import Path

import numpy as np
import torch

CUDA_DIR = Path(__file__).parent / "cuda"


@functools.cache
def _arch(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    # sm_90a unlocks Hopper-only instructions (wgmma, TMA); everything else builds for its own arch.
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


@functools.cache
def load_module(name: str, device_index: int = 0, defines: tuple[tuple[str, int], ...] = ()):
    """Compile ``kernels/cuda/<name>.cu`` for the device's architecture and return the ``cupy.RawModule``."""
    import cupy

    src_path = CUDA_DIR / f"{name}.cu"
    if not src_path.is_file():
        raise FileNotFoundError(f"CUDA source {src_path} is missing from the kdray package")
    src = src_path.read_text()
    header_digest = hashlib.sha256(b"".join(h.read_bytes() for h in _included_headers(src))).hexdigest()[:16]
    options = ("-std=c++17", f"-arch={_arch(device_index)}", "--use_fast_math", f"-I{CUDA_DIR}",
               f"-DKDRAY_HEADERS_DIGEST=0x{header_digest}") + tuple(f"-D{k}={v}" for k, v in defines)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=src, options=options)
        module.compile()
    return module


def _included_headers(src: str) -> list[Path]:
    """The ``cuda/`` headers that ``src`` includes (``#include "name"``), directly or through one another, each once,
    in a fixed order."""
    found: list[Path] = []
    todo = [src]
    while todo:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', todo.pop(), re.M):
            path = CUDA_DIR / name
            if path not in found:
                found.append(path)
                todo.append(path.read_text())
    return found


@functools.cache
def _kernel(name: str, kernel: str, device_index: int, defines: tuple[tuple[str, int], ...]):
    """The compiled kernel, with the dynamic shared memory it was last allowed (set on the function at its first launch
    that asks for any: a kernel's static shared memory counts against the 48 KiB a launch gets without it)."""
    return [load_module(name, device_index, defines).get_function(kernel), 0]


@functools.cache
def sm_count(device_index: int) -> int:
    """The device's streaming multiprocessors (what kernels size their grids by)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` as ``[rows, n]`` with unit stride along n: a view when the layout allows one, else a copy."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def vector_elems(n: int, tensors: list[torch.Tensor]) -> int:
    """Widest access (16, 8, 4 or 2 bytes, else one element) for rows of ``n`` elements of ``tensors``' dtype:
    it must divide the row and every tensor's address and row stride (dim 0 of a 2-D tensor)."""
    elem = tensors[0].element_size()
    for nbytes in (16, 8, 4, 2):
        v = nbytes // elem
        if v and n % v == 0 and all(t.data_ptr() % nbytes == 0 and (t.dim() != 2 or t.stride(0) * elem % nbytes == 0)
                                    for t in tensors):
            return v
    return 1


@functools.cache
def _cupy_stream(handle: int, device_index: int):
    """CuPy's view of a torch stream (one object per stream, reused by every launch on it)."""
    import cupy

    return cupy.cuda.ExternalStream(handle, device_index)


def launch(name: str, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           shared_mem: int = 0, device: torch.device | None = None, defines: tuple[tuple[str, int], ...] = ()):
    """Launch ``kernel`` from ``kernels/cuda/<name>.cu`` on torch's current stream.

    ``args`` may hold torch tensors (passed as device pointers) and Python / NumPy scalars typed by
    the caller (``numpy.int32(...)`` etc.).
    """
    import cupy

    device = device or torch.device("cuda", torch.cuda.current_device())
    index = device.index if device.index is not None else torch.cuda.current_device()
    entry = _kernel(name, kernel, index, defines)
    fn = entry[0]
    if shared_mem > entry[1]:
        fn.max_dynamic_shared_size_bytes = entry[1] = shared_mem
    stream = torch.cuda.current_stream(index)
    if torch.cuda.is_current_stream_capturing() and sm90_or_later(index):
        with cupy.cuda.Device(index):
            _launch_dependent(fn.kernel.ptr, grid, block, args, shared_mem, stream.cuda_stream)
        return
    ptr_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    if index == torch.cuda.current_device():  # the stream given outright: no device or stream context to enter
        fn.kernel(grid, block, ptr_args, shared_mem, _cupy_stream(stream.cuda_stream, index))
        return
    with cupy.cuda.Device(index), _cupy_stream(stream.cuda_stream, index):
        fn(grid, block, ptr_args, shared_mem=shared_mem)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def sm90a(device_index: int) -> bool:
    """Whether kernels build for sm_90a on the device (Hopper's wgmma and TMA)."""
    return _arch(device_index) == "sm_90a"


@functools.cache
def sm90_or_later(device_index: int) -> bool:
    """Whether the device has Hopper's launch features: programmatic dependent launch, thread-block clusters."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _dim3(d: tuple[int, ...]):
    return (ctypes.c_uint * 3)(*(tuple(d) + (1, 1, 1))[:3])


def _kernel_param(a):
    """One kernel argument as the C value CuPy would pass: a tensor's device pointer, a NumPy scalar as its own
    type, a Python int as 64 bits (a null pointer is 0), a float as a double."""
    if isinstance(a, torch.Tensor):
        return ctypes.c_void_p(a.data_ptr())
    if isinstance(a, np.generic):
        return np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    raise TypeError(f"kernel argument of type {type(a).__name__}: pass a tensor or a NumPy scalar")


@functools.cache
def max_active_clusters(name: str, kernel: str, device_index: int, defines: tuple[tuple[str, int], ...],
                        cluster: tuple[int, int, int], threads: int, shared_mem: int) -> int:
    """How many thread-block clusters of ``kernel`` (compiled with ``defines`` and the cluster dims ``cluster``) the
    device holds at once with blocks of ``threads`` threads and ``shared_mem`` bytes of dynamic shared memory
    (``cuOccupancyMaxActiveClusters``): a grid of more runs them in waves."""
    import cupy

    entry = _kernel(name, kernel, device_index, defines)
    fn = entry[0]
    if shared_mem > entry[1]:
        fn.max_dynamic_shared_size_bytes = entry[1] = shared_mem
    config = _LaunchConfig(grid=_dim3(cluster), block=_dim3((threads,)), shared_mem=shared_mem, num_attrs=0)
    count = ctypes.c_int()
    with cupy.cuda.Device(device_index):
        err = _driver().cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(fn.kernel.ptr),
                                                     ctypes.byref(config))
    if err:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed for {kernel}: CUDA driver error {err}")
    return count.value


def _launch_dependent(function: int, grid, block, args, shared_mem: int, stream: int):
    """``cuLaunchKernelEx`` with programmatic stream serialization allowed."""
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1
    config = _LaunchConfig(grid=_dim3(grid), block=_dim3(block), shared_mem=shared_mem, stream=stream,
                           attrs=ctypes.pointer(attr), num_attrs=1)
    values = [_kernel_param(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    err = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function), params, None)
    if err:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(err, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {name.value.decode() if name.value else err}")
