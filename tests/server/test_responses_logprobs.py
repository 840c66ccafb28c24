"""Responses logprobs through the ``openai`` SDK: ``include=["message.output_text.logprobs"]``
and ``top_logprobs`` give the output_text part, its deltas and its done event OpenAI's
logprobs, the same tokens and numbers as the chat-completions door for the same prompt."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.server.conftest import LiveServer

HI = "Tell me about the sea."
INCLUDE: Any = ["message.output_text.logprobs"]
TOKENS = 8


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def logprobs_of(response: Any) -> list[Any]:
    """The logprobs of a response's first output_text part."""
    [item] = response.output
    assert item.type == "message"
    part = item.content[0]
    assert part.type == "output_text" and part.logprobs is not None
    return list(part.logprobs)


def shape(logprobs: Any) -> list[tuple[str, list[str]]]:
    """Each token and its alternatives' tokens."""
    return [(t.token, [a.token for a in t.top_logprobs or ()]) for t in logprobs]


def numbers(logprobs: Any) -> list[float]:
    return [v for t in logprobs for v in (t.logprob, *(a.logprob for a in t.top_logprobs))]


def test_the_output_text_carries_the_chat_doors_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": HI}], max_tokens=TOKENS,
        logprobs=True, top_logprobs=2)
    assert chat.choices[0].logprobs is not None
    expected = chat.choices[0].logprobs.content
    assert expected is not None and len(expected) == TOKENS
    r = client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                include=INCLUDE, top_logprobs=2)
    assert r.output_text == chat.choices[0].message.content
    logprobs = logprobs_of(r)
    assert shape(logprobs) == shape(expected)
    assert all(len(t.top_logprobs) == 2 for t in logprobs)
    assert [t.bytes for t in logprobs] == [t.bytes for t in expected]
    assert numbers(logprobs) == pytest.approx(numbers(expected), abs=1e-4)
    assert r.top_logprobs == 2


def test_a_stream_sends_each_deltas_logprobs(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                    include=INCLUDE, top_logprobs=2)
    expected = logprobs_of(whole)
    assert len(expected) == TOKENS
    events = list(client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                          include=INCLUDE, top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [t for e in deltas for t in e.logprobs]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert shape(streamed) == shape(expected)
    assert numbers(streamed) == pytest.approx(numbers(expected), abs=1e-4)
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert shape(done.logprobs) == shape(expected)
    final = events[-1]
    assert final.type == "response.incomplete"
    assert shape(logprobs_of(final.response)) == shape(expected)


def test_logprobs_come_only_when_asked(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS)
    assert logprobs_of(plain) == []
    events = list(client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                          stream=True))
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")
    # Alternatives asked for without the include are not dropped without a word.
    alone = client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                    top_logprobs=3)
    logprobs = logprobs_of(alone)
    assert len(logprobs) == TOKENS
    assert all(len(t.top_logprobs) == 3 for t in logprobs)
    chosen = client.responses.create(model="tiny", input=HI, max_output_tokens=TOKENS,
                                     include=INCLUDE)
    logprobs = logprobs_of(chosen)
    assert len(logprobs) == TOKENS
    assert all(t.top_logprobs == [] for t in logprobs)


@pytest.mark.parametrize("value", [21, -1])
def test_top_logprobs_past_openais_range_is_refused(client: openai.OpenAI, value: int) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input=HI, max_output_tokens=2,
                                include=INCLUDE, top_logprobs=value)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == "top_logprobs"


def test_only_the_messages_tokens_carry_logprobs() -> None:
    """On hand-made engine events (reasoning is hard to drive from a random model): the
    thinking's and a call's tokens belong to no output_text, a token whose text is held
    back goes with the next text, and a last token without text still reaches the part."""
    from engine import FinishReason, StreamEvent, TokenLogprob, ToolCallDelta, Usage
    from mlx_providers.server.responses_events import ResponseTranslator

    def lp(token_id: int) -> tuple[TokenLogprob, ...]:
        return (TokenLogprob(token_id, -0.5 * token_id, ((token_id, -0.5 * token_id),)),)

    translator = ResponseTranslator("m", {}, token_text=lambda token_id: f"t{token_id}")
    stream = [StreamEvent("<think>", (1,), lp(1), reasoning="hm"),
              StreamEvent("", (2,), lp(2)),  # no text of its own yet (half a character)
              StreamEvent("Hi", (3,), lp(3), content="Hi"),
              StreamEvent(" S", (4,), lp(4)),  # held back: might start a stop string
              StreamEvent("TO", (5,), lp(5), content=" STO"),
              StreamEvent("<tool_call>", (6,), lp(6), tool_call_deltas=(
                  ToolCallDelta(0, "call_1", "f", "{}"),)),
              StreamEvent("", (7,), lp(7), finish_reason=FinishReason.STOP,
                          usage=Usage(prompt_tokens=3, completion_tokens=7))]
    events = [e for event in stream for e in translator.feed(event)]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(d["delta"], [t["token"] for t in d["logprobs"]]) for d in deltas] == [
        ("Hi", ["t2", "t3"]), (" STO", ["t4", "t5"])]
    message = next(item for item in translator.output if item["type"] == "message")
    assert [t["token"] for t in message["content"][0]["logprobs"]] == ["t2", "t3", "t4", "t5"]
    assert message["content"][0]["logprobs"][0] == {
        "token": "t2", "logprob": -1.0, "bytes": list(b"t2"),
        "top_logprobs": [{"token": "t2", "logprob": -1.0, "bytes": list(b"t2")}]}
    # A message still open when the row ends gets its last tokens in an empty delta.
    ending = ResponseTranslator("m", {}, token_text=lambda token_id: f"t{token_id}")
    tail = [e for event in [StreamEvent("Hi", (1,), lp(1), content="Hi"),
                            StreamEvent("", (2,), lp(2), finish_reason=FinishReason.LENGTH,
                                        usage=Usage(prompt_tokens=3, completion_tokens=2))]
            for e in ending.feed(event)]
    assert [(e["delta"], [t["token"] for t in e["logprobs"]]) for e in tail
            if e["type"] == "response.output_text.delta"] == [("Hi", ["t1"]), ("", ["t2"])]
    [done] = [e for e in tail if e["type"] == "response.output_text.done"]
    assert [t["token"] for t in done["logprobs"]] == ["t1", "t2"]
