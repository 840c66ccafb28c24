"""Turning a request's prompt into token ids with the model's tokenizer and chat template.

Chat messages are rendered with ``add_generation_prompt=True``; tools go through the
template's ``tools=`` when it renders them, otherwise into the system message, which is
folded into the first user turn where the template refuses system messages (Gemma 2/3's).
No model, no mlx.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError, UnsupportedMediaError
from engine.requests.inbound.audio import DecodedAudio
from engine.requests.inbound.images import IMAGE_MARK
from engine.requests.inbound.messages import (
    Media,
    Message,
    messages_from_openai,
    template_messages,
)
from engine.requests.inbound.sampling import ChatMessage, Prompt
from engine.requests.inbound.tool_prompts import (
    ToolFormat,
    detect_tool_format,
    has_tool_history,
    with_fallback_tool_prompt,
    with_plain_tool_history,
)
from engine.requests.inbound.tool_specs import ToolSpec
from engine.requests.inbound.videos import DecodedVideo
from engine.requests.inbound.vision_formats import VisionFormat

# The template variables tools are passed in, in order: the standard one, then SmolLM3's
# (its published template lists ``xml_tools`` in the system prompt and ignores ``tools``).
TOOL_KEYWORDS = ("tools", "xml_tools")


def is_chat(prompt: Any) -> bool:
    """Whether a prompt is chat messages (``Message`` values, or OpenAI dicts)."""
    return not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Message | Mapping) for m in prompt)


def chat_dicts(prompt: Any) -> list[ChatMessage]:
    """Template-ready dicts for chat messages; OpenAI dicts go through the rulebook first
    (``submit`` has converted them already; direct callers such as tests pass dicts)."""
    messages = prompt if all(isinstance(m, Message) for m in prompt) else (
        messages_from_openai(prompt, "prompt"))
    return template_messages(messages)


def with_system_in_first_user_turn(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The leading system messages' text put before the first user turn's (as Gemma 3's
    own template does with a system prompt), for templates that refuse system messages."""
    leading = 0
    while leading < len(messages) and messages[leading].get("role") == "system":
        leading += 1
    system = "\n\n".join(str(m.get("content") or "") for m in messages[:leading]).strip()
    rest = [dict(m) for m in messages[leading:]]
    if not system:
        return rest
    if not rest or rest[0].get("role") != "user":
        return [{"role": "user", "content": system}, *rest]
    content = rest[0].get("content")
    if isinstance(content, list):  # content parts: the system text as the first part
        rest[0]["content"] = [{"type": "text", "text": f"{system}\n\n"}, *content]
    else:
        rest[0]["content"] = f"{system}\n\n{content or ''}"
    return rest


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: its pixels as the tower reads them, where its tokens are.

    ``start``/``length``: the span from its first image token to its last in the prompt
    ids (a family's row breaks inside it included), whose embeddings the vision side
    computes. ``key``: the image's hash and its preprocessing (the feature cache's key, and
    what prefix reuse tells images apart by). ``block``: the image's whole token block,
    the span at ``first`` in it; ``extra``: the tower's inputs besides the pixels."""

    start: int
    length: int
    key: str
    read_pixels: Callable[[], Any]  # the tower's pixel values (numpy), read when it runs
    block: tuple[int, ...] = ()
    first: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    grid: tuple[int, int] | None = None  # M-RoPE families: its span's (rows, columns)
    at: str = ""  # the content part it came from (``messages[i].content[k]``), for errors
    frames: int = 1  # a video block's temporal groups on the grid (M-RoPE)
    video: bool = False  # a video's block: the tower reads its pixels as a video's
    audio: bool = False  # an audio clip's block: ``read_pixels`` gives its waveform

    @property
    def positions(self) -> int:
        """Positions its span advances the text by: its length, or on a grid of positions
        (M-RoPE) the grid's longest side, time included."""
        return self.length if self.grid is None else max(self.frames, *self.grid)


@dataclass(frozen=True)
class EncodedPrompt:
    """A request's prompt as the engine needs it."""

    ids: list[int]
    opens_reasoning: bool = False  # the prompt ends inside the template's thinking block
    head_len: int = 0
    images: tuple[PromptImage, ...] = ()


