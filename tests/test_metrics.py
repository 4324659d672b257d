"""Metrics: the speculative-decoding counters as vLLM defines them, and two replicas whose totals, read from
Ray's metrics export (what Prometheus scrapes on every node), are complete and never go down."""
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kdray.serve.metrics import Metrics


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_spec_decode_counters_follow_vllm():
    m = Metrics()
    m.step(0.01, {"verify": 0.005}, drafts=[(8, 3), (8, 0), (8, 1)])  # three sequences verifying 8 nodes each
    m.step(0.01, {}, drafts=[(16, 2), (0, 0)])  # budget=auto: this step 16 nodes, and a plain step
    assert sample(m, "kdray_spec_decode_num_drafts_total") == 4
    assert sample(m, "kdray_spec_decode_num_draft_tokens_total") == 40
    assert sample(m, "kdray_spec_decode_num_accepted_tokens_total") == 6
    per_pos = [sample(m, "kdray_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(4)]
    assert per_pos == [3, 2, 1, 0]  # drafts whose accepted path reached depth 0, 1, 2, 3
    assert sample(m, "kdray_step_seconds_count", stage="total") == 2
    assert sample(m, "kdray_spec_decode_tree_size_count") == 5 and sample(m, "kdray_spec_decode_tree_size_sum") == 40
    plain = Metrics()  # plain decoding drafts nothing
    plain.step(0.01, {}, drafts=[(0, 0), (0, 0)])
    assert sample(plain, "kdray_spec_decode_num_drafts_total") == 0


def test_scheduler_counters_follow_the_engine_totals():
    m = Metrics()
    m.scheduler(lookups=10, hits=7, preemptions=1, calibration=[0.9, 0.5])
    m.scheduler(lookups=14, hits=9, preemptions=1, calibration=[0.8, 0.4])
    assert sample(m, "kdray_prefix_cache_queries_total") == 14 and sample(m, "kdray_prefix_cache_hits_total") == 9
    assert sample(m, "kdray_num_preemptions_total") == 1
    assert sample(m, "kdray_spec_decode_calibration", position="1") == 0.4


def test_time_to_first_token_splits_into_queue_and_prefill():
    m = Metrics()
    m.first_token(0.030, queued=0.004)
    m.first_token(0.010, queued=0.002)
    assert sample(m, "kdray_time_to_first_token_seconds_sum") == pytest.approx(0.040)
    assert sample(m, "kdray_request_queue_time_seconds_sum") == pytest.approx(0.006)
    assert sample(m, "kdray_request_prefill_time_seconds_sum") == pytest.approx(0.034)
    assert sample(m, "kdray_request_prefill_time_seconds_count") == 2


APP = "app-pair"
TOTALS = ("ray_kdray_http_requests_total", "ray_kdray_prompt_tokens_total", "ray_kdray_generation_tokens_total",
          "ray_kdray_request_success_total")


@pytest.fixture(scope="module")
def pair(serve_cluster, tmp_path_factory):
    base = serve_cluster.deploy({"/pair": {"model": "k2-tiny", "device": "cpu", "spec": "ar", "num_replicas": 2,
                                           "max_num_seqs": 4, "num_pages": 64,
                                           "batch_dir": str(tmp_path_factory.mktemp("pair"))}})
    return f"{base}/pair"


def ray_export() -> list:
    """The samples of this app in Ray's metrics export of this node."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("app") == APP]


def totals() -> dict[str, float]:
    """Each counter summed over the app's replicas (HTTP requests: those to /v1/completions)."""
    found = dict.fromkeys(TOTALS, 0.0)
    for s in ray_export():
        if s.name in found and s.labels.get("route", "/v1/completions") == "/v1/completions":
            found[s.name] += s.value
    return found


@pytest.mark.slow
def test_two_replicas_report_complete_totals_that_never_go_down(pair):
    start = totals()
    seen, done = [start], threading.Event()

    def scrape():
        while not done.is_set():
            seen.append(totals())
            time.sleep(0.2)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    body = {"model": "k2-tiny", "prompt": [1, 2], "max_tokens": 3, "ignore_eos": True}
    try:
        threads = [threading.Thread(target=lambda: requests.post(f"{pair}/v1/completions", json=body, timeout=60))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 30  # every worker reports within METRICS_REPORT_MS
        while totals()["ray_kdray_http_requests_total"] < start["ray_kdray_http_requests_total"] + 8:
            assert time.monotonic() < deadline, f"the totals stayed incomplete: {totals()}"
            time.sleep(0.2)
    finally:
        done.set()
        scraper.join()
    end = totals()
    assert {k: end[k] - start[k] for k in TOTALS} == {"ray_kdray_http_requests_total": 8,
                                                      "ray_kdray_prompt_tokens_total": 16,
                                                      "ray_kdray_generation_tokens_total": 24,
                                                      "ray_kdray_request_success_total": 8}
    for name in TOTALS:
        series = [s[name] for s in [*seen, end]]
        assert series == sorted(series), f"{name} went down between scrapes: {series}"
    replicas = {s.labels["replica"] for s in ray_export() if s.name == "ray_kdray_num_requests_running"}
    assert len(replicas) == 2
