"""Aggregate decode tokens/s through Engine vs driving mlx-lm's BatchGenerator directly.

Same model, same prompts, same run. Decode rate = generated tokens / (last token time -
first token time), measured the same way on both sides. Beside it, from ``Engine.stats()``:
the mean time of a lane step (device work and waiting on it) and the engine loop's own
work per step outside it (commands, plan, update, publishing).

    python bench/engine_throughput.py [--model PATH_OR_GGUF] [--tokens 64]
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Engine, EngineConfig, SamplingParams, TextRequest, blas_info

TOPICS = ["the sea", "a robot", "tea", "mountains", "a city at night", "an old clock",
          "rain", "a library", "the moon", "bread", "a violin", "snow", "a garden",
          "trains", "a lighthouse", "autumn"]


_runs = itertools.count()


def prompts_for(eng: Engine, n: int) -> list[list[int]]:
    """``n`` prompts, new for each run: a prompt the prefix cache already holds whole
    would start decoding before the others and leave the measured window part-empty."""
    run = next(_runs)
    out = []
    for i in range(n):
        topic = f"{TOPICS[i % 16]} (poem {run}.{i})"
        messages = [{"role": "user", "content": f"Write a short poem about {topic}."}]
        text = eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        out.append(list(eng.tokenizer.encode(text, add_special_tokens=False)))
    return out


def raw_batch_generator(eng: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """Drive BatchGenerator on the engine's own weights, in the form the engine runs them
    (the same CPU weight policy: its kernels, or float32), so the ratio is the engine's own."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from engine.device.loading.weight_policy import apply_weight_policy

    model, _ = load(str(eng.model_path))
    apply_weight_policy(model, eng.config.quantized, eng.config.cpu_int8)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, max_tokens=[tokens] * len(prompts))
    first = last = None
    count = 0
    while count < tokens * len(prompts):
        _, responses = gen.next()
        if responses:
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(responses)
    gen.close()
    del model
    return count / (last - first), count


def through_engine(eng: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    """Decode rate through the engine; the engine's own step timings land in ``eng.stats()``."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    stamps: list[float] = []
    lock = threading.Lock()

    def on_token(_t: int, _d: str) -> None:
        with lock:
            stamps.append(time.perf_counter())

    handles = [eng.submit(TextRequest(p, params), on_token=on_token) for p in prompts]
    for h in handles:
        h.result()
    return len(stamps) / (max(stamps) - min(stamps)), len(stamps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculation", type=int, default=EngineConfig().speculation,
                        help="EngineConfig.speculation (default: the engine's default)")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    # Prefill all rows together on both sides, so decoding starts for all at once.
    width = max(levels)
    eng = Engine(args.model, EngineConfig(max_batch=width, prefill_batch=width,
                                          speculation=args.speculation)).start()
    print(f"model: {eng.model_path}\nBLAS: {blas_info().name}\n"
          f"speculation: {args.speculation}\n")
    through_engine(eng, prompts_for(eng, 2), 8)  # warm-up
    print("| rows | BatchGenerator tok/s | Engine tok/s | ratio | each run | engine step ms "
          "| engine overhead ms/step |")
    print("|-----:|---------------------:|-------------:|------:|---|---------------:"
          "|------------------------:|")
    for n in levels:
        raw = ours = 0.0
        step_ms = overhead_ms = 0.0
        pairs: list[float] = []  # each run's engine / raw, the pair run back to back
        for _ in range(args.repeats):  # interleaved, best of n: less noise on a shared CPU
            prompts = prompts_for(eng, n)
            raw_rate = raw_batch_generator(eng, prompts, args.tokens)[0]
            raw = max(raw, raw_rate)
            before = eng.stats()
            rate = through_engine(eng, prompts, args.tokens)[0]
            after = eng.stats()
            pairs.append(rate / raw_rate)
            if rate > ours:
                steps = max(1, after.steps - before.steps)
                step_ms = 1000 * (after.step_seconds - before.step_seconds) / steps
                overhead_ms = 1000 * (after.overhead_seconds - before.overhead_seconds) / steps
                ours = rate
        each = " / ".join(f"{pair:.2f}" for pair in pairs)
        print(f"| {n} | {raw:.1f} | {ours:.1f} | {ours / raw:.3f} | {each} | {step_ms:.1f} "
              f"| {overhead_ms:.2f} |", flush=True)
    eng.close()


if __name__ == "__main__":
    try:
        main()
    finally:
        # The raw BatchGenerator ran MLX on this thread: its streams must go before the
        # interpreter exits, or the process segfaults there (as the engine thread's would).
        import mlx.core as mx

        mx.clear_streams()
