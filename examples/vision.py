"""Images through LangChain, LlamaIndex and a LangChain tool result, batched on one engine.

Runs on a tiny Gemma 3 vision-language model built and fitted here in under a minute (its
weights are random until fitted to name a picture's colour; cached after the first run),
so it needs no download: `pip install 'mlx-providers[vision]'` is all. With a real
checkpoint, pass `--model DIR` (a Gemma 3 VLM in MLX format) and ask it anything.

Four concurrent questions (two LangChain invokes, a LlamaIndex chat, and an agent turn
whose tool returned a screenshot) become rows of the same batch.

    python examples/vision.py [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import shutil
import sys
import time
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

from mlx_providers import ChatMLXBatch, MLXBatchLLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's testkit
from testkit.vision_model import (
    COLOURS,
    build_tiny_vlm,
    fit_colour_namer,
    solid_image,
)


def colour_model() -> Path:
    """The tiny fitted VLM, built once into the user's cache."""
    root = Path.home() / ".cache" / "mlx-providers" / "examples" / "colour-gemma3-vlm-v2"
    if not (root / "config.json").exists():
        print("building and fitting a tiny Gemma 3 VLM (once, under a minute)...")
        partial = root.with_name(root.name + ".tmp")
        shutil.rmtree(partial, ignore_errors=True)
        fit_colour_namer(build_tiny_vlm(partial, seed=1))  # a seed whose fit converges
        partial.rename(root)
    return root


def picture(name: str) -> str:
    return base64.b64encode(solid_image(COLOURS[name], 64, noise=8, seed=7)).decode()


async def main(model: str) -> None:
    chat = ChatMLXBatch(model=model, max_tokens=12, temperature=0.0)
    llm = MLXBatchLLM(model, max_tokens=12, temperature=0.0)  # the same engine
    question = "What colour is this?"
    asks = {
        "LangChain, red picture": chat.ainvoke([HumanMessage(content=[
            {"type": "image", "base64": picture("red"), "mime_type": "image/png"},
            {"type": "text", "text": question}])]),
        "LangChain, blue picture": chat.ainvoke([HumanMessage(content=[
            {"type": "image_url",
             "image_url": {"url": f"data:image/png;base64,{picture('blue')}"}},
            {"type": "text", "text": question}])]),
        "LangChain tool result, a green screenshot": chat.ainvoke([
            HumanMessage("What colour is the screenshot?"),
            AIMessage("", tool_calls=[{"id": "call_1", "name": "take_screenshot",
                                       "args": {}}]),
            ToolMessage(content=[{"type": "image", "base64": picture("green"),
                                  "mime_type": "image/png"}], tool_call_id="call_1")]),
        "LlamaIndex, yellow picture": llm.achat([ChatMessage(role="user", blocks=[
            ImageBlock(image=base64.b64decode(picture("yellow"))),
            TextBlock(text=question)])]),
    }
    started = time.perf_counter()
    answers = await asyncio.gather(*asks.values())
    seconds = time.perf_counter() - started
    for label, answer in zip(asks, answers):
        text = answer.content if hasattr(answer, "content") else answer.message.content
        print(f"{label:45} -> {text!r}")
    stats = chat.engine.stats()
    print(f"\n{len(asks)} requests in {seconds:.2f} s, peak batch {stats.peak_running} rows; "
          f"{stats.vision_images} images through the tower "
          f"({stats.vision_seconds * 1e3:.1f} ms)")
    chat.engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Gemma 3 VLM directory (default: a tiny fitted one)")
    args = parser.parse_args()
    asyncio.run(main(args.model or str(colour_model())))
