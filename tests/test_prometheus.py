"""Prometheus /metrics of both services (--metrics-port): real processes, scraped over HTTP."""

import re
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.errors import AddressInUseError
from common.metrics_http import metrics_host
from draft_service.metrics import DraftMetrics
from services import ROOT, ServiceProcess, Stack
from tiny_eagle import make_eagle_dir
from tiny_models import TEST_DEVICE, TEST_DTYPE, make_model_dir, tiny_config
from verify_service.config import EngineConfig
from verify_service.server import create_server
from verify_service.server_config import VerifyServerConfig

METRICS_LINE = re.compile(r"service metrics on (http://\S+/metrics)")
TREE = ["--tree-nodes", "12", "--tree-depth", "4", "--tree-top-k", "3"]
VERIFY_NAMES = {
    "eagle3_verify_requests_completed_total", "eagle3_verify_requests_cancelled_total",
    "eagle3_verify_requests_running", "eagle3_verify_requests_waiting", "eagle3_verify_generated_tokens_total",
    "eagle3_verify_engine_steps_total", "eagle3_verify_trees_verified_total", "eagle3_verify_draft_tokens_total",
    "eagle3_verify_accepted_tokens_total", "eagle3_verify_speculation_tau",
    "eagle3_verify_speculation_acceptance_rate", "eagle3_verify_kv_blocks_used", "eagle3_verify_kv_blocks_capacity",
    "eagle3_verify_draft_connected", "eagle3_verify_draft_sessions_total", "eagle3_verify_draft_errors_total",
    "eagle3_verify_step_seconds_count", "eagle3_verify_step_seconds_bucket",
    "eagle3_verify_draft_link_overhead_seconds_count", "python_gc_collections_total",
}
DRAFT_NAMES = {"eagle3_draft_connected", "eagle3_draft_steps_total", "eagle3_draft_trees_total",
               "eagle3_draft_reconnects_total", "eagle3_draft_compute_seconds_count", "python_gc_collections_total"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prom")
    target = make_model_dir(root / "target", "llama3", seed=5, std=0.3)
    draft = make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1)
    return target, draft


@pytest.fixture(scope="module")
def stack(dirs, tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"), *dirs, verify_args=[*TREE, "--metrics-port", "0"],
              draft_args=["--metrics-port", "0"])
    yield s
    s.close()


def metrics_url(proc: ServiceProcess, timeout_s: float = 30) -> str:
    """The /metrics URL the service printed (it bound port 0: any free port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = METRICS_LINE.search(proc.log())
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise TimeoutError(f"no metrics line in the log:\n{proc.log()}")


def scrape(url: str) -> dict[str, float]:
    """Every sample of a scrape, keyed by name plus labels: 'name' or 'name{label="value"}'."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def names(samples: dict[str, float]) -> set[str]:
    return {key.partition("{")[0] for key in samples}


def test_verify_metrics_count_requests_tokens_steps_and_speculation(stack):
    for prompt in ([5, 6, 7], list(range(10, 30))):
        stack.client.complete(prompt, max_tokens=12, ignore_eos=True)
    m = scrape(metrics_url(stack.verify))
    assert VERIFY_NAMES <= names(m)
    assert m["eagle3_verify_requests_completed_total"] >= 2
    assert m["eagle3_verify_generated_tokens_total"] >= 24
    speculative, plain = (m[f'eagle3_verify_engine_steps_total{{kind="{k}"}}'] for k in ("speculative", "plain"))
    steps = speculative + plain
    assert speculative > 0
    assert m["eagle3_verify_step_seconds_count"] == steps > 0  # one observation per engine step
    assert m["eagle3_verify_draft_connected"] == 1 and m["eagle3_verify_draft_errors_total"] == 0
    assert m["eagle3_verify_draft_tokens_total"] > 0 and m["eagle3_verify_draft_link_overhead_seconds_count"] > 0
    accepted, trees = m["eagle3_verify_accepted_tokens_total"], m["eagle3_verify_trees_verified_total"]
    assert trees > 0
    by_depth = [v for k, v in m.items() if k.startswith("eagle3_verify_accepted_tokens_by_depth_total")]
    assert sum(by_depth) == accepted  # one accepted node per depth per tree
    assert m["eagle3_verify_speculation_tau"] == pytest.approx((accepted + trees) / trees)
    assert m["eagle3_verify_requests_running"] == 0 and m["eagle3_verify_kv_blocks_used"] == 0
    assert m["eagle3_verify_kv_blocks_capacity"] > 0


