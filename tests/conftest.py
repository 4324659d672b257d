"""Shared fixtures: one SmolLM2 load and one Ray cluster with one Serve instance per test run.

GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA; ``pytest -m "not slow"`` is the fast lane.
"""
import os

import pytest
import torch

# On a small box (the CI's two cores), one torch thread in this (the driver's) process for the whole run: the
# suite shares those cores with the Ray cluster, the Serve replicas, their actors and other jobs, and with two
# threads each op's barrier waits for whichever core another process holds (the in-process tests took 2-3x as long
# whenever the box was busy). Ray's workers take their own thread count from Ray (one per CPU they hold).
SMALL_BOX = len(os.sched_getaffinity(0)) <= 4
if SMALL_BOX:
    torch.set_num_threads(1)

RAY_CPUS = 12  # logical CPUs of the shared cluster: the Serve apps' replicas and actors, and TP = 4 engines
METRICS_REPORT_MS = 500  # how often workers report metrics to the node's exporter (Ray's default: 10 s)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


CPU_KV_BUDGET = 128 << 20  # KV-cache bytes of an in-process CPU engine without num_pages (kdray's default: 512 MiB)


@pytest.fixture(scope="session", autouse=True)
def small_cpu_kv_budget():
    """A quarter of kdray's CPU KV-cache budget for the in-process engines of this run: every ``LLM`` built on the
    CPU without ``num_pages`` zero-fills its whole cache (0.25 s for 512 MiB on two cores, over a hundred times a run),
    while the tests hold a few short requests at a time (k2-tiny still gets ~17k pages, SmolLM2 ~180). The default
    sizing path (``kv_pages_that_fit``) still runs; only its CPU constant is smaller. Ray actors and Serve replicas
    (other processes) keep the default."""
    import kdray.engine.layout as layout

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "KV_BUDGET_BYTES_CPU", CPU_KV_BUDGET)
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a small CPU box shared with other
    jobs, two threads' barriers stall every op. (On a small box the whole run uses one, see above.)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def random_k2(tmp_path_factory) -> str:
    """k2-tiny's random weights behind the K2-layout tokenizer of tests/k2_chat.py (EOS <|im_end|>): a K2 with a
    tokenizer, as grammars need."""
    import shutil

    from k2_chat import make_k2_chat_checkpoint

    from kdray.model.presets import k2_tiny_path

    path = make_k2_chat_checkpoint(tmp_path_factory.mktemp("m") / "random-k2")
    shutil.copy(k2_tiny_path() / "model.safetensors", path / "model.safetensors")
    return str(path)


@pytest.fixture(scope="session")
def smollm2():
    """The real small model (SmolLM2-135M-Instruct from its GGUF), fp32 on the CPU, loaded once."""
    from kdray.model.loader import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by the Ray and Serve tests (started once, shut down at the end)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", _system_config={"metrics_report_interval_ms": METRICS_REPORT_MS})
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_cluster(ray_cluster):
    """One Serve instance on a free localhost port; ``deploy({prefix: builder args})`` adds apps to it."""
    from serve_server import ServeCluster

    cluster = ServeCluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def k2_chat(serve_cluster, tmp_path_factory):
    """The Kimi-K2-layout chat checkpoint of ``tests/k2_chat.py`` served as 'k2-chat' at /k2chat; its base URL."""
    from k2_chat import make_k2_chat_checkpoint

    path = make_k2_chat_checkpoint(tmp_path_factory.mktemp("models") / "k2-chat")
    base = serve_cluster.deploy({"/k2chat": {"model": str(path), "served_model_name": "k2-chat", "device": "cpu",
                                             "batch_dir": str(tmp_path_factory.mktemp("batches"))}})
    return f"{base}/k2chat"
