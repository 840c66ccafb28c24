"""Ollama's door around a request's life: a dropped NDJSON stream evicts its row, a
failure mid-stream is an error line, ``keep_alive`` loads and unloads the model,
fill-in-the-middle on a tokenizer that has the tokens, and ``--ollama-port``'s second
listener. Real engines on the tiny model, each test under a hard timeout."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import uvicorn

from engine import Engine, EngineConfig, SamplingParams, StepProbe, TextRequest, TurnReport
from mlx_providers.server import cli, create_app
from mlx_providers.server.fim import fill_in_the_middle
from tests.conftest import _built, _cache_root, wait_until
from tests.fake_engine import ScriptedEngine
from tests.server.conftest import LiveServer
from tests.server.test_disconnect import STEP, assert_stopped_generating

pytestmark = pytest.mark.timeout(120)
Serve = Callable[..., tuple[LiveServer, Engine]]
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 1500}}  # 30 s of slowed steps: still running when dropped


@pytest.fixture
def slow_server(serve: Serve, slow_steps: Callable[[float], None]) -> tuple[LiveServer, Engine]:
    slow_steps(STEP)
    return serve()


def test_a_dropped_ndjson_stream_evicts_its_row(slow_server: tuple[LiveServer, Engine]) -> None:
    server, eng = slow_server
    with httpx.stream("POST", server.url + "/api/chat", json=LONG, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = response.iter_lines()
        for _ in range(5):
            assert json.loads(next(lines))["done"] is False
        assert eng.stats().running == 1
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    assert eng.stats().completed == 0 and eng.stats().generated_tokens < 200
    served = server.app.state.ctx.models.get("tiny")  # type: ignore[attr-defined]
    wait_until(lambda: served.in_flight == 0, timeout=10)  # its admission slot came back


def test_a_dropped_generate_request_evicts_its_row(
        slow_server: tuple[LiveServer, Engine]) -> None:
    server, eng = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/api/generate", timeout=0.6, json={
            "model": "tiny", "prompt": "hi", "stream": False,
            "options": {"num_predict": 1500}})
    wait_until(lambda: eng.stats().cancelled == 1, timeout=10)
    assert_stopped_generating(eng)
    assert eng.stats().completed == 0


def test_a_failure_mid_stream_is_an_error_line(serve: Serve, step_probe: StepProbe) -> None:
    server, _ = serve()
    turns = [0]

    def fail_after_four_turns(_report: TurnReport) -> None:
        turns[0] += 1
        if turns[0] == 4:
            step_probe.fail_always(RuntimeError("simulated device failure"))

    step_probe.on_turn = fail_after_four_turns
    client = ollama.Client(host=server.url, timeout=30)
    seen: list[Any] = []
    with pytest.raises(ollama.ResponseError, match="simulated device failure"):
        for chunk in client.chat(model="tiny", messages=LONG["messages"], stream=True,  # type: ignore[arg-type]
                                 options={"num_predict": 50}):
            seen.append(chunk)
    assert seen and not any(c.done for c in seen)  # tokens came, then the error line
    step_probe.stop_failing()


def test_keep_alive_loads_and_unloads_the_model(serve: Serve) -> None:
    server, eng = serve()
    client = ollama.Client(host=server.url, timeout=60)
    assert eng.stats().loaded and eng.stats().loads == 1  # the app loaded it at startup
    loaded = client.chat(model="tiny", messages=[])  # Ollama's "load" request
    assert loaded.done and loaded.done_reason == "load" and eng.stats().loads == 1
    first = client.chat(model="tiny", messages=LONG["messages"], keep_alive=0,  # type: ignore[arg-type]
                        options={"num_predict": 6})
    wait_until(lambda: eng.stats().unloads == 1)  # keep_alive 0: unloaded once idle
    assert not eng.stats().loaded
    # An unload of a model that is not loaded loads nothing.
    stopped = client.generate(model="tiny", prompt="", keep_alive=0)
    assert stopped.done_reason == "unload" and eng.stats().loads == 1
    # The next request waits for the reload, and says so; "1h" keeps it loaded.
    again = client.chat(model="tiny", messages=LONG["messages"], keep_alive="1h",  # type: ignore[arg-type]
                        options={"num_predict": 6})
    assert again.message.content == first.message.content
    assert eng.stats().loads == 2 and again.load_duration and again.load_duration > 0
    assert first.load_duration == 0
    running = [m.model for m in client.ps().models]
    assert "tiny:latest" in running
    # `ollama stop`: an empty request with keep_alive 0 unloads a loaded model.
    stop = client.chat(model="tiny", messages=[], keep_alive=0)
    assert stop.done_reason == "unload"
    wait_until(lambda: eng.stats().unloads == 2)
    assert "tiny:latest" not in [m.model for m in client.ps().models]
    assert client.generate(model="tiny", prompt="").done_reason == "load"
    assert eng.stats().loaded and eng.stats().loads == 3


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def _with_fim_tokens(source: Path) -> Callable[[Path], Path]:
    """A builder: the tiny model with Qwen2.5-Coder's FIM markers added to its tokenizer
    (ids inside its embedding table), the weights hard-linked."""
    def build(out: Path) -> Path:
        out.mkdir(parents=True)
        for item in source.iterdir():
            if item.name == "tokenizer.json":
                continue
            try:
                os.link(item, out / item.name)
            except OSError:
                shutil.copy2(item, out / item.name)
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        next_id = max(t["id"] for t in tokenizer["added_tokens"]) + 1
        tokenizer["added_tokens"] += [
            {"id": next_id + i, "content": token, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": False}
            for i, token in enumerate(FIM_TOKENS)]
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
        return out
    return build


@pytest.fixture(scope="module")
def fim_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = _built(_cache_root(tmp_path_factory) / "tiny-qwen2-fim-v1",
                  _with_fim_tokens(tiny_model_dir))
    eng = Engine(path, EngineConfig(max_batch=4, prefill_chunk=64)).start()
    yield eng
    eng.close()


def test_fill_in_the_middle_where_the_tokenizer_has_the_tokens(fim_engine: Engine) -> None:
    server = LiveServer(create_app({"coder": fim_engine}, embeddings={})).start()
    try:
        client = ollama.Client(host=server.url, timeout=60)
        prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
        reply = client.generate(model="coder", prompt=prefix, suffix=suffix,
                                options={"num_predict": 8})
        ids, ends = fill_in_the_middle(fim_engine.tokenizer, prefix, suffix)
        want = fim_engine.submit(TextRequest(tuple(ids), SamplingParams(
            max_tokens=8, stop_token_ids=ends))).result(timeout=60)
        assert reply.response == want.content and reply.prompt_eval_count == len(ids)
        vocab = fim_engine.tokenizer.get_vocab()
        assert [vocab[t] for t in FIM_TOKENS] == [ids[0], ids[ids.index(vocab[FIM_TOKENS[1]])],
                                                  ids[-1]]  # each marker is one token
        assert "insert" in (client.show("coder").capabilities or [])
        with pytest.raises(ollama.ResponseError, match="images"):
            client.generate(model="coder", prompt=prefix, suffix=suffix, images=[b"\x89PNG"])
    finally:
        server.stop()


def test_the_ollama_port_flag() -> None:
    def parsed(*flags: str) -> Any:
        return cli.parser().parse_args(["serve", *flags]).ollama_port

    assert parsed() is None and parsed("--ollama-port") == 11434
    assert parsed("--ollama-port", "11500") == 11500
    args = cli.parser().parse_args(["serve", "--port", "8123", "--ollama-port", "8123"])
    with pytest.raises(SystemExit, match="--ollama-port 8123"):
        cli.ollama_sockets(args)


def test_serve_listens_on_both_ports_with_one_app(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ScriptedEngine()
    taken: list[tuple[uvicorn.Server, list[Any]]] = []
    monkeypatch.setattr(cli, "get_engine", lambda model, **config: fake)
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self, sockets=None: taken.append((self, sockets or [])))
    assert cli.main(["serve", "--model", str(tmp_path / "m"), "--served-model-name", "m",
                     "--embedding-model", "none", "--port", "0", "--ollama-port", "0"]) == 0
    [(server, sockets)] = taken
    ports = [s.getsockname()[1] for s in sockets]
    assert len(set(ports)) == 2 and all(ports)
    monkeypatch.undo()  # now serve the captured app on the captured sockets for real
    fake.usable = True
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=30)
        for port in ports:
            base = f"http://127.0.0.1:{port}"
            assert httpx.get(base + "/api/version", timeout=10).status_code == 200
            assert httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"] == "m"
            reply = httpx.post(base + "/api/chat", timeout=10, json={
                "model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]})
            assert reply.json()["message"]["content"] == "Hello from the script."
    finally:
        server.should_exit = True
        thread.join(15)
        for sock in sockets:
            sock.close()
    assert not thread.is_alive()
