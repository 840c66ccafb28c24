"""``/v1/responses`` through the ``openai`` SDK: output items, streams, tools, the store."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine import Engine, StepProbe, TurnReport
from tests.server.conftest import LiveServer

Serve = Callable[..., tuple[LiveServer, Engine]]
PICK = {"type": "function", "name": "pick", "description": "Pick a colour.",
        "parameters": {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}},
                       "required": ["colour"]}}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def test_a_response_has_a_message_item_and_usage(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Tell me about boats.",
                                max_output_tokens=9)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.output_text and item.content[0].type == "output_text"
    assert r.usage is not None and r.usage.output_tokens == 9
    assert r.usage.total_tokens == r.usage.input_tokens + 9
    # The same input again reads its prompt from the prefix store: all but the last token
    # (a row computes at least one position itself).
    again = client.responses.create(model="tiny", input="Tell me about boats.",
                                    max_output_tokens=9)
    assert again.usage is not None and again.output_text == r.output_text
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens


def test_a_stream_emits_the_event_sequence(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny", input="Tell me about boats.",
                                    max_output_tokens=9)
    events = list(client.responses.create(model="tiny", input="Tell me about boats.",
                                          max_output_tokens=9, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.usage.output_tokens == 9


def test_a_completed_response_with_instructions(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hi", instructions="Answer in JSON.",
                                max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "x", "schema": {
                                    "type": "object",
                                    "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"]}}})
    assert r.status == "completed" and r.instructions == "Answer in JSON."
    assert json.loads(r.output_text) in ({"ok": True}, {"ok": False})


def test_forced_function_calls_are_function_call_items(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Pick one.", tools=[PICK],  # type: ignore[list-item]
                                tool_choice="required", max_output_tokens=100)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "pick" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), PICK["parameters"])
    events = list(client.responses.create(model="tiny", input="Pick one.", tools=[PICK],  # type: ignore[list-item]
                                          tool_choice={"type": "function", "name": "pick"},
                                          max_output_tokens=100, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["colour"] in ("red", "blue")  # type: ignore[union-attr]
    assert kinds[-1] == "response.completed"


def test_function_call_outputs_continue_a_stored_response(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Pick one.", tools=[PICK],  # type: ignore[list-item]
                                    tool_choice="required", max_output_tokens=100)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[PICK], max_output_tokens=5,  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "red"}])
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def test_previous_response_id_continues_the_history_and_hits_the_prefix_cache(
        client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="My name is Ada. Remember it.",
                                    instructions="Be brief.", max_output_tokens=12)
    # Instructions are not carried over (as in OpenAI's API): a client sends them again.
    second = client.responses.create(model="tiny", input="What is my name?",
                                     instructions="Be brief.",
                                     previous_response_id=first.id, max_output_tokens=6)
    assert first.usage is not None and second.usage is not None
    # The whole first prompt (instructions, question) is reused from the engine's cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # The same history sent in full is the same prompt, and the same answer.
    history: list[Any] = [{"role": "user", "content": "My name is Ada. Remember it."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}]
    resent = client.responses.create(model="tiny", input=history, instructions="Be brief.",
                                     max_output_tokens=6)
    assert resent.usage is not None
    assert resent.usage.input_tokens == second.usage.input_tokens
    assert resent.output_text == second.output_text


def test_instructions_are_not_carried_over(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hello there.",
                                    instructions="Always answer in French. " * 8,
                                    max_output_tokens=4)
    plain = client.responses.create(model="tiny", input="Hello there.", max_output_tokens=4)
    second = client.responses.create(model="tiny", input="And?", previous_response_id=first.id,
                                     max_output_tokens=4)
    resent = client.responses.create(model="tiny", max_output_tokens=4, input=[
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And?"}])
    assert first.usage and plain.usage and second.usage and resent.usage
    assert first.usage.input_tokens > plain.usage.input_tokens + 40
    assert second.usage.input_tokens == resent.usage.input_tokens
    assert second.instructions is None


def test_stored_responses_can_be_read_and_deleted(client: openai.OpenAI,
                                                  live_server: LiveServer) -> None:
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="tiny", input="more", previous_response_id=r.id)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="Hello", max_output_tokens=4,
                                       store=False)
    assert httpx.get(f"{live_server.base_url}/responses/{unstored.id}").status_code == 404


def test_an_expired_response_cannot_be_continued(serve: Serve) -> None:
    from mlx_providers.server import ResponseStore

    now = [0.0]
    server, _ = serve(store=ResponseStore(ttl_seconds=60, clock=lambda: now[0]))
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=4)
    now[0] = 59
    client.responses.create(model="tiny", input="more", previous_response_id=r.id,
                            max_output_tokens=2)
    now[0] = 61  # reading it at 59 did not renew its age
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="more", previous_response_id=r.id)


def test_a_failure_mid_stream_sends_an_error_event_then_closes(
        serve: Serve, step_probe: StepProbe) -> None:
    server, eng = serve()
    turns = [0]

    def fail_after_four_turns(_report: TurnReport) -> None:
        turns[0] += 1
        if turns[0] == 4:
            step_probe.fail_always(RuntimeError("simulated device failure"))

    step_probe.on_turn = fail_after_four_turns
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=50,
                                          stream=True))
    assert events[-1].type == "error"
    assert events[-1].code == "server_error"  # type: ignore[union-attr]
    failed = client.responses.retrieve(events[0].response.id)  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "server_error"
    assert "response.output_text.delta" in [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    step_probe.stop_failing()
    chat = client.chat.completions.create(model="tiny", max_tokens=3, messages=[  # type: ignore[arg-type]
        {"role": "user", "content": "still there?"}])
    assert chat.usage is not None and chat.usage.completion_tokens == 3  # engine recovered
    turns[0] = 0  # fail again four turns from now
    with pytest.raises(openai.APIError):  # the chat stream's error object raises in the SDK
        for _ in client.chat.completions.create(model="tiny", max_tokens=50, stream=True,  # type: ignore[arg-type]
                                                messages=[{"role": "user", "content": "x"}]):
            pass
    assert eng.stats().failed == 2
