"""Tool calls without a model: the forced-call grammar and the channel splitter (no mlx)."""

from __future__ import annotations

from engine.requests.constraints.forced_calls import forced_call_grammar
from engine.requests.inbound.tool_specs import normalize_tools
from engine.requests.outbound.channels import ChannelSplitter
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.tool_calls import ToolCallDelta

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"]}}}


def test_forced_grammar_closes_argument_objects() -> None:
    grammar = forced_call_grammar(normalize_tools([WEATHER]), "required", False)
    assert '"additionalProperties": false' in grammar.grammar


def test_channel_splitter_handles_markers_split_across_tokens() -> None:
    channels = RowChannels(ChannelSplitter({"reasoning": ("<think>", "</think>"),
                                            "tool": ("<tool_call>", "</tool_call>")}), None, ())
    pieces = ["<thi", "nk>hmm</th", "ink>Hi <tool", '_call>{"name": "a", "arguments": {}}',
              '</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call> bye',
              " <tool_call>{bad"]
    deltas = [channels.feed(p) for p in pieces] + [channels.finish()]
    assert "".join(d[0] for d in deltas) == "Hi  bye "
    assert "".join(d[1] for d in deltas) == "hmm"
    assert [(c.name, c.arguments) for c in channels.calls] == [("a", {}), ("b", {"x": 1})]
    assert len(channels.invalid) == 1 and channels.invalid[0].raw == "{bad"


MARKERS = {"tool": ("<tool_call>", "</tool_call>")}


def stream(pieces: list[str], parallel: bool = True,
           parser: object = None) -> tuple[RowChannels, list[list[ToolCallDelta]]]:
    """Feed ``pieces`` one by one; the deltas each piece released, then the finish's."""
    channels = RowChannels(ChannelSplitter(MARKERS), parser, (), parallel)  # type: ignore[arg-type]
    released = []
    for piece in pieces:
        channels.feed(piece)
        released.append(list(channels.take_deltas()))
    channels.finish()
    released.append(list(channels.take_deltas()))
    return channels, released


def by_char(text: str) -> list[str]:
    return list(text)


def sent(released: list[list[ToolCallDelta]]) -> dict[int, tuple[str | None, str | None, str]]:
    """(id, name, arguments) per index, accumulated as an OpenAI client does."""
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for delta in (d for step in released for d in step):
        cid, name, args = calls.get(delta.index, (None, None, ""))
        calls[delta.index] = (cid or delta.id, name or delta.name, args + delta.arguments)
    return calls


