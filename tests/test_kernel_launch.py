"""Kernel launches: every CUDA kernel waits for the kernels ahead before touching memory (a static check of the
sources, CPU), the driver-call arguments of a programmatic dependent launch (CPU), a graph of dependent launches
equal to the same kernels run eagerly (GPU), and dynamic shared memory beside a kernel's static shared memory (GPU)."""
import ctypes
import re

import numpy as np
import pytest
import torch

from kdray.kernels import cuda_module
from kdray.kernels.cuda_module import CUDA_DIR
from kdray.kernels.skinny_linear import ROWS_PER_BLOCK, THREADS


def _functions(src: str, marker: str):
    """(name, body) of every function in ``src`` declared with ``marker`` (``__global__``, ``__device__``)."""
    for m in re.finditer(marker, src):
        i, depth = m.end(), 0
        while True:  # past the parameter list (and __launch_bounds__'s parentheses) to the body's brace
            c = src[i]
            if c == ";" and depth == 0:  # a declaration or a variable, not a definition
                break
            depth += c == "("
            depth -= c == ")"
            if c == "{" and depth == 0:
                break
            i += 1
        if src[i] == ";":
            continue
        names = [n for n in re.findall(r"(\w+(?:##\w+)*)\s*\(", src[m.end():i]) if n != "__launch_bounds__"]
        if not names:
            continue
        start, depth = i, 0
        while True:
            depth += src[i] == "{"
            depth -= src[i] == "}"
            i += 1
            if depth == 0:
                break
        yield names[0], src[start:i]


def _kernel_bodies():
    """(file, kernel, body) of every ``__global__`` function in ``kernels/cuda`` (macro-made ones included), with the
    bodies of the file's device functions it calls appended (a kernel may wait inside its body function)."""
    for path in sorted(CUDA_DIR.glob("*.cu")):
        src = path.read_text()
        device = dict(_functions(src, r"__device__ __forceinline__"))
        for name, body in _functions(src, r"__global__"):
            called = [device[f] for f in re.findall(r"(\w+)\s*(?:<[^;(]*>)?\s*\(", body) if f in device]
            yield path.name, name, "\n".join([body] + called)


def test_every_kernel_waits_for_the_kernels_ahead():
    kernels = list(_kernel_bodies())
    assert len(kernels) >= 25  # the parser found the kernels (a macro-made family counts once)
    missing = [f"{f}: {k}" for f, k, body in kernels if not re.search(r"\bgriddep_(wait|begin)\(\)", body)]
    assert not missing, f"kernels launched dependently in graphs but never calling griddep_wait(): {missing}"


def test_a_changed_header_changes_the_options_of_the_files_including_it(tmp_path, monkeypatch):
    """CuPy's kernel cache keys a module on its source text and options: an edited header must change the options of
    every file that includes it (else the stale cached kernel loads), and only theirs."""
    import shutil
    import sys
    import types

    for path in CUDA_DIR.iterdir():
        shutil.copy(path, tmp_path / path.name)

    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...]):
            self.options = options

        def compile(self):
            pass

    class Device:
        def __init__(self, index: int):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule,
                                                                   cuda=types.SimpleNamespace(Device=Device)))
    monkeypatch.setattr(cuda_module, "CUDA_DIR", tmp_path)
    monkeypatch.setattr(cuda_module, "_arch", lambda index: "sm_90a")
    load = cuda_module.load_module.__wrapped__  # not the cached one
    names = ("w4a16_moe", "tree_verify_attention", "moe_route", "rmsnorm")
    before = {n: load(n, 0).options for n in names}
    assert {n: load(n, 0).options for n in names} == before  # the same files, the same options
    (tmp_path / "wgmma.cuh").write_text((tmp_path / "wgmma.cuh").read_text() + "\n// edited\n")
    after = {n: load(n, 0).options for n in names}
    assert after["w4a16_moe"] != before["w4a16_moe"]
    assert after["tree_verify_attention"] != before["tree_verify_attention"]
    assert after["moe_route"] == before["moe_route"] and after["rmsnorm"] == before["rmsnorm"]  # neither includes it


