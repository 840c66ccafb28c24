"""Responses refusals name the Responses request's own fields (``input[i].content[k]``,
``input[i].output[k]``), never the chat-completions ``messages[...]`` fields the server
converts its items to; through the ``openai`` SDK on the tiny (text-only) model."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest

from mlx_providers.server.responses_request import input_messages
from tests.server.conftest import LiveServer

PIL = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow (the vision extra)")
PICK = {"type": "function", "name": "pick", "description": "Pick a colour.",
        "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}}}


def image_uri() -> str:
    buffer = io.BytesIO()
    PIL.new("RGB", (8, 6), (200, 10, 10)).save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def text(words: str) -> dict[str, Any]:
    return {"type": "input_text", "text": words}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def refusal(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", max_output_tokens=4, **body)
    error = raised.value.body
    assert isinstance(error, dict)
    assert "messages[" not in error["message"], error  # a field the client never sent
    assert error["message"].startswith(f"{error['param']}:"), error
    return error


@pytest.mark.parametrize(("items", "param"), [
    ([{"role": "user", "content": [text("What is this?"),
                                   {"type": "input_image", "file_id": "file-1"}]}],
     "input[0].content[1]"),
    ([{"role": "user", "content": "Look."},
      {"role": "user", "content": [text("a"), text("b"),
                                   {"type": "input_image", "file_id": "file-1"}]}],
     "input[1].content[2]"),
])
def test_an_image_by_file_id_names_its_part(client: openai.OpenAI, items: list[Any],
                                            param: str) -> None:
    error = refusal(client, input=items, store=False)
    assert error["param"] == param and "file_id" in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"instructions": "Be brief.",
      "input": [{"role": "user", "content": [text("What is this?"),
                                             {"type": "input_image",
                                              "image_url": "{image}"}]}]},
     "input[0].content[1]"),
    # A refusal part is not passed on: the image is still the item's third part.
    ({"input": [{"role": "user", "content": [
        text("What is this?"), {"type": "refusal", "refusal": "no"},
        {"type": "input_image", "image_url": "{image}"}]}]},
     "input[0].content[2]"),
    ({"tools": [PICK], "input": [
        {"role": "user", "content": "Pick one."},
        {"type": "function_call", "call_id": "c1", "name": "pick", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [text("Here:"), {"type": "input_image", "image_url": "{image}"}]}]},
     "input[2].output[1]"),
])
def test_an_image_for_a_text_model_names_the_input_part(client: openai.OpenAI,
                                                        body: dict[str, Any],
                                                        param: str) -> None:
    uri = image_uri()
    for item in body["input"]:
        for part in item.get("content") or item.get("output") or ():
            if isinstance(part, dict) and part.get("image_url") == "{image}":
                part["image_url"] = uri
    error = refusal(client, **body, store=False)
    assert error["param"] == param and "takes no images" in error["message"]


def test_a_continuation_names_its_own_input(client: openai.OpenAI) -> None:
    """After ``previous_response_id``, ``input[0]`` is the new input's first item, not
    the stored history's."""
    first = client.responses.create(model="tiny", input="Hello.", max_output_tokens=4)
    error = refusal(client, previous_response_id=first.id, store=False, input=[
        {"role": "user", "content": [text("And this?"),
                                     {"type": "input_image", "image_url": image_uri()}]}])
    assert error["param"] == "input[0].content[1]"


def test_the_rulebook_fields_map_back_to_items() -> None:
    """Each chat-message field, as the Responses request spells it."""
    _, fields = input_messages([
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ], "Be brief.", history=1)
    assert fields.responses_field("messages[0].content") == "instructions"
    assert fields.responses_field("messages[1].role") == "previous_response_id"
    assert fields.responses_field("messages[2].tool_calls[1].function.arguments") == (
        "input[1].arguments")
    assert fields.responses_field("messages[3].tool_call_id") == "input[2].call_id"
    assert fields.responses_field("messages[3].content") == "input[2].output"
    assert fields.responses_field("tools[0].name") == "tools[0].name"
    assert fields.responses_field("messages") == "input"
