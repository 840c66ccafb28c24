"""A request prepared once, outside the step loop: prompt ids, tools, constraint, stops.

Every door hands ``Engine.submit`` one request value (``ChatRequest`` or ``TextRequest``,
checked when it was built); ``checked_request`` adds, on the caller's thread, what needs
no tokenizer. ``Preparer`` turns it into a ``PreparedRequest`` for this model's
tokenizer: the prompt rendered and encoded, the turn's grammar (which one is
``constraints.turn_grammar``'s policy) compiled, the stop ids resolved.
The loop only ever sees prepared requests. No mlx here.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from engine.errors import InvalidRequestError
from engine.requests.constraints.forced_calls import forced_call_schema
from engine.requests.constraints.grammar import GrammarCompiler, validate_constraint
from engine.requests.constraints.string_repeats import DEFAULT_NGRAM
from engine.requests.constraints.tools_or_answer import joins_tools
from engine.requests.constraints.turn_grammar import TurnGrammar, limited_tools
from engine.requests.dialects.dialect import TokenizerFacts
from engine.requests.dialects.registry import dialect_for
from engine.requests.inbound.adapters import adapter_config
from engine.requests.inbound.chat import ChatRequest
from engine.requests.inbound.output_constraint import Constraint, JsonSchema
from engine.requests.inbound.prompts import EncodedPrompt, PromptImage, PromptRenderer
from engine.requests.inbound.sampling import SamplingParams
from engine.requests.inbound.text_request import Request, TextRequest
from engine.requests.inbound.vision_formats import UnsupportedVision, VisionFormat, vision_format
from engine.requests.outbound.channels import CONTENT, REASONING
from engine.requests.outbound.row_channels import RowChannels
from engine.requests.outbound.text import RowText


@dataclass(frozen=True)
class ImageSupport:
    """What a loaded model does with images, decided at load: its ``model_type``
    (``family``), whether its image parts are ``served``, and if not, ``reason``."""

    family: str | None
    served: bool
    reason: str | None


@dataclass(frozen=True)
class PreparedRequest:
    """What the loop and the lanes need: ids, final sampling settings, stops, channels."""

    prompt_ids: list[int]
    params: SamplingParams  # with the forced-call grammar as its constraint, if any
    stop_ids: frozenset[int]
    head_len: int = 0  # tokens of the shared head (system + tools); 0 = none
    start_channel: str = CONTENT
    forces_call: bool = False  # the tool choice forces a call (a cut one is truncation)
    images: tuple[PromptImage, ...] = ()  # the prompt's images, where their tokens are


class Preparer:
    """Prepares requests for one tokenizer; lives on the engine thread."""

    def __init__(self, tokenizer: Any, model_path: Path, vocab_size: int,
                 json_string_ngram: int = DEFAULT_NGRAM) -> None:
        self.tokenizer = tokenizer
        self.dialect = dialect_for(TokenizerFacts.of(tokenizer))
        vision, no_vision, family = _vision_of(model_path, tokenizer)
        self.vision: VisionFormat | None = vision
        self.prompts = PromptRenderer(tokenizer, model_path, vocab_size,
                                      self.dialect.tool_formats, vision, no_vision, family)
        self.image_support = ImageSupport(family, vision is not None, no_vision)
        self.compiler = GrammarCompiler(tokenizer._tokenizer, vocab_size,
                                        string_ngram=json_string_ngram,
                                        call_markers=self.dialect.structural_markers,
                                        call_opener=self.dialect.call_opener)
        self.turn_grammar = TurnGrammar(self.dialect, self.compiler.lark_text)

    def prepare(self, request: Request) -> PreparedRequest:
        """Render, encode and compile; raises the request's own error if it cannot run."""
        request.params.check_vocabulary(self.prompts.vocab_size)
        params = request.params
        if isinstance(request, TextRequest):
            encoded = EncodedPrompt(self.prompts.encode(request.prompt))
            forces_call = False
        else:
            encoded = self._encoded_chat(request)
            forces_call = request.forces_call
            params = replace(params, constraint=self.turn_grammar.constraint(
                request, encoded.opens_reasoning))
        if params.constraint is not None:
            self.compiler.compile(params.constraint)  # cached: the lane's matcher reuses it
        return PreparedRequest(encoded.ids, params, self.stop_ids(params), encoded.head_len,
                               REASONING if encoded.opens_reasoning else CONTENT, forces_call,
                               encoded.images)

    def count_tokens(self, request: Request) -> int:
        """Prompt tokens the request would use (rendered and encoded as ``prepare`` does)."""
        if isinstance(request, TextRequest):
            return len(self.prompts.encode(request.prompt))
        return len(self._encoded_chat(request).ids)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        return eos | frozenset(params.stop_token_ids)

    def row_text(self, params: SamplingParams) -> RowText:
        return RowText(self.tokenizer.detokenizer, params.stop, self.tokenizer.decode)

    def row_channels(self, request: Request, prepared: PreparedRequest) -> RowChannels:
        dialect = self.dialect
        if isinstance(request, TextRequest):
            splitter = dialect.splitter(prepared.start_channel)
            return RowChannels(splitter, dialect.parser, (), new_id=dialect.new_call_id)
        splitter = dialect.splitter(prepared.start_channel, request.tools)
        return RowChannels(splitter, dialect.parser, request.tools,
                           request.parallel_tool_calls, new_id=dialect.new_call_id)

    def _encoded_chat(self, request: ChatRequest) -> EncodedPrompt:
        return self.prompts.encode_request(request.messages, request.rendered_tools,
                                           dict(request.template_kwargs),
                                           history=self.dialect.history)


