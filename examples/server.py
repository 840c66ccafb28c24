"""One engine, two kinds of client: HTTP (the openai SDK) and in-process (ChatMLXBatch).

Starts the OpenAI-compatible app on the shared engine for a model (uvicorn, loopback, a
free port), then sends questions concurrently through the ``openai`` SDK over HTTP and
through ``ChatMLXBatch`` in this process; every one of them is a row of the same batch.
Ends with a Responses conversation continued with ``previous_response_id``.

    python examples/server.py [--model DIR_OR_GGUF]      # default: SmolLM2-135M-Instruct

Needs the ``server`` extra, ``openai`` and ``langchain-core``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time

import openai
import uvicorn

import engine  # noqa: F401 - the fast BLAS before mlx
from engine import get_engine
from mlx_providers import ChatMLXBatch
from mlx_providers.server import create_app


def start(app: object) -> tuple[uvicorn.Server, str]:
    """uvicorn on a free loopback port in a daemon thread; its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))  # type: ignore[arg-type]
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def main(model: str | None) -> None:
    eng = get_engine(model)  # the same engine ChatMLXBatch(model=model) uses
    print("loading the model ...")
    eng.start()
    app = create_app({"local": eng})
    server, base_url = start(app)
    print(f"serving 'local' at {base_url}")

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    chat = ChatMLXBatch(model=model, max_tokens=48)
    questions = ["What is a harbour?", "Name a colour.", "Why is the sky blue?",
                 "What is 2 + 2?"]
    started = time.perf_counter()
    http_answers, local_answers = await asyncio.gather(
        asyncio.gather(*(client.chat.completions.create(
            model="local", max_tokens=48, messages=[{"role": "user", "content": q}])
            for q in questions)),
        asyncio.gather(*(chat.ainvoke(q) for q in questions)))
    seconds = time.perf_counter() - started
    for q, r in zip(questions, http_answers):
        print(f"[http]       {q} -> {(r.choices[0].message.content or '').strip()[:70]!r}")
    for q, m in zip(questions, local_answers):
        print(f"[in-process] {q} -> {str(m.content).strip()[:70]!r}")
    stats = eng.stats()
    print(f"{len(questions) * 2} answers in {seconds:.1f} s; peak rows decoding together: "
          f"{stats.peak_running}")

    first = await client.responses.create(model="local", input="My name is Ada.",
                                          max_output_tokens=32)
    second = await client.responses.create(model="local", input="What is my name?",
                                           previous_response_id=first.id,
                                           max_output_tokens=32)
    cached = second.usage.input_tokens_details.cached_tokens if second.usage else 0
    print(f"turn 2 via previous_response_id: {second.output_text.strip()[:70]!r} "
          f"({cached} prompt tokens reused from the prefix cache)")
    server.should_exit = True
    eng.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    asyncio.run(main(parser.parse_args().model))
