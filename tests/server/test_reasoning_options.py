"""Reasoning on the server's two APIs. The chat-completions options reach the engine request:
``reasoning_effort`` as a template variable (gpt-oss's template reads it),
``reasoning_budget`` as the row's budget. Through the server with the ``openai`` SDK, on the
tiny thinking model: reasoning under both keys, its token count in usage, past reasoning
(a message's ``reasoning``/``reasoning_content``, Responses ``reasoning`` items) replayed
into the template, Responses' ``reasoning`` options, and the 400s for bad values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseReasoningItem

from engine import ChatRequest, Engine, EngineConfig, RequestHandle
from engine.requests.inbound.messages import template_messages
from mlx_providers.server import create_app
from mlx_providers.server.chat_request import ChatCompletionRequest, engine_request
from tests.server.conftest import LiveServer

HI = [{"role": "user", "content": "Hi"}]


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": HI, **fields})


def test_effort_and_budget_reach_the_engine_request() -> None:
    chat = engine_request(_request(reasoning_effort="low", reasoning_budget=64),
                          default_max_tokens=32, default_temperature=0.0)
    assert chat.template_kwargs["reasoning_effort"] == "low"
    assert chat.params.reasoning_budget == 64
    plain = engine_request(_request(), default_max_tokens=32, default_temperature=0.0)
    assert "reasoning_effort" not in plain.template_kwargs
    assert plain.params.reasoning_budget is None


def test_a_template_variable_the_client_set_wins_over_the_effort() -> None:
    chat = engine_request(_request(reasoning_effort="high",
                                   chat_template_kwargs={"reasoning_effort": "low"}),
                          default_max_tokens=32, default_temperature=0.0)
    assert chat.template_kwargs["reasoning_effort"] == "low"


def test_repeat_answered_calls_reaches_the_engine_request() -> None:
    on = engine_request(_request(repeat_answered_calls=True), default_max_tokens=32,
                        default_temperature=0.0)
    plain = engine_request(_request(), default_max_tokens=32, default_temperature=0.0)
    assert (on.params.repeat_answered_calls, plain.params.repeat_answered_calls) == (
        True, False)


# ----- through the server, with the ``openai`` SDK ------------------------------------------

# The tiny thinking model's template, made to show what reaches it: it opens the reasoning
# block (as Qwen3's does), prints the effort, and renders an assistant turn's past
# reasoning (``reasoning_content``) as a think block before its text.
_PAST = ("{{- ('<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n') "
         "if message.reasoning_content else '' -}}")


def _template(template: str) -> str:
    edits = [("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"),
             ("{{- '<|im_start|>system\n' -}}",
              "{{- '<|im_start|>system\n' -}}{%- if reasoning_effort is defined -%}"
              "{{- 'Reasoning: ' + reasoning_effort + '\n' -}}{%- endif -%}"),
             ("{{- '<|im_start|>assistant' -}}", "{{- '<|im_start|>assistant\n' -}}" + _PAST),
             ("{{- '<|im_start|>' + message.role + '\n' + (message.content or '')",
              "{{- '<|im_start|>' + message.role + '\n' -}}" + _PAST
              + "{{- (message.content or '')")]
    for old, new in edits:
        assert old in template, old
        template = template.replace(old, new)
    return template


class RecordingEngine(Engine):
    """The engine, keeping every request the server submits (what the template gets)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[ChatRequest] = []

    def submit(self, request: Any, **kwargs: Any) -> RequestHandle:
        self.requests.append(request)
        return super().submit(request, **kwargs)

    def rendered(self) -> str:
        """The last request's prompt, as the chat template renders it."""
        last = self.requests[-1]
        return str(self.tokenizer.apply_chat_template(
            template_messages(last.messages), add_generation_prompt=True, tokenize=False,
            **last.template_kwargs))