class PromptRenderer:
    """Encodes prompts for one tokenizer (mlx-lm's TokenizerWrapper)."""

    def __init__(self, tokenizer: Any, model_path: Path, vocab_size: int,
                 tool_formats: Sequence[ToolFormat] = (),
                 vision: VisionFormat | None = None, no_vision: str | None = None,
                 family: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vision = vision  # the family's image tokens and preprocessing; None: text only
        self._no_vision = no_vision  # why images are refused, where the checkpoint says
        self._family = family  # the checkpoint's model_type
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.tool_formats = tuple(tool_formats)  # the dialect's (``Dialect.tool_formats``)
        self._renders_tools: dict[str, bool] = {}
        self._renders_results: bool | None = None
        self._takes_system: bool | None = None

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (rendered with the chat template) -> ids."""
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
        elif is_chat(prompt):
            ids = self.render_chat(chat_dicts(prompt))
        else:
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return ids

    def encode_request(
        self, prompt: Prompt, tools: Sequence[ToolSpec], template_kwargs: dict[str, Any],
        history: Callable[[list[ChatMessage]], list[ChatMessage]] | None = None,
    ) -> EncodedPrompt:
        """Token ids for a request, the channel its output starts in, and its shared head.

        Tools are rendered by the chat template when it knows how; otherwise they are
        described in the system message: in the family's trained format where it is known
        (``tool_formats``, the dialect's declaration), else
        ``fallback_tool_prompt``. ``history`` adapts the messages to what the model
        family's template accepts first (``Dialect.history``); a template that drops tool
        results gets past calls and results as plain text (``with_plain_tool_history``),
        so the result reaches the prompt. The head
        is the leading system message(s) with the tools: what parallel agent branches
        share, and what the prefix cache stores on its own.
        """
        if not is_chat(prompt):
            return EncodedPrompt(self.encode(prompt))
        images = [image for m in prompt if isinstance(m, Message) for image in m.images]
        if images and self.vision is None:
            kind = ("video" if isinstance(images[0], DecodedVideo) else
                    "audio" if isinstance(images[0], DecodedAudio) else "images")
            raise UnsupportedMediaError(
                f"{images[0].at}: the model at {self.model_path} takes no {kind}"
                f"{': ' + self._no_vision if self._no_vision else ' (a text-only model)'}",
                images[0].at, self._family if self._no_vision else None,
                self._no_vision or "a text-only model")
        messages: list[ChatMessage] = chat_dicts(prompt)
        if history is not None:
            messages = history(messages)
        kwargs = dict(template_kwargs)
        if tools:
            keyword = next((k for k in TOOL_KEYWORDS if self.template_renders_tools(k)), None)
            if keyword is not None:
                kwargs[keyword] = [t.as_openai() for t in tools]
            elif (family := self.tool_format()) is not None:
                messages = family.rewrite(messages, tools)
            else:
                messages = with_fallback_tool_prompt(messages, tools)
        if has_tool_history(messages) and not self.template_renders_tool_results():
            messages = with_plain_tool_history(messages)
        if messages and messages[0].get("role") == "system" and not self.template_takes_system():
            messages = with_system_in_first_user_turn(messages)
        text = self.chat_text(messages, **kwargs)
        ids, placed = self._with_images(text, images)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        think = self.tokenizer.think_start if self.tokenizer.has_thinking else None
        # Templates that open the thinking block themselves start the output inside it.
        starts_thinking = bool(think) and text.rstrip().endswith(str(think))
        return EncodedPrompt(ids, starts_thinking, self._head_length(messages, ids, kwargs),
                             placed)

    def _with_images(self, text: str, images: Sequence[Media],
                     ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The rendered text's ids with each image mark replaced by the family's image
        block, written into the text and encoded whole, as the family's processor does
        (Gemma 3's blank lines around a block merge with the text's own newlines)."""
        encode = self.tokenizer.encode
        if not images:
            return list(encode(text, add_special_tokens=False)), ()
        pieces = text.split(IMAGE_MARK)
        if len(pieces) - 1 != len(images):
            raise InvalidRequestError(
                f"{images[0].at}: the chat template rendered {len(pieces) - 1} of the "
                f"conversation's {len(images)} images (it drops some messages' content)",
                images[0].at)
        vision = self.vision
        assert vision is not None
        # A video is one block or several (one per temporal group), an image one.
        media = [(item, vision.read_video(item) if isinstance(item, DecodedVideo)
                  else vision.read_audio(item) if isinstance(item, DecodedAudio)
                  else [vision.read(item)]) for item in images]
        written = [pieces[0]]
        for (_, blocks), piece in zip(media, pieces[1:]):
            written += ["".join(vision.text(block) for block in blocks), piece]
        ids = list(encode("".join(written), add_special_tokens=False))
        # Each block's media tokens are the prompt's next ones, in order: any other is text
        # that spells the model's image (or video) token, which would take a block's place.
        tokens = {vision.image_token} | {b.token for _, bs in media for b in bs if b.token}
        marks = {token: [k for k, t in enumerate(ids) if t == token] for token in tokens}
        for token in tokens:
            if len(marks[token]) != sum(block.ids.count(token) for _, bs in media
                                        for block in bs):
                spelled = dict(vision.spelling).get(token, "")
                raise InvalidRequestError(
                    f"{images[0].at}: the conversation's text holds the model's image token "
                    f"{spelled!r} outside its images; remove it from the text", images[0].at)
        placed = []
        for item, blocks in media:
            for number, block in enumerate(blocks):
                token = block.token or vision.image_token
                inside = [k for k, t in enumerate(block.ids) if t == token]
                first, last = inside[0], inside[-1]
                queue = marks[token]
                start, end = queue[0], queue[len(inside) - 1] + 1
                del queue[:len(inside)]
                # The span (its media tokens and any row breaks between) is special tokens
                # only, so whole-text encoding writes it exactly as the block's own ids.
                assert ids[start:end] == list(block.ids[first:last + 1]), item.at
                video, audio = isinstance(item, DecodedVideo), isinstance(item, DecodedAudio)
                key = f"{item.digest}:{vision.key}" + (f":video{number}" if video else
                                                       ":audio" if audio else "")
                read: Callable[[], Any] = (
                    partial(vision.video_pixels, item, number) if isinstance(item, DecodedVideo)
                    else partial(vision.audio_features, item)
                    if isinstance(item, DecodedAudio) else partial(vision.pixels, item))
                placed.append(PromptImage(start, end - start, key, read, block.ids, first,
                                          block.extra, block.grid, item.at, block.frames,
                                          video, audio))
        return ids, tuple(placed)

    def _head_length(self, messages: list[ChatMessage], ids: list[int],
                     kwargs: dict[str, Any]) -> int:
        leading = 0
        while leading < len(messages) and messages[leading].get("role") == "system":
            leading += 1
        if not leading or leading == len(messages):
            return 0
        try:
            text = str(self.tokenizer.apply_chat_template(
                messages[:leading], add_generation_prompt=False, tokenize=False, **kwargs))
        except Exception:  # a template that refuses a system-only chat: no head
            return 0
        head = list(self.tokenizer.encode(text, add_special_tokens=False))
        # Only a true token prefix of the whole prompt can be reused as one.
        return len(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else 0

    def template_renders_tools(self, keyword: str = "tools") -> bool:
        """Whether the chat template shows tools passed as ``keyword`` (``tools=``, or
        ``xml_tools=`` as SmolLM3's published template reads them), probed once each."""
        if keyword not in self._renders_tools:
            probe = ToolSpec("zz_probe_tool_zz", "probe")
            message = [{"role": "user", "content": "hi"}]
            try:
                text = self.chat_text(message, **{keyword: [probe.as_openai()]})
                self._renders_tools[keyword] = probe.name in text
            except Exception:  # a template that chokes on tools cannot render them
                self._renders_tools[keyword] = False
        return self._renders_tools[keyword]

    def template_renders_tool_results(self) -> bool:
        """Whether the chat template shows a ``tool`` message's result (probed once):
        Phi-3.5's drops it, Gemma 3's raises."""
        if self._renders_results is None:
            result = "zz_probe_result_zz"
            call = {"id": "a1b2c3d4e", "type": "function",
                    "function": {"name": "zz_probe_tool_zz", "arguments": {}}}
            history: list[ChatMessage] = [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": result}]
            try:
                self._renders_results = result in self.chat_text(history)
            except Exception:  # a template that refuses tool messages cannot render them
                self._renders_results = False
        return self._renders_results

    def template_takes_system(self) -> bool:
        """Whether the chat template renders a system message (probed once): Gemma 2's
        and Gemma 3's stand-in raise "System role not supported"."""
        if self._takes_system is None:
            probe = "zz_probe_system_zz"
            try:
                self._takes_system = probe in self.chat_text(
                    [{"role": "system", "content": probe}, {"role": "user", "content": "hi"}])
            except Exception:  # a template that refuses system messages
                self._takes_system = False
        return self._takes_system

    def tool_format(self) -> ToolFormat | None:
        """The model family's known tool format, for templates that render no tools."""
        template = getattr(self.tokenizer, "chat_template", None)
        return detect_tool_format(template if isinstance(template, str) else None,
                                  self.tool_formats)

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(self.chat_text(messages, **template_kwargs),
                                          add_special_tokens=False))

    def chat_text(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"the model at {self.model_path} has no chat template; pass text or token ids"
            )
        return str(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        ))

