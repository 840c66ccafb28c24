"""MLXBatchLLM's logprobs on a real (tiny) model: LlamaIndex's ``list[list[LogProb]]`` on
chat, complete and their async and stream variants (a stream's chunks hold every token's
so far; the last one's equal the whole response's), as llama-index-llms-openai reads them
from the server (plus the chosen token first); batched equal to alone for plain,
constrained and speculated rows; bad values refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, LogProb

from engine import Engine, EngineConfig, InvalidRequestError, JsonSchema, StepProbe
from engine.registry import shared_engine
from mlx_providers import MLXBatchLLM
from mlx_providers.server import create_app
from testkit.speculating import every_draft_checked
from tests.conftest import own_copy, prompts_of_lengths
from tests.server.conftest import LiveServer

TOLERANCE = 1e-4  # a row decoded beside others, or speculated, sums in another order
QUESTIONS = ["Hello", "Hey", "hi", "Tell me a joke about cats.", "What is 2 + 2?",
             "Name a colour.", "Write a haiku.", "Say something."]
ITEMS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
         "minItems": 12, "maxItems": 12}  # a list that repeats: its drafts are taken
Tokens = list[list[LogProb]]


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny model: its own engine, configured by each test."""
    return own_copy(tiny_model_dir, tmp_path_factory.mktemp("li-logprobs") / "tiny")


@pytest.fixture
def llm(model_dir: Path) -> Iterator[Callable[..., MLXBatchLLM]]:
    """MLXBatchLLM on the copy (greedy, 12 tokens unless told); its engine closes after."""
    made: list[MLXBatchLLM] = []

    def make(**kw: Any) -> MLXBatchLLM:
        config = {"max_batch": 16, "prefill_chunk": 64, **kw.pop("engine_config", {})}
        model = MLXBatchLLM(model_dir, **{"max_tokens": 12, "engine_config": config, **kw})
        made.append(model)
        return model

    yield make
    for model in made:
        model.engine.close()


def assert_close(a: Tokens | None, b: Tokens | None) -> None:
    """The same tokens and alternatives, in the same order, logprobs within TOLERANCE."""
    assert a is not None and b is not None and len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert [t.token for t in x] == [t.token for t in y]
        assert [t.logprob for t in x] == pytest.approx([t.logprob for t in y], abs=TOLERANCE)


def generated(response: Any) -> int:
    return int(response.raw["usage"]["completion_tokens"])


# ----- the shape, on every method -----------------------------------------------------------


def test_each_token_lists_the_chosen_one_then_its_alternatives(
        llm: Callable[..., MLXBatchLLM]) -> None:
    response = llm(logprobs=True, top_logprobs=3).chat(user("Hello"))
    assert response.logprobs is not None and len(response.logprobs) == generated(response)
    for token in response.logprobs:
        chosen, *alternatives = token
        assert len(alternatives) == 3 and all(isinstance(t, LogProb) for t in token)
        assert bytes(chosen.bytes).decode("utf-8", "replace") == chosen.token  # its own bytes
        values = [t.logprob for t in alternatives]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert alternatives[0] == chosen  # greedy: the most likely, with the same logprob
    bare = llm(logprobs=True).complete("Hello")
    assert bare.logprobs is not None and len(bare.logprobs) == generated(bare)
    assert all(len(token) == 1 for token in bare.logprobs)  # the chosen token alone


def test_openai_like_on_the_server_reads_the_same_alternatives(
        llm: Callable[..., MLXBatchLLM]) -> None:
    from llama_index.llms.openai_like import OpenAILike

    ours = llm(logprobs=True, top_logprobs=2)
    server = LiveServer(create_app({"tiny": ours.engine})).start()
    try:
        theirs = OpenAILike(model="tiny", api_base=server.base_url, api_key="unused",
                            is_chat_model=True, max_tokens=12, temperature=0.0,
                            context_window=2048, max_retries=0, timeout=60,
                            logprobs=True, top_logprobs=2)
        read = theirs.chat(user("Hello")).logprobs
    finally:
        server.stop()
    mine = ours.chat(user("Hello")).logprobs
    assert mine is not None and read is not None
    # llama-index-llms-openai keeps only the alternatives: ours lead with the chosen token.
    assert_close([token[1:] for token in mine], read)


def test_streams_hold_every_token_so_far_and_end_with_the_whole_responses(
        llm: Callable[..., MLXBatchLLM]) -> None:
    model = llm(logprobs=True, top_logprobs=2)
    whole_chat = model.chat(user("Tell me a joke about cats."))
    whole_text = model.complete("Tell me a joke about cats.")
    streams: list[Sequence[Any]] = [list(model.stream_chat(user("Tell me a joke about cats."))),
                                    list(model.stream_complete("Tell me a joke about cats."))]

    async def astreams() -> list[list[Any]]:
        chat = [r async for r in await model.astream_chat(user("Tell me a joke about cats."))]
        text = [r async for r in await model.astream_complete("Tell me a joke about cats.")]
        return [chat, text]

    streams += asyncio.run(astreams())
    for i, chunks in enumerate(streams):
        whole = whole_chat if i % 2 == 0 else whole_text
        sizes = [len(c.logprobs) for c in chunks]
        assert sizes == sorted(sizes) and sizes[-1] == generated(whole)
        for earlier, later in pairwise(chunks):
            assert later.logprobs[:len(earlier.logprobs)] == earlier.logprobs  # a prefix
        assert chunks[-1].logprobs == whole.logprobs
    assert asyncio.run(model.achat(user("Tell me a joke about cats."))).logprobs == \
        whole_chat.logprobs
    assert asyncio.run(model.acomplete("Tell me a joke about cats.")).logprobs == \
        whole_text.logprobs


