"""One row's output sorted into content, reasoning and tool calls as it streams, with the
hold-back policy that keeps a call the engine may still drop from ever being sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.outbound.call_scanner import CallElement, CallScanner, compact_json, reads_json
from engine.requests.outbound.channels import REASONING, TOOL, Splitter
from engine.requests.outbound.tool_calls import (
    InvalidToolCall,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    call_deltas,
    call_key,
    new_call_id,
    parse_call,
    split_call_list,
)


class RowChannels:
    """One row's text sorted into content, reasoning and tool calls as it streams.

    Whitespace around calls is not an answer: whitespace-only content before the first
    call, between calls and after the last one is held back and dropped (released if text
    follows). The line breaks a template writes after the reasoning block (Qwen's and
    DeepSeek-R1's ``</think>\n\n``) are layout, not answer: content starts with the answer.

    Tool calls stream (``take_deltas``). Without a model tool parser, or with mlx-lm's
    ``json_tools`` one (``reads_json``), a call is JSON, ``{"name": ..., "arguments": {...}}``
    in ``<tool_call>`` markers, alone or as a JSON list of such objects in one block
    (SmolLM2's format): ``CallScanner`` reads it as it arrives,
    so a call's first delta (index, id, name) goes out once its name string is whole and
    its arguments object follows in fragments as the model writes them; the call keeps the
    model's own arguments text (``ToolCall.text``), so the fragments add up to exactly its
    ``arguments_text``. A call is decided when its object closes: it parsed, or it is
    invalid; a call identical to one the row already kept (same name, same arguments as
    parsed JSON) is not kept (``repeated_calls``, which ``engine.core.update`` reads, at the
    block's close, to end the row); with parallel calls off, calls after the first are not
    kept (``extra_calls``).

    What could still be dropped is held back, never sent: a call whose name is that of a
    kept call while its arguments so far (whitespace outside strings aside) are a prefix of
    that call's arguments text is sent, all of it in order, the moment it diverges, or at
    its close unless it is a repeat; with parallel calls off nothing after the first call is
    sent. A call already sent stays sent (OpenAI streams what it generated): one that is
    malformed at its close, or cut by the row's end (max_tokens, a stop, EOS), is listed in
    ``invalid`` with the index its pieces went out under. Text that is not such JSON, and
    every call read by another model parser (the XML, pythonic and other formats mlx-lm's
    parsers own), is parsed whole at the block's close and streams then, as one delta.
    """

    def __init__(self, splitter: Splitter, parser: ToolParser | None,
                 tools: tuple[ToolSpec, ...], parallel: bool = True, *,
                 new_id: Callable[[], str] = new_call_id) -> None:
        """``new_id`` makes call ids as the model's chat template accepts them."""
        self._splitter = splitter
        self._new_id = new_id
        self._parser = parser
        self._tools = tools
        self._parallel = parallel  # False: only the first call is kept (parallel_tool_calls)
        self.content = ""
        self.reasoning = ""
        self.saw_reasoning = splitter.channel == REASONING
        self.saw_call = False  # call markup was seen (a call parsed, invalid or left open)
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []
        self.repeated_calls = 0  # calls dropped because the row had made them already
        self.extra_calls = 0  # calls dropped after the first when parallel calls are off
        self._call_text: str | None = None
        self._scan: CallScanner | None = None  # the open block's calls, read as they arrive
        self._repeats = 0  # repeats in the open block, counted when it closes
        self._keys: set[str] = set()
        self._loose = True  # no answer text yet since the start or the last call
        self._spaces = ""  # whitespace content held back while loose
        # Line breaks right after reasoning are dropped (a block the prompt opened counts,
        # even when the model closes it at once).
        self._after_reasoning = self.saw_reasoning
        self._deltas: list[ToolCallDelta] = []  # call pieces not yet taken by an event
        self._next_index = 0  # calls sent so far (each delta's index)

    @property
    def in_reasoning(self) -> bool:
        """Whether the next text belongs to the reasoning block."""
        return self._splitter.channel == REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """New text -> (content delta, reasoning delta); tool markup is collected apart."""
        return self._route(self._splitter.feed(text) if text else [])

    def finish(self) -> tuple[str, str]:
        """Flush held text; a call left open (cut by max_tokens) is reported invalid."""
        content, reasoning = self._route(self._splitter.flush())
        if self._call_text is not None:
            raw, scan = self._call_text, self._scan
            self._call_text = self._scan = None
            closed = scan.closed if scan is not None else 0
            element = scan.element if scan is not None else None
            if element is not None and (closed or element.index is not None):
                self.invalid.append(InvalidToolCall(element.id, element.name,
                                                    raw[element.start:] if closed else raw,
                                                    "the tool call was not closed",
                                                    element.index))
            elif not closed:
                self.invalid.append(InvalidToolCall(self._new_id(), None, raw,
                                                    "the tool call was not closed"))
            self.repeated_calls += self._repeats
            self._repeats = 0
        spaces, self._spaces = self._spaces, ""
        if spaces and not self.saw_call:  # a plain answer keeps its whitespace as written
            self.content += spaces
            content += spaces
        return content, reasoning

    def _route(self, pieces: list[tuple[str, str]]) -> tuple[str, str]:
        content = reasoning = ""
        for channel, text in pieces:
            if channel == TOOL:
                if self._call_text is None:  # a call opens: the whitespace before it goes
                    self._call_text, self._spaces, self.saw_call = "", "", True
                    self._scan = CallScanner(self._new_id) if reads_json(self._parser) else None
                self._call_text += text
                if self._scan is not None and text:
                    self._scan.feed(text)
                    self._advance(self._scan)
                continue
            self._close_call()
            if channel == REASONING:
                reasoning += text
                self.saw_reasoning = self._after_reasoning = True
            else:
                content += self._answer_text(text)
        self.content += content
        self.reasoning += reasoning
        return content, reasoning

    def _answer_text(self, text: str) -> str:
        """Content to emit now; whitespace after the start or a call waits for text, line
        breaks right after the reasoning block are dropped."""
        if self._after_reasoning:
            text = text.lstrip("\r\n")
            if not text:
                return ""
            self._after_reasoning = False
        if not self._loose:
            return text
        if not text.strip():
            self._spaces += text
            return ""
        out, self._spaces, self._loose = self._spaces + text, "", False
        return out

    # ----- calls read as they stream ----------------------------------------------------

    def _advance(self, scan: CallScanner) -> None:
        """Decide the calls whose objects closed; send what the open one may send."""
        for element, text in scan.take_closed():
            self._close_element(element, text)
        if scan.element is not None and not scan.failed:
            self._send(scan.element)

    def _may_send(self, element: CallElement) -> bool:
        """False while the call could still be dropped: an extra call with parallel calls
        off, or one that may yet repeat a kept call (its arguments so far a prefix)."""
        if not self._parallel and (self.calls or self._next_index):
            return False
        same = [call for call in self.calls if call.name == element.name]
        if not same:
            return True
        so_far = compact_json(element.args)
        return not any(compact_json(call.arguments_text).startswith(so_far) for call in same)

    def _send(self, element: CallElement) -> None:
        if element.name is None:
            return
        if element.index is None:
            if not self._may_send(element):
                return
            self._open_delta(element, element.name)
        self._send_arguments(element, element.args)

    def _open_delta(self, element: CallElement, name: str) -> None:
        element.index, self._next_index = self._next_index, self._next_index + 1
        self._deltas.append(ToolCallDelta(element.index, element.id, name, ""))

    def _send_arguments(self, element: CallElement, text: str) -> None:
        fresh = text[element.sent:]
        if fresh and element.index is not None:
            self._deltas.append(ToolCallDelta(element.index, arguments=fresh))
            element.sent = len(text)

    def _close_element(self, element: CallElement, text: str) -> None:
        """A call object closed: keep it, or drop it (a repeat, an extra), or it is invalid."""
        parsed = self._as_streamed(element, parse_call(text, None, self._tools, self._new_id))
        if isinstance(parsed, InvalidToolCall):
            self.invalid.append(parsed)
            return
        if element.index is None:  # nothing of it went out: it may still be dropped
            if call_key(parsed) in self._keys:
                self._repeats += 1
                return
            if not self._parallel and (self.calls or self._next_index):
                self.extra_calls += 1
                return
            self._open_delta(element, parsed.name)
        self._keys.add(call_key(parsed))
        self.calls.append(parsed)
        self._send_arguments(element, parsed.arguments_text)

    def _as_streamed(self, element: CallElement,
                     parsed: ToolCall | InvalidToolCall) -> ToolCall | InvalidToolCall:
        """The call as its pieces streamed it: its id, and the model's arguments text when
        that is the arguments object it parsed to; invalid if it differs from what was sent."""
        if isinstance(parsed, InvalidToolCall):
            return InvalidToolCall(element.id, parsed.name or element.name, parsed.raw,
                                   parsed.error, element.index)
        if (element.args_done and element.args_key == element.used_key
                and element.name == parsed.name
                and json.loads(element.args) == parsed.arguments):
            return ToolCall(element.id, parsed.name, parsed.arguments, element.args)
        if element.index is None or (element.sent == 0 and element.name == parsed.name):
            return ToolCall(element.id, parsed.name, parsed.arguments)
        return InvalidToolCall(element.id, element.name, element.text,
                               "the call's closed object differs from the pieces sent",
                               element.index)

    # ----- whole blocks ----------------------------------------------------------------

    def _close_call(self) -> None:
        if self._call_text is None:
            return
        raw, scan = self._call_text, self._scan
        self._call_text = self._scan = None
        self._loose = True
        element = scan.element if scan is not None else None
        if scan is not None and (scan.closed or (element is not None
                                                 and element.index is not None)):
            self._close_scanned(raw, scan)
        else:
            # A JSON list of calls in one block (SmolLM2's format) is one call per element.
            bodies = split_call_list(raw) if self._parser is None else None
            for body in [raw] if bodies is None else bodies:
                self._add_call(parse_call(body, self._parser, self._tools, self._new_id))
        self.repeated_calls += self._repeats
        self._repeats = 0

    def _close_scanned(self, raw: str, scan: CallScanner) -> None:
        """A block some of whose calls closed already: an object left open, or text after the
        calls that is not JSON, is one invalid call."""
        element = scan.element
        if element is not None:
            text = raw[element.start:] if scan.closed else raw
            self.invalid.append(InvalidToolCall(element.id, element.name, text,
                                                "the tool call's JSON is not complete",
                                                element.index))
        elif scan.failed:
            self.invalid.append(InvalidToolCall(self._new_id(), None, raw[scan.end:],
                                                "text after the tool calls is not JSON"))

    def _add_call(self, parsed: ToolCall | InvalidToolCall) -> None:
        """A call parsed whole at its block's close (nothing of it was sent)."""
        if isinstance(parsed, InvalidToolCall):
            self.invalid.append(parsed)
            return
        key = call_key(parsed)
        if key in self._keys:
            self._repeats += 1
            return
        if not self._parallel and (self.calls or self._next_index):
            self.extra_calls += 1  # a model may ignore the prompt's one-call rule
            return
        self._keys.add(key)
        self._deltas += call_deltas(self._next_index, parsed)
        self._next_index += 1
        self.calls.append(parsed)

    def take_deltas(self) -> tuple[ToolCallDelta, ...]:
        """Call pieces produced since the last take (each piece is taken exactly once)."""
        deltas, self._deltas = tuple(self._deltas), []
        return deltas