def test_verify_metrics_and_get_metrics_read_the_same_snapshot(stack):
    stack.client.complete([9, 8, 7], max_tokens=5, ignore_eos=True)
    g, m = stack.client.metrics(), scrape(metrics_url(stack.verify))
    assert m["eagle3_verify_requests_completed_total"] == g["completed_requests"]
    assert m["eagle3_verify_draft_tokens_total"] == g["draft_tokens"]
    assert m["eagle3_verify_accepted_tokens_total"] == g["accepted_tokens"]
    assert m["eagle3_verify_kv_blocks_capacity"] == g["kv_blocks_total"]


def test_draft_metrics_count_steps_trees_and_compute(stack):
    stack.client.complete([40, 41], max_tokens=8, ignore_eos=True)
    d = scrape(metrics_url(stack.draft))
    v = scrape(metrics_url(stack.verify))
    assert DRAFT_NAMES <= names(d)
    assert d["eagle3_draft_connected"] == 1 and d["eagle3_draft_reconnects_total"] == 0
    assert d["eagle3_draft_trees_total"] > 0
    assert d["eagle3_draft_compute_seconds_count"] == d["eagle3_draft_steps_total"] > 0
    assert d["eagle3_draft_steps_total"] == v["eagle3_verify_draft_link_overhead_seconds_count"]  # every round trip


@pytest.mark.parametrize("verb", ["serve-verify", "serve-draft"])
def test_without_prometheus_client_the_flag_is_one_line_and_status_2(dirs, tmp_path, verb):
    target, draft = dirs
    args = {"serve-verify": ["--model", str(target), "--listen", f"unix:{tmp_path}/public.sock",
                             "--internal", f"unix:{tmp_path}/draft.sock", "--device", "cpu"],
            "serve-draft": ["--draft", str(draft), "--verify", f"unix:{tmp_path}/draft.sock",
                            "--listen", f"unix:{tmp_path}/health.sock", "--device", "cpu"]}[verb]
    hide = "import sys; sys.modules['prometheus_client'] = None; from cli.main import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", hide, verb, *args, "--metrics-port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, "error: --metrics-port needs prometheus-client, which is not "
                                                 "installed: pip install 'eagle3-serve[metrics]'\n")


def test_in_process_server_returns_the_bound_port_and_stops_serving(dirs, tmp_path):
    engine = EngineConfig(str(dirs[0]), device=TEST_DEVICE, dtype=TEST_DTYPE, num_kv_blocks=64)
    server = create_server(VerifyServerConfig(engine, None, listen=f"unix:{tmp_path}/public.sock", metrics_port=0))
    url = server.metrics.endpoint.url
    try:
        assert server.metrics.endpoint.port > 0 and url.startswith("http://127.0.0.1:")
        m = scrape(url)  # no speculation configured: no draft, no steps yet
        assert m["eagle3_verify_draft_connected"] == 0 and m["eagle3_verify_step_seconds_count"] == 0
        assert m["eagle3_verify_kv_blocks_capacity"] == 64
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_own_registry_and_a_taken_port_is_refused():
    worker = SimpleNamespace(connected=False, steps=3, trees_proposed=5, sessions_opened=2)
    metrics = DraftMetrics("127.0.0.1", 0)
    try:
        metrics.attach(worker)
        metrics.compute_seconds.observe(0.002)
        m = scrape(metrics.endpoint.url)
        assert (m["eagle3_draft_connected"], m["eagle3_draft_steps_total"], m["eagle3_draft_trees_total"]) == (0, 3, 5)
        assert m["eagle3_draft_reconnects_total"] == 1 and m["eagle3_draft_compute_seconds_count"] == 1
        assert prometheus_client.REGISTRY.get_sample_value("eagle3_draft_steps_total") is None  # not the global one
        with pytest.raises(AddressInUseError):
            DraftMetrics("127.0.0.1", metrics.endpoint.port)
    finally:
        metrics.stop()


@pytest.mark.parametrize("listen, host", [
    ("127.0.0.1:50051", "127.0.0.1"), ("0.0.0.0:50051", "0.0.0.0"), ("[::]:50051", "::"),
    ("localhost:7", "localhost"), ("unix:/tmp/eagle3/public.sock", "127.0.0.1"), (":50051", "127.0.0.1"),
])
def test_metrics_bind_the_listen_host(listen, host):
    assert metrics_host(listen) == host