# ----- fields and per-call options ----------------------------------------------------------


def test_fields_and_per_call_options_ask_for_them(llm: Callable[..., MLXBatchLLM]) -> None:
    plain = llm()
    assert plain.chat(user("Hello")).logprobs is None
    assert plain.complete("Hello").logprobs is None
    assert all(chunk.logprobs is None for chunk in plain.stream_chat(user("Hello")))
    per_call = plain.chat(user("Hello"), logprobs=True, top_logprobs=3)
    fields = llm(logprobs=True, top_logprobs=3)
    assert fields.chat(user("Hello")).logprobs == per_call.logprobs
    # Turning logprobs off for one call leaves the fields' top_logprobs behind too.
    assert fields.chat(user("Hello"), logprobs=False).logprobs is None


@pytest.mark.parametrize(("fields", "match"), [
    ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": [True]}, "logprobs"),
])
def test_bad_fields_fail_at_construction_naming_them(
        model_dir: Path, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MLXBatchLLM(model_dir, **fields)


@pytest.mark.parametrize(("options", "match"), [
    ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
    ({"logprobs": True, "top_logprobs": 50}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": "yes"}, "SamplingParams.logprobs must be a bool"),
])
def test_bad_call_options_are_refused_before_anything_runs(
        llm: Callable[..., MLXBatchLLM], options: dict[str, Any], match: str) -> None:
    model = llm()
    with pytest.raises(InvalidRequestError, match=match):
        model.chat(user("Hello"), **options)
    with pytest.raises(InvalidRequestError, match=match):
        list(model.stream_complete("Hello", **options))
    stats = model.engine.stats()
    assert stats.completed == stats.failed == stats.running == 0


# ----- batched equals alone -----------------------------------------------------------------


def alone_and_batched(run: Callable[[Any], Any], prompts: Sequence[Any]) -> tuple[
        list[Any], list[Any]]:
    """Each prompt run alone, then all of them at once (a thread each: one batch). A prompt
    repeated to fill the batch runs alone once: each of its rows is compared with that run."""
    once: dict[str, Any] = {}
    for p in prompts:
        if repr(p) not in once:
            once[repr(p)] = run(p)
    alone = [once[repr(p)] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return alone, list(pool.map(run, prompts))


def test_plain_and_constrained_rows_report_the_same_logprobs_batched_and_alone(
        llm: Callable[..., MLXBatchLLM]) -> None:
    model = llm(logprobs=True, top_logprobs=3, max_tokens=16)
    alone, batched = alone_and_batched(lambda q: model.chat(user(q)), QUESTIONS * 2)
    assert model.engine.stats().peak_running >= 8
    for one, many in zip(alone, batched, strict=True):
        assert one.message.content == many.message.content
        assert_close(one.logprobs, many.logprobs)

    def listed(prompt: str) -> ChatResponse:
        return model.chat(user(prompt), max_tokens=80, constraint=JsonSchema(ITEMS))

    alone, batched = alone_and_batched(listed, ["list", "pick some", "names:", "choose"] * 2)
    for one, many in zip(alone, batched, strict=True):
        assert one.message.content == many.message.content
        assert_close(one.logprobs, many.logprobs)
    assert model.engine.stats().forced_tokens > 0


def test_speculated_rows_report_the_logprobs_of_decoding_in_the_batch(
        llm: Callable[..., MLXBatchLLM], model_dir: Path) -> None:
    # Raw text of one token said sixteen times: the tiny model goes on repeating it, so a
    # row alone drafts and the model takes the drafts; sixteen rows decode in the batch.
    model = llm(logprobs=True, top_logprobs=2, max_tokens=40, engine_config={"speculation": 4})
    tokenizer = model.engine.tokenizer
    repeated = [tokenizer.decode([token] * 16)
                for token in prompts_of_lengths(model.engine, [16], seed=1)[0]]
    alone, batched = alone_and_batched(lambda text: model.complete(text, formatted=True),
                                       repeated)
    drafted = model.engine.stats().drafted_tokens
    assert drafted > 0
    for one, many in zip(alone, batched, strict=True):
        assert one.text == many.text
        assert_close(one.logprobs, many.logprobs)
    # And every draft checked (most then rejected): the kept tokens' logprobs hold too.
    model.engine.close()
    config = EngineConfig(max_batch=16, prefill_chunk=64, speculation=4)
    probe = StepProbe(on_lanes=every_draft_checked())
    with Engine(model_dir, config, probe=probe).start() as engine, \
            shared_engine(model_dir, engine):
        checked = llm(logprobs=True, top_logprobs=2, max_tokens=40,
                      engine_config={"speculation": 4})
        alone, batched = alone_and_batched(lambda q: checked.chat(user(q)), QUESTIONS)
    for one, many in zip(alone, batched, strict=True):
        assert_close(one.logprobs, many.logprobs)
