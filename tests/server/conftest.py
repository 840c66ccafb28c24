"""A real server on a loopback port: uvicorn in a thread, the tiny model, hard timeouts."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn

import engine  # noqa: F401 - loads the fast BLAS before anything imports mlx
from engine import Engine, EngineConfig, StepProbe
from mlx_providers.server import ServerSettings, create_app
from mlx_providers.server.responses_store import ResponseStore

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


class LiveServer:
    """An app served by uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: object) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on",  # type: ignore[arg-type]
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(START_TIMEOUT / 0.02)):
            if self.server.started or not self._thread.is_alive():
                break
            deadline.wait(0.02)
        if not self.server.started:
            raise RuntimeError("the server did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(STOP_TIMEOUT)
        if self._thread.is_alive():  # connections still open: make it quit now
            self.server.force_exit = True
            self._thread.join(STOP_TIMEOUT)
        self._sock.close()
        assert not self._thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def server_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """One engine on the tiny model for a module's tests."""
    eng = Engine(tiny_model_dir, EngineConfig(max_batch=8, prefill_chunk=64)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def live_server(server_engine: Engine) -> Iterator[LiveServer]:
    """The server for a module's tests, serving the tiny model as ``tiny``."""
    server = LiveServer(create_app({"tiny": server_engine})).start()
    yield server
    server.stop()


@pytest.fixture
def step_probe() -> StepProbe:
    """The probe every engine ``serve`` makes runs with: slow or failing steps on demand."""
    return StepProbe()


@pytest.fixture
def serve(tiny_model_dir: Path,
          step_probe: StepProbe) -> Iterator[Callable[..., tuple[LiveServer, Engine]]]:
    """Factory: a fresh engine (statistics from zero) and server for one test."""
    started: list[tuple[LiveServer, Engine]] = []

    def factory(settings: ServerSettings | None = None, store: ResponseStore | None = None,
                **config: object) -> tuple[LiveServer, Engine]:
        eng = Engine(tiny_model_dir, EngineConfig(**{"max_batch": 8, "prefill_chunk": 64,
                                                      **config}),  # type: ignore[arg-type]
                     probe=step_probe)
        server = LiveServer(create_app({"tiny": eng}, settings=settings, store=store)).start()
        started.append((server, eng))
        return server, eng

    yield factory
    for server, eng in started:
        server.stop()
        eng.close()


@pytest.fixture
def slow_steps(step_probe: StepProbe) -> Callable[[float], None]:
    """Make every step of the engines ``serve`` makes take ``seconds`` longer (a slow model)."""
    return step_probe.slow_steps
