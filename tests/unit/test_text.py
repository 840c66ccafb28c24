"""Per-row text: stop strings across token boundaries, held back, never streamed."""

from __future__ import annotations

from engine.requests.outbound.text import RowText


class PiecesDetokenizer:
    """Each token id indexes a fixed text piece (lets tests split text anywhere)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self._pending = ""

    def add_token(self, token: int) -> None:
        self._pending += self.pieces[token]

    def finalize(self) -> None:
        pass

    @property
    def last_segment(self) -> str:
        out, self._pending = self._pending, ""
        return out


def stream(pieces: list[str], stop: tuple[str, ...]) -> tuple[list[str], RowText]:
    row = RowText(PiecesDetokenizer(pieces), stop)
    deltas = [row.add_token(i) for i in range(len(pieces)) if not row.stopped]
    return deltas, row


def test_stop_string_split_across_tokens_is_never_streamed() -> None:
    deltas, row = stream(["Hello wo", "rld, ST", "O", "P and more"], ("STOP",))
    assert row.stopped
    assert "".join(deltas) == "Hello world, "
    assert row.text == "Hello world, "
    assert not any("S" in d for d in deltas)


def test_partial_match_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    deltas, row = stream(["a S", "T", "x"], ("STOP",))
    assert deltas == ["a ", "", "STx"]
    assert not row.stopped


def test_held_text_is_released_when_the_row_ends_for_another_reason() -> None:
    deltas, row = stream(["abc", "ST"], ("STOP",))
    assert deltas == ["abc", ""]
    assert row.finish() == "ST"
    assert row.text == "abcST"


def test_earliest_of_several_stops_wins() -> None:
    _, row = stream(["one two\n\nthree END"], ("END", "\n\n"))
    assert row.stopped and row.text == "one two"
