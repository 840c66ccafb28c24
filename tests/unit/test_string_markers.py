"""The call-marker guard inside argument strings, on a hand-made vocabulary."""

from __future__ import annotations

from engine.requests.constraints.string_markers import MarkerIndex, StringMarkers

VOCAB = [b"<tool_call>", b"\n", b'{"', b"city", b'": "', b"Paris", b"}}", b"</",
         b"tool_call>", b"</tool_call>", b'"}', b"call", b'"}\n</tool_call>', b"\\",
         b'"', b" fine", b"<", b"/tool_call>", b"[", b"]"]
(OPEN, NL, OBJ, CITY, COLON, PARIS, BRACES, SLASH, REST, CLOSE, END, CALL, END_AND_CLOSE,
 BACKSLASH, QUOTE, FINE, LT, SLASH_REST, LIST, END_LIST) = range(len(VOCAB))
MARKERS = ("<tool_call>", "</tool_call>")


def fed(tokens: list[int], opener: bytes = b"<tool_call>") -> StringMarkers:
    guard = StringMarkers(VOCAB, MarkerIndex.of(VOCAB, MARKERS), opener)
    for token in tokens:
        guard.advance(token)
    return guard


IN_CITY = [OPEN, NL, OBJ, CITY, COLON, PARIS]


def test_a_whole_marker_inside_a_string_is_refused_but_closing_the_string_first_is_not() -> None:
    refused = fed(IN_CITY).refused()
    assert CLOSE in refused and OPEN in refused
    assert END_AND_CLOSE not in refused  # the string and the call close before the marker
    assert END not in refused and FINE not in refused


def test_a_marker_split_across_tokens_is_refused_where_it_would_complete() -> None:
    assert REST in fed([*IN_CITY, BRACES, SLASH]).refused()
    assert SLASH_REST in fed([*IN_CITY, LT]).refused()
    assert REST not in fed([*IN_CITY, BRACES]).refused()  # "</" is not there yet


def test_nothing_is_refused_outside_a_calls_strings() -> None:
    assert fed([OPEN, NL, OBJ, CITY, COLON, PARIS, END]).refused() == []  # string closed
    assert fed([OPEN, NL, OBJ, CITY, COLON, PARIS, END, NL]).refused() == []
    # Before the opener, quotes are prose: no string is open.
    assert fed([QUOTE, PARIS]).refused() == []
    # After the call's JSON closes, the next string waits for the next opener.
    after = fed([*IN_CITY, END, NL, QUOTE, PARIS])
    assert not after.in_string and after.refused() == []


def test_an_escaped_quote_keeps_the_string_open() -> None:
    guard = fed([*IN_CITY, BACKSLASH, QUOTE, SLASH])
    assert guard.in_string and REST in guard.refused()


def test_json_throughout_needs_no_opener_and_lists_count() -> None:
    guard = fed([LIST, OBJ, CITY, COLON, PARIS], opener=b"")
    assert CLOSE in guard.refused()
    assert fed([LIST, OBJ, CITY, COLON, PARIS, END, END_LIST, QUOTE], opener=b"").refused() == []


def test_a_copy_is_independent() -> None:
    guard = fed(IN_CITY)
    twin = guard.copy()
    twin.advance(END)
    assert guard.in_string and not twin.in_string
