"""Constraints compiled to per-row token matchers (llguidance), and their masks.

Compiling a constraint is cached per engine (bounded LRU of pristine matchers); each
row gets a cheap deep copy. ``RowGrammar.close()`` must run on every exit path; the
compiler counts live matchers so tests can prove none leak. No mlx here: masks are
filled into a numpy bitmask that the runner applies to the whole batch at once.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import InvalidConstraintError
from engine.requests.constraints.choice_arrays import bound_choice_arrays
from engine.requests.constraints.schemas import strict_schema
from engine.requests.constraints.string_markers import MarkerIndex, StringMarkers
from engine.requests.constraints.string_repeats import (
    DEFAULT_NGRAM,
    StringRepeats,
    refuse_in_bitmask,
)
from engine.requests.inbound.output_constraint import (
    Constraint,
    JsonObject,
    JsonSchema,
    LarkGrammar,
    Regex,
)

# Compact JSON: no free whitespace, so a model cannot wander in indentation forever.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar definition for a constraint."""
    import llguidance

    matcher = llguidance.LLMatcher
    if isinstance(constraint, JsonSchema | JsonObject):
        return str(matcher.grammar_from_json_schema(json.dumps(json_answer_schema(constraint))))
    if isinstance(constraint, Regex):
        return str(matcher.grammar_from_regex(constraint.pattern))
    if isinstance(constraint, LarkGrammar):
        return str(matcher.grammar_from_lark(constraint.grammar))
    raise TypeError(f"not a constraint: {constraint!r}")


def embedded_lark(constraint: Regex | LarkGrammar) -> str:
    """The caller's regex or Lark grammar as Lark text, to nest whole in an engine grammar
    (after the close of a reasoning block the prompt opened, say)."""
    if isinstance(constraint, LarkGrammar):
        return constraint.grammar
    top = json.loads(grammar_text(constraint))  # llguidance writes a regex as a Lark rule
    return str(top["grammars"][0]["lark_grammar"])


def json_answer_schema(constraint: JsonSchema | JsonObject) -> dict[str, Any]:
    """The JSON schema a JSON constraint's output follows, as the grammar applies it:
    closed at every level (undeclared keys refused), arrays of finite choices bounded to
    one item per choice (``choice_arrays``), written as compact JSON."""
    if isinstance(constraint, JsonObject):
        return {"type": "object", "x-guidance": _JSON_OPTIONS}
    schema = strict_schema(constraint.schema_dict)
    bound_choice_arrays(schema)
    schema.setdefault("x-guidance", _JSON_OPTIONS)
    return schema