@pytest.fixture(scope="module")
def thinking_engine(thinking_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                    ) -> Iterator[RecordingEngine]:
    out = tmp_path_factory.mktemp("reasoning-server") / "model"
    shutil.copytree(thinking_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = _template(config["chat_template"])
    config_path.write_text(json.dumps(config))
    eng = RecordingEngine(out, EngineConfig(max_batch=4, prefill_chunk=64)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(thinking_engine: RecordingEngine) -> Iterator[openai.OpenAI]:
    server = LiveServer(create_app({"tiny": thinking_engine})).start()
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    server.stop()


def _extra(model: Any) -> dict[str, Any]:
    return dict(model.model_extra or {})


def test_chat_reasoning_under_both_keys_and_counted(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {"model": "tiny", "messages": HI, "max_tokens": 12,
                           "extra_body": {"reasoning_budget": 4}}
    r = client.chat.completions.create(**ask, logprobs=True)
    message = _extra(r.choices[0].message)
    assert message["reasoning"] == message["reasoning_content"] != ""
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    counted = r.usage.completion_tokens_details.reasoning_tokens
    # Exactly the tokens before the block's close (the template opened it).
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    tokens = [lp.token for lp in r.choices[0].logprobs.content]
    assert counted == tokens.index("</think>") and 0 < counted <= 4
    chunks = list(client.chat.completions.create(**ask, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [_extra(c.choices[0].delta) for c in chunks if c.choices]
    thinking = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert thinking and all(d["reasoning"] == d["reasoning_content"] for d in thinking)
    assert "".join(d["reasoning"] for d in thinking) == message["reasoning"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == counted


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_chat_past_reasoning_replays_into_the_template(client: openai.OpenAI,
                                                       thinking_engine: RecordingEngine,
                                                       key: str) -> None:
    history = [*HI, {"role": "assistant", "content": "Hello.", key: "I should greet."},
               {"role": "user", "content": "Again"}]
    client.chat.completions.create(model="tiny", messages=history,  # type: ignore[arg-type]
                                   max_tokens=2)
    assistant = thinking_engine.requests[-1].messages[1]
    assert assistant.extra == {"reasoning_content": "I should greet."}
    assert ("<|im_start|>assistant\n<think>\nI should greet.\n</think>\n\nHello.<|im_end|>"
            in thinking_engine.rendered())


def test_responses_effort_budget_usage_and_reasoning_item(client: openai.OpenAI,
                                                          thinking_engine: RecordingEngine,
                                                          ) -> None:
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=12,
                                reasoning={"effort": "low", "summary": "auto"},
                                extra_body={"reasoning_budget": 3})
    assert thinking_engine.requests[-1].template_kwargs == {"reasoning_effort": "low"}
    assert thinking_engine.requests[-1].params.reasoning_budget == 3
    assert "Reasoning: low\n" in thinking_engine.rendered()
    assert r.reasoning is not None
    assert (r.reasoning.effort, r.reasoning.summary) == ("low", "auto")
    item = r.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.status == "completed"
    assert item.content is not None and item.content[0].text and item.summary == []
    assert r.usage is not None
    counted = r.usage.output_tokens_details.reasoning_tokens
    assert counted == 3  # the budget: this model never closes the block by itself
    # The same count as chat completions' for the same prompt, budget and sampling.
    chat = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12,
                                          extra_body={"reasoning_effort": "low",
                                                      "reasoning_budget": 3})
    assert chat.usage is not None and chat.usage.completion_tokens_details is not None
    assert chat.usage.completion_tokens_details.reasoning_tokens == counted
    assert _extra(chat.choices[0].message)["reasoning"] == item.content[0].text
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=12,
                                          reasoning={"effort": "low"}, stream=True,
                                          extra_body={"reasoning_budget": 3}))
    [done] = [e.item for e in events if e.type == "response.output_item.done"
              and e.item.type == "reasoning"]
    assert done == item.model_copy(update={"id": done.id})
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 3
    stored = client.responses.retrieve(r.id)
    assert stored.output[0] == item and stored.reasoning == r.reasoning
    # Without the effort nothing reaches the template; without the budget the thinking
    # runs on until max_output_tokens cuts it (every token reasoning, the item incomplete).
    plain = client.responses.create(model="tiny", input="Hi", max_output_tokens=6)
    assert plain.reasoning is not None and plain.reasoning.effort is None
    assert "reasoning_effort" not in thinking_engine.requests[-1].template_kwargs
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 6
    [cut] = plain.output
    assert isinstance(cut, ResponseReasoningItem) and cut.status == "incomplete"


def test_responses_reasoning_items_replay(client: openai.OpenAI,
                                          thinking_engine: RecordingEngine) -> None:
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=10,
                                    extra_body={"reasoning_budget": 3})
    item = first.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.content
    thought = item.content[0].text
    client.responses.create(model="tiny", previous_response_id=first.id, input="More",
                            max_output_tokens=2)
    [_, assistant, _] = [m.as_openai() for m in thinking_engine.requests[-1].messages]
    assert assistant["role"] == "assistant" and assistant["reasoning_content"] == thought
    assert f"<think>\n{thought}\n</think>" in thinking_engine.rendered()
    # The client's own history: the output items passed back as input.
    client.responses.create(model="tiny", max_output_tokens=2, input=[
        {"role": "user", "content": "Hi"}, *first.output,  # type: ignore[list-item]
        {"role": "user", "content": "More"}])
    assert thinking_engine.requests[-1].messages[1].extra == {"reasoning_content": thought}


def test_reasoning_items_replay_before_calls_and_from_summaries(
        client: openai.OpenAI, thinking_engine: RecordingEngine) -> None:
    summary = {"type": "reasoning", "id": "rs_1",
               "summary": [{"type": "summary_text", "text": "Look it up."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"}
    client.responses.create(model="tiny", max_output_tokens=2, input=[  # type: ignore[arg-type]
        {"role": "user", "content": "Hi"}, summary, call,
        {"type": "function_call_output", "call_id": "c1", "output": "red"},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "It is red."}]},
        {"role": "assistant", "content": "Red."},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "No turn follows."}]},
        {"role": "user", "content": "Thanks"}])
    messages = [m.as_openai() for m in thinking_engine.requests[-1].messages]
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "Look it up."), ("tool", None),
        ("assistant", "It is red."), ("user", None)]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat/completions", {"messages": [*HI, {"role": "assistant", "content": "x",
                                              "reasoning": 5}]}, "messages[1].reasoning"),
    ("chat/completions", {"messages": HI, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat/completions", {"messages": HI, "reasoning_budget": -1}, "reasoning_budget"),
    ("responses", {"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("responses", {"input": "Hi", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ("responses", {"input": "Hi", "reasoning_budget": "lots"}, "reasoning_budget"),
    ("responses", {"input": [{"type": "reasoning", "summary": [],
                              "content": [{"type": "text", "text": "x"}]}]},
     "input[0].content[0].type"),
])
def test_bad_reasoning_values_are_400s(client: openai.OpenAI, path: str,
                                       body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/{path}", body={"model": "tiny", **body}, cast_to=httpx.Response)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["message"].startswith(param), error
