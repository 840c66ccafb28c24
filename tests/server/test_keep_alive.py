"""keep_alive on the server: ``--keep-alive``, a request's ``keep_alive`` field (Ollama's
seconds or duration strings) through the ``openai`` SDK, and the ``/metrics`` gauge."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from engine import Engine, EngineConfig
from mlx_providers.server.cli import engine_config, parser
from mlx_providers.server.keep_alive import duration_seconds
from tests.conftest import wait_until
from tests.server.conftest import LiveServer
from tests.server.test_metrics_and_cli import scrape

Serve = Callable[..., tuple[LiveServer, Engine]]
MESSAGES = [{"role": "user", "content": "Say something about keeping models loaded."}]


def cli_config(*flags: str) -> dict[str, object]:
    return engine_config(parser().parse_args(["serve", *flags]))


def test_the_command_line_takes_seconds_or_a_duration() -> None:
    assert "keep_alive" not in cli_config()  # not given: the model stays loaded
    assert cli_config("--keep-alive", "300")["keep_alive"] == 300.0
    assert cli_config("--keep-alive", "5m")["keep_alive"] == 300.0
    assert cli_config("--keep-alive", "0")["keep_alive"] == 0.0
    assert "keep_alive" not in cli_config("--keep-alive", "-1")  # negative: forever
    assert EngineConfig(**cli_config("--keep-alive", "1h30m")).keep_alive == 5400.0  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # argparse names the option and exits 2
        parser().parse_args(["serve", "--keep-alive", "soon"])


@pytest.mark.parametrize(("value", "seconds"), [
    (30, 30.0), (0.5, 0.5), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0), ("0", 0.0), ("-1m", -60.0),
    (-1, -1.0), ("300", 300.0)])
def test_durations_read_as_ollama_reads_them(value: float | str, seconds: float) -> None:
    assert duration_seconds(value) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "soon", "5 m", "m", "1e3", "5mm", True, [5]])
def test_what_is_not_a_duration_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        duration_seconds(bad)


def test_keep_alive_from_the_command_line_and_each_request(serve: Serve) -> None:
    server, eng = serve(**cli_config("--keep-alive", "0"))
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)

    def loaded_metrics() -> tuple[float, float, float]:
        metrics = scrape(server)
        model = (("model", "tiny"),)
        return (metrics[("mlx_engine_model_loaded", model)],
                metrics[("mlx_engine_model_loads_total", model)],
                metrics[("mlx_engine_model_unloads_total", model)])

    wait_until(lambda: eng.stats().unloads == 1)  # the app loaded it at startup; idle, it went
    assert loaded_metrics() == (0.0, 1.0, 1.0)
    health = httpx.get(server.url + "/health", timeout=10)  # healthy, and not loaded back
    assert health.status_code == 200 and health.json()["models"] == {"tiny": "unloaded"}
    first = client.chat.completions.create(model="tiny", max_tokens=8,  # type: ignore[arg-type]
                                           messages=MESSAGES)
    wait_until(lambda: eng.stats().unloads == 2)  # --keep-alive 0: unloaded once idle
    assert loaded_metrics() == (0.0, 2.0, 2.0)
    # keep_alive -1 (Ollama's "forever"): reloaded, same answer, and it stays loaded.
    again = client.chat.completions.create(model="tiny", max_tokens=8,  # type: ignore[arg-type]
                                           messages=MESSAGES, extra_body={"keep_alive": -1})
    assert again.choices[0].message.content == first.choices[0].message.content
    assert loaded_metrics() == (1.0, 3.0, 2.0)
    # A duration string on the Responses API; "0s" unloads right after the request.
    client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                            extra_body={"keep_alive": "0s"})
    wait_until(lambda: eng.stats().unloads == 3)
    assert loaded_metrics() == (0.0, 3.0, 3.0)
    streamed = client.chat.completions.create(model="tiny", max_tokens=8, stream=True,  # type: ignore[arg-type]
                                              messages=MESSAGES,
                                              extra_body={"keep_alive": "1h"})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        first.choices[0].message.content)
    assert eng.stats().loaded and eng.stats().loads == 4


def test_a_bad_keep_alive_is_a_400_naming_it(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=live_server.base_url, api_key="x", max_retries=0)
    for create in (lambda body: client.chat.completions.create(
                       model="tiny", max_tokens=2, messages=MESSAGES,  # type: ignore[arg-type]
                       extra_body=body),
                   lambda body: client.responses.create(model="tiny", input="hi",
                                                        max_output_tokens=2, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as raised:
            create({"keep_alive": "soon"})
        assert raised.value.body["param"] == "keep_alive"  # type: ignore[index]