def test_a_call_streams_its_name_first_then_its_arguments_as_written() -> None:
    args = '{"city":  "Paris", "days": [1, 2], "note": "a \\"}\\" b"}'
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    channels, released = stream(by_char(text))
    deltas = [d for step in released for d in step]
    first = deltas[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    # The name went out the character its string closed, before any argument text.
    at = next(i for i, step in enumerate(released) if step)
    assert text[:at + 1].endswith('"get_weather"')
    assert all(d.id is None and d.name is None and d.arguments for d in deltas[1:])
    assert len(deltas) > 10  # fragments, not one piece
    (call,) = channels.calls
    assert call.arguments == {"city": "Paris", "days": [1, 2], "note": 'a "}" b'}
    assert call.arguments_text == args  # the model's own text, exactly what streamed
    assert sent(released) == {0: (call.id, "get_weather", args)}
    # Fragments never run ahead of the text: each was sent the piece its text arrived.
    assert "".join(d.arguments for d in deltas[1:]) == args


def test_a_list_of_calls_streams_each_and_a_repeat_is_held_and_never_sent() -> None:
    a = '{"name": "a", "arguments": {"x": 1, "y": "hi"}}'
    near = '{"name": "a", "arguments": {"x": 1, "y": "ho"}}'  # a near-repeat of a
    b = '{"name": "b", "arguments": {}}'
    text = f"<tool_call>[\n{a},\n{a},\n{near},\n{b}\n]</tool_call>"
    channels, released = stream(by_char(text))
    assert [(c.name, c.arguments) for c in channels.calls] == [
        ("a", {"x": 1, "y": "hi"}), ("a", {"x": 1, "y": "ho"}), ("b", {})]
    assert channels.repeated_calls == 1 and channels.invalid == []
    assert sent(released) == {i: (c.id, c.name, c.arguments_text)
                              for i, c in enumerate(channels.calls)}
    # The near-repeat was held while it matched a: all of it went out, in order, in the
    # piece where it diverged ("h" -> "o"), never before.
    start = text.index(near)
    at = next(i for i, step in enumerate(released) if any(d.index == 1 for d in step))
    assert at == start + near.index('"ho"') + 2
    flushed = released[at]
    assert flushed[0].name == "a" and flushed[0].arguments == ""
    assert "".join(d.arguments for d in flushed) == '{"x": 1, "y": "ho'


def test_a_repeat_in_its_own_block_is_held_whole_and_counted_at_its_close() -> None:
    a = '{"name": "a", "arguments": {"x": 1}}'
    spaced = '{"name": "a", "arguments": {"x":1}}'  # the same call, other spacing
    pieces = ["<tool_call>", *by_char(a), "</tool_call>\n<tool_call>", *by_char(spaced),
              "</tool_call>"]
    channels, released = stream(pieces)
    assert len(channels.calls) == 1 and channels.repeated_calls == 1
    assert sent(released) == {0: (channels.calls[0].id, "a", '{"x": 1}')}
    assert all(d.index == 0 for step in released for d in step)


def test_with_parallel_calls_off_only_the_first_call_is_ever_sent() -> None:
    a = '{"name": "a", "arguments": {"x": 1}}'
    b = '{"name": "b", "arguments": {"y": 2}}'
    channels, released = stream(by_char(f"<tool_call>[{a}, {b}]</tool_call>"
                                         f"<tool_call>{b}</tool_call>"), parallel=False)
    assert [c.name for c in channels.calls] == ["a"] and channels.extra_calls == 2
    assert sent(released) == {0: (channels.calls[0].id, "a", '{"x": 1}')}


def test_a_cut_call_keeps_what_was_sent_and_is_invalid_under_its_index() -> None:
    a = '{"name": "a", "arguments": {}}'
    channels, released = stream(["<tool_call>" + a + "</tool_call>\n<tool_call>",
                                 '{"name": "b", "argu', 'ments": {"q": "abc', "de"])
    (kept,) = channels.calls
    (cut,) = channels.invalid
    assert (cut.name, cut.index, cut.raw) == ("b", 1, '{"name": "b", "arguments": {"q": "abcde')
    calls = sent(released)
    assert calls[0] == (kept.id, "a", "{}")
    assert calls[1] == (cut.id, "b", '{"q": "abcde')  # a prefix of what was generated


def test_malformed_and_parser_calls_are_parsed_whole_at_the_close() -> None:
    # Not JSON from its first character: never sent, invalid at the close, as before.
    channels, released = stream(["<tool_call>{bad", "</tool_call>"])
    assert sent(released) == {} and channels.invalid[0].raw == "{bad"
    assert channels.invalid[0].index is None
    # Sent, then malformed at its close: OpenAI streams what it generated; the call is
    # invalid, under the index it went out with.
    channels, released = stream(by_char('<tool_call>{"name": "a", "arguments": {"x": oops}}'
                                        "</tool_call>"))
    assert channels.calls == [] and channels.invalid[0].index == 0
    assert sent(released)[0][1:] == ("a", '{"x": oops}')
    # A model parser's format is read whole when its block closes: one delta per call.

    def parser(text: str, tools: object) -> dict[str, object]:
        name, _, value = text.partition("=")
        return {"name": name, "arguments": {"v": value}}

    channels, released = stream(["<tool_call>f=", "1", "</tool_call>"], parser=parser)
    assert [len(step) for step in released] == [0, 0, 1, 0]
    assert released[2][0] == ToolCallDelta(0, channels.calls[0].id, "f", '{"v": "1"}')
