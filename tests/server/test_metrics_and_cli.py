"""``/metrics`` in Prometheus format, ``/health``, and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine, EngineConfig
from mlx_providers.server.cli import engine_config, parser
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]
ROOT = Path(__file__).resolve().parents[2]


def scrape(server: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def test_metrics_count_requests_tokens_and_latencies(serve: Serve) -> None:
    server, eng = serve()
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for _ in range(2):
        client.chat.completions.create(model="tiny", max_tokens=5, messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "A long enough question to be worth caching."}])
    list(client.chat.completions.create(model="tiny", max_tokens=5, stream=True, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "hi"}]))
    client.responses.create(model="tiny", input="hi", max_output_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=5)
    metrics = scrape(server)
    stats = eng.stats()
    model = (("model", "tiny"),)

    def requests(endpoint: str, outcome: str) -> float:
        return metrics.get(("mlx_server_requests_total",
                            (("endpoint", endpoint), ("outcome", outcome))), 0.0)

    assert requests("chat_completions", "ok") == 3
    assert requests("chat_completions", "client_error") == 1
    assert requests("responses", "ok") == 1
    assert metrics[("mlx_engine_generated_tokens_total", model)] == stats.generated_tokens == 20
    assert metrics[("mlx_engine_prompt_tokens_total", model)] == stats.prompt_tokens > 0
    assert metrics[("mlx_engine_prefix_cache_hit_tokens_total", model)] == (
        stats.prefix_hit_tokens) > 0
    assert metrics[("mlx_engine_running_rows", model)] == 0
    assert metrics[("mlx_engine_pending_rows", model)] == 0
    assert metrics[("mlx_engine_peak_batch_width", model)] >= 1
    assert ("mlx_engine_kv_bytes", model) in metrics
    assert metrics[("mlx_server_time_to_first_token_seconds_count", model)] == 4
    assert metrics[("mlx_server_time_per_output_token_seconds_count", model)] == 4
    assert metrics[("mlx_server_time_to_first_token_seconds_sum", model)] > 0
    # The engine's own request outcomes, as stats() counts them.
    assert metrics[("mlx_engine_completed_requests_total", model)] == stats.completed == 4
    assert metrics[("mlx_engine_cancelled_requests_total", model)] == stats.cancelled == 0
    assert metrics[("mlx_engine_failed_requests_total", model)] == stats.failed == 0
    assert metrics[("mlx_engine_embed_requests_total", model)] == stats.embed_requests == 0
    assert metrics[("mlx_engine_embed_pending_requests", model)] == 0


def test_health_and_models(live_server: LiveServer) -> None:
    health = httpx.get(live_server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok",
                                                          "models": {"tiny": "ok"}}


def test_the_command_line_defaults_to_loopback() -> None:
    args = parser().parse_args(["serve", "--model", "m", "--max-batch", "4"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_batch == 4
    assert args.api_key is None
    # An idle server waits briefly for a burst (the engine's own default is 0).
    assert args.admission_window == 0.025
    assert parser().parse_args(["serve", "--admission-window", "0"]).admission_window == 0


def test_the_memory_bounds_take_bytes_auto_or_none() -> None:
    """The budgets' three spellings reach EngineConfig as it takes them; absent = auto."""
    def config(*flags: str) -> dict[str, object]:
        return engine_config(parser().parse_args(["serve", *flags]))

    assert "kv_budget_bytes" not in config()  # EngineConfig's default: "auto"
    assert config("--kv-budget-bytes", "none")["kv_budget_bytes"] is None
    assert config("--kv-budget-bytes", "AUTO")["kv_budget_bytes"] == "auto"
    assert config("--kv-budget-bytes", "1048576")["kv_budget_bytes"] == 1 << 20
    assert config("--prefix-cache-bytes", "0")["prefix_cache_bytes"] == 0
    assert config("--buffer-cache-bytes", "auto")["buffer_cache_bytes"] == "auto"
    for built in (config("--kv-budget-bytes", "none", "--prefix-cache-bytes", "0"),
                  config("--buffer-cache-bytes", "4096")):
        EngineConfig(**built)  # what serve() builds is a valid config
    on_disk = config("--prefix-cache-dir", "/tmp/prefixes", "--prefix-cache-disk-bytes", "4096")
    assert (on_disk["prefix_cache_dir"], on_disk["prefix_cache_disk_bytes"]) == (
        "/tmp/prefixes", 4096)
    EngineConfig(**on_disk)
    for bad in (["--kv-budget-bytes", "lots"], ["--prefix-cache-bytes", "none"],
                ["--prefix-cache-disk-bytes", "auto"]):
        with pytest.raises(SystemExit):  # argparse names the option and exits 2
            parser().parse_args(["serve", *bad])


def test_the_command_serves_a_model(tiny_model_dir: Path) -> None:
    """``python -m mlx_providers.server`` in a subprocess: it starts, answers, stops."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_providers.server", "--model", str(tiny_model_dir),
         "--served-model-name", "tiny", "--port", str(port), "--api-key", "k",
         "--max-batch", "4", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[0]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                               max_retries=0, timeout=30)
        r = client.chat.completions.create(model="tiny", max_tokens=3, messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "hi"}])
        assert r.usage is not None and r.usage.completion_tokens == 3
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    assert process.returncode is not None