def _vision_of(model_path: Path, tokenizer: Any,
               ) -> tuple[VisionFormat | None, str | None, str | None]:
    """The checkpoint's image format, or why it takes no images; and its model_type."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return None, None, None
    family = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    try:
        found = vision_format(config, tokenizer, Path(model_path))
    except UnsupportedVision as exc:
        return None, str(exc), family
    if found is not None and not _vision_stack_found():
        return None, ("its vision tower needs mlx-vlm, which is not installed: "
                      "pip install 'mlx-providers[vision]'"), family
    return found, None, family


def _vision_stack_found() -> bool:
    """mlx-vlm is installed (found, not imported: the tower imports it at the first image)."""
    try:
        return importlib.util.find_spec("mlx_vlm") is not None
    except (ImportError, ValueError):  # an import hook that refuses it, a broken entry
        return False


def checked_request(request: Any) -> Request:
    """Everything ``submit`` can check without a tokenizer that building the request did
    not: its type, and that its output constraint or forced call compiles (once per
    distinct schema). Returns the request as it is: nothing is converted again."""
    if not isinstance(request, ChatRequest | TextRequest):
        hint = (" (chat messages: ChatRequest.from_openai(messages, params, tools=...); text "
                "or token ids: TextRequest(prompt, params))")
        raise TypeError(f"submit takes a ChatRequest or a TextRequest, got "
                        f"{type(request).__name__}{hint}")
    if request.params.adapter is not None:
        adapter_config(request.params.adapter)  # its files and kind, at once
    if isinstance(request, ChatRequest) and request.forces_call:
        if not limited_tools(request):
            raise InvalidRequestError(
                f"tool_call_limit={request.params.tool_call_limit}: every tool was already "
                "called that many times and tool_choice requires a call; raise the limit, "
                "name a tool, or let the model answer (tool_choice 'auto')", "tool_call_limit")
        # The call's schema now; its grammar is built when the request is prepared.
        _validated(JsonSchema(forced_call_schema(request.tools, request.tool_choice)))
        return cast(Request, request)
    if request.params.constraint is not None:
        _validated(request.params.constraint)
        if isinstance(request, ChatRequest) and request.rendered_tools and joins_tools(
                request.params.constraint):  # the union's call branch: any tool
            _validated(JsonSchema(forced_call_schema(request.tools, "required")))
    return cast(Request, request)


@lru_cache(maxsize=256)
def _validated(constraint: Constraint) -> None:
    """``validate_constraint``, once per distinct schema or grammar (a refusal is not cached:
    it raises again, cheaply, for the next request that sends it)."""
    validate_constraint(constraint)
