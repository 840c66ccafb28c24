"""Known model-family tool formats: detection, rendering, list parsing (no model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.requests.dialects.dialect import Dialect
from engine.requests.inbound.prompts import PromptRenderer
from engine.requests.inbound.tool_prompts import (
    SMOLLM2,
    TOOL_CALL_END,
    TOOL_CALL_START,
    detect_tool_format,
    has_tool_history,
    with_plain_tool_history,
)
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.channels import TOOL, ChannelSplitter
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.tool_calls import split_call_list

WEATHER = ToolSpec("get_weather", "Get the weather.",
                   {"type": "object", "properties": {"location": {"type": "string"}},
                    "required": ["location"]})
SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != "
                 "'system' %}You are a helpful AI assistant named SmolLM, trained by "
                 "Hugging Face{% endif %}{{ message['content'] }}{% endfor %}")


def test_detects_smollm2_from_its_default_system_prompt() -> None:
    formats = Dialect.tool_formats  # the default dialect declares SmolLM2's
    assert detect_tool_format(SMOL_TEMPLATE, formats) is SMOLLM2
    assert detect_tool_format("{{ messages }}", formats) is None
    assert detect_tool_format(None, formats) is None
    assert detect_tool_format(SMOL_TEMPLATE, ()) is None  # only declared formats are known


def test_system_prompt_is_the_trained_one_and_user_system_is_kept() -> None:
    messages = SMOLLM2.rewrite([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "weather?"}], [WEATHER])
    system = messages[0]["content"]
    assert messages[0]["role"] == "system"
    assert system.startswith("You are an expert in composing functions.")
    assert f"<tools>{json.dumps([WEATHER.as_openai()])}</tools>" in system
    assert system.endswith("Be brief.")
    assert messages[1] == {"role": "user", "content": "weather?"}
    assert len(messages) == 2


def test_history_calls_and_results_become_plain_text() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location": "SF"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"location": "LA"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    out = SMOLLM2.rewrite(history, [WEATHER])
    assert out[2] == {"role": "assistant", "content": (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"location": "SF"}},\n'
        '{"name": "get_weather", "arguments": {"location": "LA"}}\n]</tool_call>')}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_split_call_list() -> None:
    assert split_call_list('[{"name": "a", "arguments": {}}]') is None  # one call: as is
    assert split_call_list('{"name": "a", "arguments": {}}') is None
    assert split_call_list("not json") is None
    assert split_call_list("[]") == []
    two = split_call_list('[\n{"name": "a", "arguments": {}},\n{"name": "b", "arguments": {}}\n]')
    assert two is not None and [json.loads(b)["name"] for b in two] == ["a", "b"]


def _row() -> RowChannels:
    splitter = ChannelSplitter({TOOL: (TOOL_CALL_START, TOOL_CALL_END)})
    return RowChannels(splitter, None, (WEATHER,))


def test_a_list_of_calls_in_one_block_is_one_call_per_element() -> None:
    row = _row()
    row.feed('<tool_call>[\n{"name": "get_weather", "arguments": {"location": "SF"}},\n'
             '{"name": "get_weather", "arguments": {"location": "LA"}}\n]</tool_call>')
    row.finish()
    assert [c.arguments["location"] for c in row.calls] == ["SF", "LA"]
    assert not row.invalid


def test_a_one_element_list_and_an_empty_list() -> None:
    row = _row()
    row.feed('<tool_call>[{"name": "get_weather", "arguments": {"location": "SF"}}]</tool_call>')
    row.finish()
    assert len(row.calls) == 1 and not row.invalid
    empty = _row()
    empty.feed("<tool_call>[]</tool_call>")
    empty.finish()
    assert not empty.calls and not empty.invalid


class FakeTokenizer:
    """Enough of mlx-lm's TokenizerWrapper for PromptRenderer.encode_request."""

    has_thinking = False
    has_tool_calling = False

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.rendered: list[list[dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.rendered.append(messages)
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_encode_request_uses_the_family_format_when_the_template_renders_no_tools() -> None:
    tok = FakeTokenizer(SMOL_TEMPLATE)
    renderer = PromptRenderer(tok, Path("."), 200_000, Dialect.tool_formats)
    encoded = renderer.encode_request([{"role": "user", "content": "weather?"}], [WEATHER], {})
    text = "".join(chr(i) for i in encoded.ids)
    assert "You are an expert in composing functions." in text
    assert "get_weather" in text


def test_encode_request_keeps_the_generic_fallback_for_unknown_families() -> None:
    tok = FakeTokenizer("{{ messages }}")
    renderer = PromptRenderer(tok, Path("."), 200_000, Dialect.tool_formats)
    encoded = renderer.encode_request([{"role": "user", "content": "weather?"}], [WEATHER], {})
    text = "".join(chr(i) for i in encoded.ids)
    assert "composing functions" not in text
    assert "You have access to the following tools:" in text


def test_a_template_that_drops_tool_results_gets_them_as_plain_text() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris and Oslo?"},
               {"role": "assistant", "content": "Checking.",
                "tool_calls": [call, {**call, "id": "c2"}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    out = with_plain_tool_history(history)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    line = f'{TOOL_CALL_START}{{"name": "get_weather", "arguments": {{"location": "Paris"}}}}'
    assert out[1]["content"] == f"Checking.\n{line}{TOOL_CALL_END}\n{line}{TOOL_CALL_END}"
    assert "tool_calls" not in out[1]
    assert out[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                "<tool_response>\nrain\n</tool_response>"}
    assert has_tool_history(history) and not has_tool_history(history[:1])


class _TextOnlyTemplate:
    """A tokenizer whose template, like Phi-3.5's, renders only user/assistant text."""

    chat_template = "text only"
    has_thinking = False

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages
                       if m["role"] in ("system", "user", "assistant"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]


def test_the_renderer_rewrites_the_history_only_where_results_are_dropped() -> None:
    renderer = PromptRenderer(_TextOnlyTemplate(), Path("."), 1 << 20)
    assert not renderer.template_renders_tool_results()
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"location": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "22 degrees"}]
    ids = renderer.encode_request(history, [WEATHER], {}).ids
    text = "".join(chr(i) for i in ids)
    assert "22 degrees" in text and '"location": "Oslo"' in text


class _XmlToolsTemplate(FakeTokenizer):
    """A template that lists tools only from ``xml_tools``, as SmolLM3's published one does
    (its "### Tools" section), ignoring ``tools``."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        listed = "".join(json.dumps(t) for t in kwargs.get("xml_tools") or [])
        return f"system: ### Tools <tools>{listed}</tools>\n" + super().apply_chat_template(
            messages)


def test_tools_go_to_xml_tools_when_the_template_reads_only_those() -> None:
    renderer = PromptRenderer(_XmlToolsTemplate("xml_tools"), Path("."), 200_000)
    assert not renderer.template_renders_tools() and renderer.template_renders_tools("xml_tools")
    encoded = renderer.encode_request([{"role": "user", "content": "weather?"}], [WEATHER], {})
    text = "".join(chr(i) for i in encoded.ids)
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert "You have access to the following tools" not in text  # no second listing
