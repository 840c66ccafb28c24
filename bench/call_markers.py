"""Agents' calls with the dialect's markers refused inside argument strings, or not.

Replays what ``create_agent(model, tools=[get_weather], response_format=Weather)`` sends
the default model, turn after turn, for several agents at once (one city each), greedy:
each turn is one request with the tool offered beside the schema (a call or the answer);
a valid call is answered by the tool and the agent goes on, an answer ends it, a reply cut
by ``max_tokens`` ends it as a failure. Answered calls are refused again (the engine's
repeat guard), so the model must vary its arguments: that is where the default model once
wrote a ``city`` running on as ``Paris, 21 C, ... }}</tool_call>You can't have ...``.

Two engines on the same model, the guard on (the engine as shipped) and off (its markers
taken away), run the same agents. Printed: per turn, how many replies were valid calls,
answers, or invalid calls cut by ``max_tokens``, and how many argument strings held a
marker.

    python bench/call_markers.py [--model PATH_OR_GGUF] [--agents 8] [--turns 10]
        [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import ChatRequest, Engine, EngineConfig, JsonSchema, SamplingParams, blas_info

CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dakar", "Perth", "Rome",
          "Bern", "Kyiv", "Accra", "Hanoi", "Sofia", "Riga", "Doha"]
SYSTEM = "You are a helpful assistant. Use get_weather for weather questions."
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city"},
    "summary": {"type": "string", "description": "the weather, in a few words"}},
    "required": ["city", "summary"]}


@dataclass
class Agent:
    city: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    ended: str = ""  # "answer" or "cut" once it stops

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"What is the weather like in "
                                                     f"{self.city}?"}]


@dataclass
class Tally:
    calls: int = 0
    answers: int = 0
    cut: int = 0
    marked: int = 0  # argument strings holding a call marker
    tokens: int = 0
    invalid: int = 0  # replies holding call-like text that did not parse


def run(model: str | None, guarded: bool, agents: int, turns: int, max_tokens: int,
        ) -> tuple[list[Tally], float]:
    eng = Engine(model, EngineConfig()).start()
    compiler = eng._runtime.preparer().compiler
    markers = compiler.call_markers
    if not guarded:  # the engine as it was before the guard: any text in a free string
        compiler.call_markers = ()
    crew = [Agent(city) for city in CITIES[:agents]]
    tallies: list[Tally] = []
    started = time.perf_counter()
    try:
        for turn in range(turns):
            live = [a for a in crew if not a.ended]
            if not live:
                break
            tally = Tally()
            handles = [eng.submit(ChatRequest.from_openai(
                a.messages, SamplingParams(max_tokens=max_tokens,
                                           constraint=JsonSchema(WEATHER)),
                tools=[GET_WEATHER], parallel_tool_calls=False)) for a in live]
            for agent, handle in zip(live, handles):
                result = handle.result(timeout=1800)
                tally.tokens += result.usage.completion_tokens
                strings = [str(v) for call in result.tool_calls
                           for v in (call.arguments.values()
                                     if isinstance(call.arguments, dict) else [call.arguments])]
                tally.marked += sum(any(m in s for m in markers) for s in strings)
                tally.invalid += bool(result.invalid_tool_calls)
                if result.tool_calls:
                    tally.calls += 1
                    call = result.tool_calls[0]
                    agent.messages += [
                        {"role": "assistant", "content": "", "tool_calls": [{
                            "id": call.id, "type": "function", "function": {
                                "name": call.name, "arguments": json.dumps(call.arguments)}}]},
                        {"role": "tool", "tool_call_id": call.id,
                         "content": f"It is sunny and {20 + turn} C in "
                                    f"{call.arguments.get('city', '?')}."}]
                elif result.finish_reason.value == "length":
                    tally.cut += 1
                    agent.ended = "cut"
                else:
                    tally.answers += 1
                    agent.ended = "answer"
            tallies.append(tally)
    finally:
        seconds = time.perf_counter() - started
        eng.close()
    return tallies, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    print(f"BLAS: {blas_info().name}; {args.agents} agents, up to {args.turns} turns, "
          f"greedy, max_tokens={args.max_tokens}\n")
    totals = {}
    for guarded in (False, True):
        tallies, seconds = run(args.model, guarded, args.agents, args.turns, args.max_tokens)
        name = "guard on" if guarded else "guard off"
        print(f"{name} ({seconds:.0f} s)")
        print(f"{'turn':>5} {'calls':>6} {'answers':>8} {'cut':>4} {'marker in arg':>14} "
              f"{'tokens':>7} {'unparsed':>9}")
        for turn, t in enumerate(tallies, 1):
            print(f"{turn:>5} {t.calls:>6} {t.answers:>8} {t.cut:>4} {t.marked:>14} "
                  f"{t.tokens:>7} {t.invalid:>9}")
        total = Tally(*(sum(getattr(t, k) for t in tallies)
                        for k in ("calls", "answers", "cut", "marked", "tokens", "invalid")))
        totals[name] = total
        print(f"{'all':>5} {total.calls:>6} {total.answers:>8} {total.cut:>4} "
              f"{total.marked:>14} {total.tokens:>7} {total.invalid:>9}\n")
    on, off = totals["guard on"], totals["guard off"]
    replies_on = on.calls + on.answers + on.cut
    replies_off = off.calls + off.answers + off.cut
    print(f"valid replies (calls + answers): off {off.calls + off.answers}/{replies_off}, "
          f"on {on.calls + on.answers}/{replies_on}; cut: off {off.cut}, on {on.cut}")


if __name__ == "__main__":
    main()
