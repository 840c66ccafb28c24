"""Two LoRA adapters and the base model, in one batch on one copy of the weights.

Each LangChain chat model below names its adapter (``ChatMLXBatch(adapter=...)``); all three
run on the same engine, so their concurrent requests are rows of one batch, each with its
own adapter's low-rank delta. The adapters here are made by hand in a second (random
low-rank weights in mlx-lm's format, on a tiny random model, so the texts are noise but
visibly different); with your own, pass the directories ``mlx_lm.lora`` wrote.

    python examples/lora_adapters.py [--model DIR --adapter DIR --adapter DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from langchain_core.messages import HumanMessage

from mlx_providers import ChatMLXBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's testkit
from testkit.adapters import make_adapter
from testkit.tiny_model import build_tiny_model


def tiny_model_and_adapters() -> tuple[str, list[str]]:
    root = Path.home() / ".cache" / "mlx-providers" / "examples" / "lora"
    model = root / "tiny-model"
    if not (model / "config.json").exists():
        print("building a tiny model and two adapters (once, a few seconds)...")
        build_tiny_model(model)
    adapters = []
    for name, seed in (("summariser", 1), ("tool-caller", 2)):
        if not (root / name / "adapters.safetensors").exists():
            make_adapter(root / name, model, seed=seed)
        adapters.append(root / name)
    return str(model), [str(a) for a in adapters]


async def main(model: str, adapters: list[str]) -> None:
    faces = {"base": ChatMLXBatch(model=model, max_tokens=12, temperature=0.0)}
    for path in adapters:
        faces[Path(path).name] = ChatMLXBatch(model=model, max_tokens=12, temperature=0.0,
                                              adapter=path)
    question = [HumanMessage("Tell me about rivers.")]
    started = time.perf_counter()
    answers = await asyncio.gather(*(face.ainvoke(question) for face in faces.values()))
    seconds = time.perf_counter() - started
    for name, answer in zip(faces, answers):
        print(f"{name:12} -> {answer.content!r}")
    engine = faces["base"].engine
    stats = engine.stats()
    print(f"\n{len(faces)} requests in {seconds:.2f} s on one engine "
          f"({len({id(f.engine) for f in faces.values()})} engine), peak batch "
          f"{stats.peak_running} rows; {stats.adapters_loaded} adapters loaded, "
          f"{stats.adapters_bytes / 1024:.0f} KiB beside {stats.weights_bytes / 2**20:.1f} MiB "
          "of base weights")
    engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: a tiny random one)")
    parser.add_argument("--adapter", action="append", default=[],
                        help="an adapter directory in mlx-lm's format (repeat)")
    args = parser.parse_args()
    if args.model:
        asyncio.run(main(args.model, args.adapter))
    else:
        asyncio.run(main(*tiny_model_and_adapters()))