def test_launch_structs_have_the_driver_layout():
    assert ctypes.sizeof(cuda_module._LaunchAttribute) == 72  # id, pad to 8, a 64-byte union
    assert ctypes.sizeof(cuda_module._LaunchConfig) == 56
    assert cuda_module._LaunchConfig.stream.offset == 32  # after 7 unsigned ints, aligned to 8
    assert cuda_module._LaunchConfig.num_attrs.offset == 48


def test_kernel_params_are_the_values_cupy_passes():
    t = torch.zeros(4)
    assert cuda_module._kernel_param(t).value == t.data_ptr()
    p = cuda_module._kernel_param(np.int32(-7))
    assert isinstance(p, ctypes.c_int32) and p.value == -7
    p = cuda_module._kernel_param(np.float32(0.5))
    assert isinstance(p, ctypes.c_float) and p.value == 0.5
    p = cuda_module._kernel_param(np.int64(1 << 40))
    assert ctypes.sizeof(p) == 8 and p.value == 1 << 40
    p = cuda_module._kernel_param(0)  # a null pointer
    assert isinstance(p, ctypes.c_int64) and p.value == 0
    with pytest.raises(TypeError, match="NumPy scalar"):
        cuda_module._kernel_param("3")
    assert list(cuda_module._dim3((5,))) == [5, 1, 1] and list(cuda_module._dim3((2, 3))) == [2, 3, 1]


@pytest.mark.gpu
def test_a_graph_of_dependent_launches_equals_eager(monkeypatch):
    """A chain in which each kernel reads what the one before wrote (norm -> projection -> SiLU x up -> projection,
    ten layers); captured, its kernels launch dependently and start before the ones ahead end."""
    from kdray.kernels.rmsnorm import rmsnorm
    from kdray.kernels.silu_mul import silu_mul
    from kdray.kernels.skinny_linear import skinny_linear

    g = torch.Generator("cuda").manual_seed(0)
    H, I = 7168, 256
    layers = [((torch.randn(2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16(),
               (torch.randn(H, I, device="cuda", generator=g) / I ** 0.5).bfloat16(),
               (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()) for _ in range(10)]
    x = torch.randn(1, H, device="cuda", generator=g).bfloat16()

    def forward():
        h = x.clone()  # the stream, which each layer's second projection adds into
        for w13, w2, norm in layers:
            skinny_linear(silu_mul(skinny_linear(rmsnorm(h, norm, 1e-6), w13)), w2, out=h, accumulate=True)
        return h

    eager = forward()
    dependent = []
    launch = cuda_module._launch_dependent
    monkeypatch.setattr(cuda_module, "_launch_dependent", lambda *a: dependent.append(a) or launch(*a))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = forward()
    torch.cuda.current_stream().wait_stream(stream)
    assert len(dependent) == 40  # every kernel of the capture: 4 per layer
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
def test_48_kib_of_dynamic_shared_memory_beside_static_shared_memory():
    """A kernel with static shared memory (skinny_linear split over a cluster of 2 keeps its partial sums there)
    launched with 48 KiB of dynamic shared memory is past the default limit, though the dynamic part alone is not:
    the launch raises the function's limit (before, it failed with an invalid argument). The kernel leaves dynamic
    memory unused."""
    N, K = 100, 512
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    y = torch.full((1, N), float("nan"), device="cuda").bfloat16()
    cuda_module.launch("skinny_linear", "skinny_linear", (-(-N // ROWS_PER_BLOCK), 2), (THREADS,),
                       (x, w, y, np.int32(N), np.int32(K), np.int32(N), np.int32(N), 0), shared_mem=48 * 1024,
                       defines=(("DTYPE", 1), ("M_ROWS", 1), ("CLUSTER", 2)))
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2 ** -7, atol=2e-3)
