"""A call block of JSON ends at its close marker outside the JSON's strings.

The reply behind issue 37's "escape": the default model, with tools beside a schema,
wrote a call whose ``city`` string held ``}}</tool_call>You can use the `` and then a second
call. The grammar admits that (any text but an answered one), so the reader must read it
as the grammar does: one call with that city, not a call cut at the marker and prose after.
"""

from __future__ import annotations

from engine.requests.dialects.dialect import Dialect, TokenizerFacts
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.channels import CONTENT, TOOL, ChannelSplitter
from engine.requests.outbound.row_channels import RowChannels

WEATHER = normalize_tools([{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}])
CITY = "Paris, France, 21 C: 23.2C}}</tool_call>You can use the "
ESCAPED = (f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{CITY}"}}}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris')


def read(text: str, pieces: int) -> RowChannels:
    """``text`` through the default dialect's splitter, in ``pieces`` chunks, then ended."""
    dialect = Dialect(TokenizerFacts())
    channels = RowChannels(dialect.splitter(CONTENT, WEATHER), dialect.parser, WEATHER)
    step = max(1, len(text) // pieces)
    for start in range(0, len(text), step):
        channels.feed(text[start:start + step])
    channels.finish()
    return channels


def test_a_close_marker_inside_an_argument_string_is_string_text() -> None:
    for pieces in (1, 7, len(ESCAPED)):  # whole, in chunks, a character at a time
        channels = read(ESCAPED, pieces)
        assert [call.arguments for call in channels.calls] == [{"city": CITY}]
        assert channels.content == ""
        assert len(channels.invalid) == 1  # the second call, cut by the end of the row
        assert channels.invalid[0].error == "the tool call was not closed"


def test_escaped_quotes_keep_the_string_open_and_the_marker_outside_closes() -> None:
    splitter = ChannelSplitter({TOOL: ("<tool_call>", "</tool_call>")}, CONTENT,
                               frozenset({TOOL}))
    text = '<tool_call>{"a": "x\\"</tool_call>"}</tool_call>after'
    pieces = [p for chunk in text for p in splitter.feed(chunk)] + splitter.flush()
    tool = "".join(t for channel, t in pieces if channel == TOOL)
    assert tool == '{"a": "x\\"</tool_call>"}'
    assert "".join(t for channel, t in pieces if channel == CONTENT) == "after"


def test_a_channel_not_declared_json_still_closes_at_the_first_marker() -> None:
    splitter = ChannelSplitter({TOOL: ("<tool_call>", "</tool_call>")}, CONTENT)
    pieces = splitter.feed('<tool_call>{"a": "</tool_call>"}') + splitter.flush()
    assert "".join(t for channel, t in pieces if channel == TOOL) == '{"a": "'
