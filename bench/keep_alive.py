"""keep_alive: what an idle engine gives back when it unloads its model, and what the
next request pays to load it again.

One engine on the model (the default SmolLM2-135M unless ``--model``). It prints the
process's resident set (``/proc/self/status`` VmRSS) and MLX's allocator (live arrays and
its cache of freed buffers, read on the engine thread: ``stats()``) at four points: before
the model loads, loaded and idle after a request, idle after keep_alive unloaded it, and
idle after a request loaded it again. Then the load times (the first, and each reload
after an unload) and the time to first token of a request that has to wait for a reload
(cold) against the same-sized request on the loaded model (warm); ``--repeats`` unload
and reload cycles, medians reported. Every request has a prompt of its own, so no answer
reuses a stored prefix.

    python bench/keep_alive.py [--model PATH_OR_GGUF] [--repeats 3] [--prompt-words 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import engine  # noqa: F401 - loads the fast BLAS before mlx
from engine import Completion, Engine, EngineConfig, EngineStats, SamplingParams, TextRequest

MB = 1 << 20


def vm_rss() -> int:
    """The process's resident set, in bytes, as the kernel reports it."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass(frozen=True)
class Point:
    name: str
    rss: int
    active: int
    cached: int


def point(name: str, stats: EngineStats) -> Point:
    return Point(name, vm_rss(), stats.mlx_active_bytes, stats.mlx_cache_bytes)


def wait_for(eng: Engine, done: Callable[[EngineStats], bool],
             timeout: float = 120.0) -> EngineStats:
    """Poll ``stats()`` until ``done(stats)``; the stats then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = eng.stats()
        if done(stats):
            return stats
        time.sleep(0.01)
    raise TimeoutError("the engine did not get there in time")


class Prompts:
    """A prompt of its own for every request (a different first word: no prefix reuse)."""

    def __init__(self, words: int) -> None:
        self._words = words
        self._next = 0

    def __call__(self) -> str:
        self._next += 1
        return f"Request {self._next}. " + "Describe the weather in detail. " * (self._words // 5)


def ask(eng: Engine, prompt: str, tokens: int, keep_alive: float | None) -> Completion:
    return eng.submit(TextRequest(prompt, SamplingParams(max_tokens=tokens)),
                         keep_alive=keep_alive).result(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--repeats", type=int, default=3, help="unload and reload cycles")
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=8, help="tokens each request decodes")
    args = parser.parse_args()
    prompts = Prompts(args.prompt_words)
    # Kept loaded unless a request says otherwise: each cycle's unload is asked for by a
    # request with keep_alive=0, so nothing here depends on a timer's length.
    eng = Engine(args.model, EngineConfig(keep_alive=None))
    points = [Point("before the model loads", vm_rss(), eng.stats().mlx_active_bytes,
                    eng.stats().mlx_cache_bytes)]
    started = time.perf_counter()
    first = ask(eng, prompts(), args.tokens, None)
    first_wall = time.perf_counter() - started
    first_load = eng.stats().last_load_seconds
    warm_ttft: list[float] = []
    cold_ttft: list[float] = []
    reloads: list[float] = []
    cold_wall: list[float] = []
    for cycle in range(args.repeats):
        warm = ask(eng, prompts(), args.tokens, None)
        assert warm.usage.time_to_first_token is not None
        warm_ttft.append(warm.usage.time_to_first_token)
        if cycle == 0:
            points.append(point("loaded, idle after a request",
                                wait_for(eng, lambda s: s.running == 0 and s.loaded)))
        unloads = eng.stats().unloads
        ask(eng, prompts(), args.tokens, 0)  # keep_alive 0: unloaded once this one ends
        idle = wait_for(eng, lambda s, before=unloads: s.unloads > before and not s.loaded)
        if cycle == 0:
            points.append(point("idle after the unload", idle))
        started = time.perf_counter()
        cold = ask(eng, prompts(), args.tokens, None)  # waits for the reload
        cold_wall.append(time.perf_counter() - started)
        assert cold.usage.time_to_first_token is not None
        cold_ttft.append(cold.usage.time_to_first_token)
        reloads.append(eng.stats().last_load_seconds)
        if cycle == 0:
            points.append(point("loaded again, idle after a request",
                                wait_for(eng, lambda s: s.running == 0 and s.loaded)))
    stats = eng.stats()
    eng.close()

    print(f"model: {args.model or 'SmolLM2-135M-Instruct (default)'}; weights "
          f"{stats.weights_bytes / MB:.1f} MB ({stats.weight_format}); "
          f"{args.repeats} unload/reload cycles, {args.tokens} tokens a request\n")
    print("| state | RSS (VmRSS) MB | MLX active MB | MLX cache MB |")
    print("|---|---:|---:|---:|")
    for p in points:
        print(f"| {p.name} | {p.rss / MB:.1f} | {p.active / MB:.1f} | {p.cached / MB:.1f} |")
    loaded, unloaded = points[1], points[2]
    print(f"\nthe unload gave back {(loaded.rss - unloaded.rss) / MB:.1f} MB of RSS and "
          f"{(loaded.active - unloaded.active) / MB:.1f} MB of MLX arrays\n")
    print("| | seconds (median) |")
    print("|---|---:|")
    print(f"| first load (engine's last_load_seconds) | {first_load:.3f} |")
    print(f"| reload after an unload (last_load_seconds) | {statistics.median(reloads):.3f} |")
    print(f"| first request of the process: TTFT (includes the first load) | "
          f"{first.usage.time_to_first_token or 0:.3f} (wall {first_wall:.3f}) |")
    print(f"| TTFT cold: a request that waits for the reload | "
          f"{statistics.median(cold_ttft):.3f} (wall {statistics.median(cold_wall):.3f}) |")
    print(f"| TTFT warm: the same-sized request, model loaded | "
          f"{statistics.median(warm_ttft):.3f} |")
    print(f"\nloads {stats.loads}, unloads {stats.unloads}")


if __name__ == "__main__":
    main()
