"""Tool calls without a model: the forced-call grammar and the channel splitter (no mlx)."""

from __future__ import annotations

from engine.requests.channels import ChannelSplitter, RowChannels
from engine.requests.tools import forced_call_grammar, normalize_tools

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


def test_calls_become_deltas_only_once_kept() -> None:
    """A call is released the piece its closing marker arrives in, never before; repeats,
    extra calls (parallel off), malformed and cut calls are never released."""
    markers = {"tool": ("<tool_call>", "</tool_call>")}
    a = '{"name": "a", "arguments": {"x": 1}}'
    b = '{"name": "b", "arguments": {}}'
    for parallel, kept in ((True, ["a", "b"]), (False, ["a"])):
        channels = RowChannels(ChannelSplitter(markers), None, (), parallel)
        released: list[list[str | None]] = []
        for piece in ["<tool_call>", a[:20], a[20:], "</tool", "_call>\n<tool_call>" + a,
                      "</tool_call><tool_call>" + b + "</tool_call>", "<tool_call>{bad",
                      "</tool_call><tool_call>" + b[:10]]:
            channels.feed(piece)
            released.append([d.name for d in channels.take_deltas()])
        channels.finish()
        assert channels.take_deltas() == ()
        assert released == [[], [], [], [], ["a"], kept[1:], [], []]
        assert [c.name for c in channels.calls] == kept
        assert channels.repeated_calls == 1 and len(channels.invalid) == 2  # {bad, and cut b
