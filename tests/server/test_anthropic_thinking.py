"""Extended thinking on the Messages door, through the real ``anthropic`` SDK, on the tiny
thinking model with a template that opens the reasoning block when ``enable_thinking`` is
on (as Qwen3's) and renders a turn's past reasoning: ``thinking.budget_tokens`` is the
engine's reasoning budget and the reasoning comes back as a ``thinking`` block (streamed
as ``thinking_delta``s), equal to the engine's own; ``disabled`` turns the template's
thinking off; thinking blocks in the history are replayed as the turn's reasoning."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from engine import ChatRequest, Engine, EngineConfig, RequestHandle, SamplingParams
from engine.requests.inbound.messages import template_messages
from mlx_providers.server import create_app
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(180)
HI: Any = [{"role": "user", "content": "Hi"}]


def _template(template: str) -> str:
    """The tiny thinking model's template, opening the block unless thinking is off and
    rendering an assistant turn's ``reasoning_content`` as a think block."""
    edits = [("{{- '<|im_start|>assistant\n' -}}{%- endif -%}",
              "{{- '<|im_start|>assistant\n' -}}{%- if enable_thinking is not defined or "
              "enable_thinking -%}{{- '<think>\n' -}}{%- endif -%}{%- endif -%}"),
             ("{{- '<|im_start|>' + message.role + '\n' + (message.content or '')",
              "{{- '<|im_start|>' + message.role + '\n' -}}{{- ('<think>\n' + "
              "message.reasoning_content + '\n</think>\n\n') if message.reasoning_content "
              "else '' -}}{{- (message.content or '')")]
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
        last = self.requests[-1]
        return str(self.tokenizer.apply_chat_template(
            template_messages(last.messages), add_generation_prompt=True, tokenize=False,
            **last.template_kwargs))


@pytest.fixture(scope="module")
def thinking_engine(thinking_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                    ) -> Iterator[RecordingEngine]:
    out = tmp_path_factory.mktemp("anthropic-thinking") / "model"
    shutil.copytree(thinking_model_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = _template(config["chat_template"])
    config_path.write_text(json.dumps(config))
    eng = RecordingEngine(out, EngineConfig(max_batch=4, prefill_chunk=64)).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(thinking_engine: RecordingEngine) -> Iterator[anthropic.Anthropic]:
    server = LiveServer(create_app({"tiny": thinking_engine})).start()
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                             timeout=60) as sdk:
        yield sdk
    server.stop()


THINK = {"type": "enabled", "budget_tokens": 4}


def test_thinking_is_a_thinking_block_equal_to_the_engine_s_reasoning(
        client: anthropic.Anthropic, thinking_engine: RecordingEngine) -> None:
    message = client.messages.create(model="tiny", max_tokens=14, messages=HI,
                                     thinking=THINK)  # type: ignore[arg-type]
    assert thinking_engine.requests[-1].params.reasoning_budget == 4
    assert thinking_engine.requests[-1].template_kwargs == {"enable_thinking": True}
    own = thinking_engine.submit(ChatRequest.from_openai(
        HI, SamplingParams(max_tokens=14, reasoning_budget=4),
        chat_template_kwargs={"enable_thinking": True})).result(timeout=60)
    assert own.reasoning
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == own.reasoning
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == own.content
    assert [b.type for b in message.content] == ["thinking", *(["text"] if text else [])]
    details = message.usage.output_tokens_details
    assert details is not None and details.thinking_tokens == own.usage.reasoning_tokens
    assert 0 < details.thinking_tokens <= 4


def test_a_streamed_thinking_block_arrives_as_thinking_deltas(
        client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=14, messages=HI, thinking=THINK)  # type: ignore[arg-type]
    events = list(client.messages.create(model="tiny", max_tokens=14, messages=HI,  # type: ignore[arg-type]
                                         thinking=THINK, stream=True))
    first = next(e for e in events if e.type == "content_block_start")
    assert first.content_block.type == "thinking" and first.index == 0  # type: ignore[union-attr]
    thoughts = [e.delta.thinking for e in events  # type: ignore[union-attr]
                if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]  # type: ignore[union-attr]
    assert "".join(thoughts) == whole.content[0].thinking  # type: ignore[union-attr]
    with client.messages.stream(model="tiny", max_tokens=14, messages=HI,  # type: ignore[arg-type]
                                thinking=THINK) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
            for b in final.content] == [
        (b.type, getattr(b, "thinking", None), getattr(b, "text", None))
        for b in whole.content]


def test_disabled_thinking_turns_the_template_s_thinking_off(
        client: anthropic.Anthropic, thinking_engine: RecordingEngine) -> None:
    client.messages.create(model="tiny", max_tokens=4, messages=HI,  # type: ignore[arg-type]
                           thinking={"type": "disabled"})
    assert thinking_engine.requests[-1].template_kwargs == {"enable_thinking": False}
    assert not thinking_engine.rendered().endswith("<think>\n")
    client.messages.create(model="tiny", max_tokens=4, messages=HI)  # type: ignore[arg-type]
    assert thinking_engine.rendered().endswith("<think>\n")  # the template's default


def test_thinking_blocks_in_the_history_are_replayed_as_reasoning(
        client: anthropic.Anthropic, thinking_engine: RecordingEngine) -> None:
    first = client.messages.create(model="tiny", max_tokens=14, messages=HI, thinking=THINK)  # type: ignore[arg-type]
    thought = first.content[0].thinking  # type: ignore[union-attr]
    history: Any = [*HI, first.to_param(), {"role": "user", "content": "And then?"}]
    client.messages.create(model="tiny", max_tokens=4, messages=history, thinking=THINK)
    assert f"<think>\n{thought}\n</think>" in thinking_engine.rendered()
    assert thinking_engine.requests[-1].messages[1].extra["reasoning_content"] == thought