class GrammarCompiler:
    """Builds matchers for one tokenizer; caches compiled grammars by constraint."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, cache_size: int = 64,
                 string_ngram: int = DEFAULT_NGRAM, call_markers: Sequence[str] = (),
                 call_opener: str = "") -> None:
        """``string_ngram``: inside JSON strings, refuse a token that repeats an n-gram of
        this many tokens already in the string (``StringRepeats``); 0 turns it off.
        ``call_markers``: the dialect's structural markers, refused inside the strings of a
        call's JSON, which follows ``call_opener`` (``StringMarkers``)."""
        self._hf_tokenizer = hf_tokenizer
        self.string_ngram = string_ngram
        self.call_markers = tuple(call_markers)
        self.call_opener = call_opener
        self._marker_index: MarkerIndex | None = None
        self._token_bytes: list[bytes] | None = None
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        self.live_matchers = 0

    @property
    def words(self) -> int:
        """int32 words per row of the bitmask."""
        return (self.vocab_size + 31) // 32

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size
            )
        return self._tokenizer

    def token_ids(self, text: str) -> list[int]:
        """``text`` as the grammar reads it in tokens: special tokens as themselves, and no
        prefix space a sentencepiece tokenizer's ``encode`` would add (what a model writes)."""
        return list(self._llg_tokenizer().tokenize_str(text))

    def lark_text(self, text: str) -> str:
        """Lark for ``text``: its special tokens as tokens (``<[id]>``; llguidance matches a
        special token only when the grammar names it so), the text between them as quoted
        strings. Empty text is the empty string."""
        tokenizer = self._llg_tokenizer()
        parts: list[str] = []
        plain = b""
        for token in tokenizer.tokenize_str(text):
            if tokenizer.is_special_token(token):
                if plain:
                    parts.append(json.dumps(plain.decode("utf-8")))
                    plain = b""
                parts.append(f"<[{token}]>")
            else:
                plain += tokenizer.decode_bytes([token])
        if plain or not parts:
            parts.append(json.dumps(plain.decode("utf-8")))
        return " ".join(parts)

    def clear_compiled(self) -> None:
        """Drop the cached pristine matchers (the model is unloading: a large schema's
        grammar can hold megabytes); the tokenizer's vocabulary, slow to build, stays."""
        self._compiled.clear()

    def compile(self, constraint: Constraint) -> Any:
        """A pristine matcher for the constraint (cached); raises InvalidConstraintError."""
        cached = self._compiled.get(constraint)
        if cached is not None:
            self._compiled.move_to_end(constraint)
            return cached
        import llguidance

        try:
            text = grammar_text(constraint)
        except ValueError as exc:
            raise InvalidConstraintError(f"invalid {_kind(constraint)}: {exc}") from exc
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text)
        if matcher.is_error():
            raise InvalidConstraintError(f"invalid {_kind(constraint)}: {matcher.get_error()}")
        self._compiled[constraint] = matcher
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return matcher

    def row(self, constraint: Constraint) -> RowGrammar:
        """A fresh matcher for one row; close() it when the row ends, however it ends."""
        matcher = self.compile(constraint).deep_copy()
        rewinds = not bounded_lexemes(constraint)
        json = writes_json(constraint)
        repeats = (StringRepeats(self.token_bytes(), self.string_ngram)
                   if self.string_ngram and json else None)
        markers = None
        if self.call_markers and json:
            # A schema's answer is JSON from its first byte; a grammar's calls follow the
            # dialect's opener (reasoning and prose before them are never read as JSON).
            opener = b"" if isinstance(constraint, JsonSchema | JsonObject) else (
                self.call_opener.encode())
            markers = StringMarkers(self.token_bytes(), self.marker_index(), opener)
        return RowGrammar(self, matcher, repeats, describe(constraint), markers, rewinds)

    def marker_index(self) -> MarkerIndex:
        """The tokens that write a structural marker inside a string (built once)."""
        if self._marker_index is None:
            self._marker_index = MarkerIndex.of(self.token_bytes(), self.call_markers)
        return self._marker_index

    def token_bytes(self) -> list[bytes]:
        """Every token id's bytes (built once per tokenizer, ~0.1 s)."""
        if self._token_bytes is None:
            tokenizer = self._llg_tokenizer()
            self._token_bytes = [tokenizer.decode_bytes([token])
                                 for token in range(tokenizer.vocab_size)]
        return self._token_bytes


@dataclass(frozen=True)
class GrammarMark:
    """A row grammar's position: tokens consumed, and its string-loop guard then."""

    consumed: int
    repeats: StringRepeats | None
    markers: StringMarkers | None = None
    # A copy of the matcher, where it cannot roll back (lexemes bounded in tokens).
    matcher: Any = None


class RowGrammar:
    """One row's matcher: consume sampled tokens, fill the next-token mask."""

    def __init__(self, compiler: GrammarCompiler, matcher: Any,
                 repeats: StringRepeats | None = None, name: str = "constraint",
                 markers: StringMarkers | None = None, rewinds: bool = True) -> None:
        self._compiler = compiler
        self._matcher: Any = matcher
        self._rewinds = rewinds  # llguidance rolls it back (else a mark keeps a copy)
        self.name = name  # what the row's errors call its constraint
        self.repeats = repeats  # refuses loops inside JSON strings, None for other grammars
        self.markers = markers  # refuses call markers inside a call's strings
        self.started = False  # the first sampler call sees the prompt's last token
        self._consumed = 0  # tokens consumed so far (what ``rollback`` counts back to)
        compiler.live_matchers += 1

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise InvalidConstraintError(
                f"token {token} violates the {self.name}: {self._matcher.get_error()}"
            )
        self._consumed += 1
        if self.repeats is not None:
            self.repeats.advance(token)
        if self.markers is not None:
            self.markers.advance(token)

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (none consumed)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def mark(self) -> GrammarMark:
        """The matcher's position now, to roll back to (speculation consumes a draft to
        fill each position's mask, then keeps only what the model accepted)."""
        return GrammarMark(self._consumed,
                           self.repeats.copy() if self.repeats is not None else None,
                           self.markers.copy() if self.markers is not None else None,
                           None if self._rewinds else self._matcher.deep_copy())

    def rollback(self, mark: GrammarMark) -> None:
        """Undo every token consumed since ``mark``."""
        undo = self._consumed - mark.consumed
        if mark.matcher is not None:  # llguidance cannot rewind it: back to the copy
            if undo > 0:
                self._matcher = mark.matcher.deep_copy()
        elif undo > 0 and not self._matcher.rollback(undo):
            raise InvalidConstraintError(f"cannot roll back {undo} tokens: "
                                         f"{self._matcher.get_error()}")
        self._consumed = mark.consumed
        self.repeats = mark.repeats
        self.markers = mark.markers

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar alone decides next (at most ``limit``), not consumed.

        llguidance's canonical tokenization of the bytes every continuation shares, up to
        the next point where the model has a choice; empty when there is a choice now.
        """
        if limit <= 0 or self._matcher.is_stopped():
            return []
        tokens: list[int] = self._matcher.compute_ff_tokens()
        return tokens[:limit]

    def fill(self, bitmask: np.ndarray[Any, Any], row: int) -> None:
        """The row's allowed next tokens. A matcher that allows none (a dead state, or an
        error, which llguidance turns into "end of sequence only") fails the row, naming
        its constraint: it must never end looking complete, or go on unconstrained."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
        self.check_filled(bitmask, row)

    def check_filled(self, bitmask: np.ndarray[Any, Any], row: int) -> None:
        """After llguidance filled ``bitmask[row]``: a dead state fails the row (see
        ``fill``); the string-loop guard's refusals are taken out of the mask."""
        if self._matcher.is_error() or not bitmask[row].any():
            raise InvalidConstraintError(
                f"the {self.name} reached a state no token can continue: "
                f"{self._matcher.get_error() or 'no token is allowed'}")
        if self.repeats is not None:
            refused = self.repeats.refused()
            if refused:
                refuse_in_bitmask(bitmask[row:row + 1], refused)
        if self.markers is not None:
            refused = self.markers.refused()
            if refused:
                refuse_in_bitmask(bitmask[row:row + 1], refused)

    @property
    def matcher(self) -> Any:
        """The llguidance matcher (for a batched fill: ``fill_rows``)."""
        return self._matcher

    @property
    def done(self) -> bool:
        """The grammar is complete: only end-of-sequence may follow."""
        return bool(self._matcher.is_stopped())

    def close(self) -> None:
        if self._matcher is not None:
            self._matcher = None
            self._compiler.live_matchers -= 1


def fill_rows(executor: Any, rows: Sequence[tuple[RowGrammar, int]],
              bitmask: np.ndarray[Any, Any]) -> dict[int, InvalidConstraintError]:
    """Every row's allowed next tokens in one call (llguidance's threads, the GIL
    released); returns the failures by bitmask row, as ``RowGrammar.fill`` raises them."""
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask_par(
        executor, [(grammar.matcher, row) for grammar, row in rows], bitmask)
    failed: dict[int, InvalidConstraintError] = {}
    for grammar, row in rows:
        try:
            grammar.check_filled(bitmask, row)
        except InvalidConstraintError as exc:
            failed[row] = exc
    return failed


def bounded_lexemes(constraint: Constraint) -> bool:
    """Whether a Lark grammar bounds a lexeme in tokens or by a stop string (a reasoning
    budget's ``thinking[max_tokens=N]``): llguidance cannot roll such a matcher back."""
    return isinstance(constraint, LarkGrammar) and re.search(
        r"\[\s*(max_tokens|stop)\s*=", constraint.grammar) is not None


def writes_json(constraint: Constraint) -> bool:
    """Whether a constraint's output is JSON (or holds JSON): its strings get loop guards.

    A user's regex, or a Lark grammar without ``%json``, is taken exactly as written.
    """
    if isinstance(constraint, JsonSchema | JsonObject):
        return True
    return isinstance(constraint, LarkGrammar) and "%json" in constraint.grammar


def _kind(constraint: Constraint) -> str:
    return {JsonSchema: "JSON schema", JsonObject: "JSON object", Regex: "regex",
            LarkGrammar: "Lark grammar"}[type(constraint)]


def describe(constraint: Constraint) -> str:
    """The constraint as a row's error names it: its kind and the start of its text."""
    if isinstance(constraint, JsonSchema):
        text = json.dumps(constraint.schema_dict)
    elif isinstance(constraint, Regex):
        text = constraint.pattern
    elif isinstance(constraint, LarkGrammar):
        text = constraint.grammar
    else:
        text = ""
    shown = " ".join(text.split())
    return f"{_kind(constraint)} {shown[:60]!r}" if shown else _kind(constraint)


def validate_constraint(constraint: Constraint) -> None:
    """Reject a bad schema or grammar at submit, on the caller's thread (no tokenizer)."""
    import llguidance

    try:
        text = grammar_text(constraint)
        problem = llguidance.LLMatcher.validate_grammar(text)
    except ValueError as exc:
        problem = str(exc)
    if problem:
        raise InvalidConstraintError(f"invalid {_kind(constraint)}: {problem}")
