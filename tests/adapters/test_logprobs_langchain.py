"""ChatMLXBatch's logprobs on a real (tiny) model: ChatOpenAI's shape, on invoke and on
every streamed chunk (chunks add up to invoke's), as fields, per call and bound; the same
numbers batched as alone for plain, constrained and speculated rows; bad values refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_openai import ChatOpenAI

from engine import Engine, EngineConfig, InvalidRequestError, StepProbe
from engine.device.speedups.speculation import speculate
from engine.registry import shared_engine
from mlx_providers import ChatMLXBatch
from mlx_providers.server import create_app
from testkit.speculating import every_draft_checked
from tests.conftest import own_copy, prompts_of_lengths
from tests.server.conftest import LiveServer

TOLERANCE = 1e-4  # a row decoded beside others, or speculated, sums in another order
PROMPTS = ["Hello", "Hey", "hi", "Tell me a joke about cats.", "What is 2 + 2?",
           "Name a colour.", "Write a haiku.", "Say something."]
# A list that repeats itself: prompt lookup drafts its items, and the model takes them.
ITEMS = {"title": "Items", "type": "object", "required": ["items"], "properties": {
    "items": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
              "minItems": 12, "maxItems": 12}}}
ENTRY_KEYS = {"token", "logprob", "bytes", "top_logprobs"}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A private copy of the tiny model: its own engine, configured by each test."""
    return str(own_copy(tiny_model_dir, tmp_path_factory.mktemp("lc-logprobs") / "tiny"))


@pytest.fixture
def chat(model_dir: str) -> Iterator[Callable[..., ChatMLXBatch]]:
    """ChatMLXBatch on the copy (greedy, 12 tokens unless told); its engine closes after."""
    made: list[ChatMLXBatch] = []

    def make(**kw: Any) -> ChatMLXBatch:
        config = {"max_batch": 16, "prefill_chunk": 64, **kw.pop("engine_config", {})}
        model = ChatMLXBatch(**{"model": model_dir, "max_tokens": 12,
                                "engine_config": config, **kw})
        made.append(model)
        return model

    yield make
    for model in made:
        model.engine.close()


def content(message: BaseMessage) -> list[dict[str, Any]]:
    """The message's logprobs entries (``response_metadata["logprobs"]["content"]``)."""
    entries = message.response_metadata["logprobs"]["content"]
    assert isinstance(entries, list)
    return entries


def merged(chunks: Sequence[AIMessageChunk]) -> AIMessageChunk:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def assert_close(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """The same tokens and alternatives, in the same order, logprobs within TOLERANCE."""
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b, strict=True):
        assert x["logprob"] == pytest.approx(y["logprob"], abs=TOLERANCE)
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        assert [t["logprob"] for t in x["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in y["top_logprobs"]], abs=TOLERANCE)


# ----- the shape ---------------------------------------------------------------------------


def test_invoke_gives_every_token_in_chat_openais_shape(
        chat: Callable[..., ChatMLXBatch]) -> None:
    message = chat(logprobs=True, top_logprobs=3).invoke("Hello")
    logprobs = message.response_metadata["logprobs"]
    assert set(logprobs) == {"content", "refusal"} and logprobs["refusal"] is None
    entries = content(message)
    assert message.usage_metadata is not None
    assert len(entries) == message.usage_metadata["output_tokens"] == 12
    for entry in entries:
        # The token's own bytes, which its text reads as (a half character as U+FFFD).
        assert set(entry) == ENTRY_KEYS
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        top = entry["top_logprobs"]
        assert len(top) == 3 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the chosen token is the most likely one, with the same logprob.
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])


def test_sampled_tokens_keep_their_own_logprob_among_the_alternatives(
        chat: Callable[..., ChatMLXBatch]) -> None:
    message = chat(temperature=1.0, seed=7, max_tokens=24, logprobs=True,
                   top_logprobs=5).invoke("Hello")
    entries = content(message)
    assert len(entries) == 24
    below_top = 0
    for entry in entries:
        top = entry["top_logprobs"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert entry["logprob"] <= top[0]["logprob"]
        if entry["logprob"] >= top[-1]["logprob"]:  # among the five: listed with its logprob
            assert {"token": entry["token"], "logprob": entry["logprob"],
                    "bytes": entry["bytes"]} in top
        below_top += entry["logprob"] < top[0]["logprob"]
    assert below_top > 0, "sampling at temperature 1 never left the top token"


def test_chat_openai_on_the_server_gets_the_same_logprobs_invoked_and_streamed(
        chat: Callable[..., ChatMLXBatch]) -> None:
    ours = chat(logprobs=True, top_logprobs=2)
    server = LiveServer(create_app({"tiny": ours.engine})).start()
    try:
        theirs = ChatOpenAI(model="tiny", base_url=server.base_url, api_key="unused",  # type: ignore[arg-type]
                            max_retries=0, timeout=60, max_tokens=12, temperature=0,
                            logprobs=True, top_logprobs=2)
        invoked = theirs.invoke("Hello")
        streamed = merged(list(theirs.stream("Hello")))
    finally:
        server.stop()
    mine = ours.invoke("Hello")
    assert set(invoked.response_metadata["logprobs"]) == set(mine.response_metadata["logprobs"])
    assert_close(content(mine), content(invoked))
    assert_close(content(merged(list(ours.stream("Hello")))), content(streamed))


# ----- streaming ---------------------------------------------------------------------------


def test_each_chunk_carries_its_own_tokens_and_the_stream_adds_up_to_invoke(
        chat: Callable[..., ChatMLXBatch]) -> None:
    model = chat(logprobs=True, top_logprobs=2)
    whole = model.invoke("Tell me a joke about cats.")
    chunks = list(model.stream("Tell me a joke about cats."))
    # One token per decode step here: every chunk but the last brings exactly one.
    assert all(len(content(c)) == 1 for c in chunks[:-1])
    total = merged(chunks)
    assert total.content == whole.content
    assert total.response_metadata["logprobs"] == whole.response_metadata["logprobs"]

    async def astreamed() -> AIMessageChunk:
        return merged([c async for c in model.astream("Tell me a joke about cats.")])

    assert asyncio.run(astreamed()).response_metadata["logprobs"] == \
        whole.response_metadata["logprobs"]
    # streaming=True routes invoke through the stream: the merged chunks, the same numbers.
    routed = chat(logprobs=True, top_logprobs=2, streaming=True).invoke(
        "Tell me a joke about cats.")
    assert routed.response_metadata["logprobs"] == whole.response_metadata["logprobs"]


def test_a_stop_string_holds_text_back_but_not_logprobs(
        chat: Callable[..., ChatMLXBatch]) -> None:
    model = chat(logprobs=True, max_tokens=24)
    text = str(model.invoke("Hello", logprobs=False).content)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    whole = model.invoke("Hello", stop=[stop])
    chunks = list(model.stream("Hello", stop=[stop]))
    assert stop not in str(whole.content)
    assert merged(chunks).response_metadata["logprobs"] == whole.response_metadata["logprobs"]


# ----- fields, per call, bound -------------------------------------------------------------


def test_fields_per_call_options_and_bind_all_ask_for_them(
        chat: Callable[..., ChatMLXBatch]) -> None:
    plain = chat()
    assert "logprobs" not in plain.invoke("Hello").response_metadata
    per_call = plain.invoke("Hello", logprobs=True, top_logprobs=3)
    assert all(len(e["top_logprobs"]) == 3 for e in content(per_call))
    bound = plain.bind(logprobs=True).invoke("Hello")
    assert all(e["top_logprobs"] == [] for e in content(bound))
    assert [e["logprob"] for e in content(bound)] == [e["logprob"] for e in content(per_call)]
    fields = chat(logprobs=True, top_logprobs=3)
    assert content(fields.invoke("Hello")) == content(per_call)
    # Turning logprobs off for one call leaves the fields' top_logprobs behind too.
    assert "logprobs" not in fields.invoke("Hello", logprobs=False).response_metadata
    assert fields._identifying_params["top_logprobs"] == 3


@pytest.mark.parametrize(("fields", "match"), [
    ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": True, "top_logprobs": -1}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": [True]}, "logprobs"),
])
def test_bad_fields_fail_at_construction_naming_them(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChatMLXBatch(**fields)


@pytest.mark.parametrize(("options", "match"), [
    ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs needs logprobs=True"),
    ({"logprobs": True, "top_logprobs": 50}, r"top_logprobs must be an integer in \[0, 20\]"),
    ({"logprobs": "yes"}, "SamplingParams.logprobs must be a bool"),
])
def test_bad_call_options_are_refused_before_anything_runs(
        chat: Callable[..., ChatMLXBatch], options: dict[str, Any], match: str) -> None:
    model = chat()
    with pytest.raises(InvalidRequestError, match=match):
        model.invoke("Hello", **options)
    stats = model.engine.stats()
    assert stats.completed == stats.failed == stats.running == 0


# ----- batched equals alone ----------------------------------------------------------------


def alone_and_batched(model: Any, prompts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Each prompt run alone, then all of them as rows of one batch. A prompt repeated to
    fill the batch runs alone once: each of its rows is compared with that one run."""
    once: dict[str, Any] = {}
    for p in prompts:
        if repr(p) not in once:
            once[repr(p)] = model.invoke(p)
    alone = [once[repr(p)] for p in prompts]
    batched = model.batch(list(prompts))
    return alone, batched


def test_batched_rows_report_the_logprobs_they_report_alone(
        chat: Callable[..., ChatMLXBatch]) -> None:
    model = chat(logprobs=True, top_logprobs=3, max_tokens=16)
    alone, batched = alone_and_batched(model, PROMPTS * 2)
    assert model.engine.stats().peak_running >= 8
    for one, many in zip(alone, batched, strict=True):
        assert one.content == many.content
        assert_close(content(one), content(many))


def test_constrained_rows_report_the_same_logprobs_batched_and_alone(
        chat: Callable[..., ChatMLXBatch]) -> None:
    model = chat(logprobs=True, top_logprobs=3, max_tokens=120)
    structured = model.with_structured_output(ITEMS, include_raw=True)
    prompts = ["list", "pick some", "names:", "choose"] * 2
    alone, batched = alone_and_batched(structured, prompts)
    forced = 0
    for one, many in zip(alone, batched, strict=True):
        assert isinstance(one["raw"], AIMessage) and one["raw"].content == many["raw"].content
        assert_close(content(one["raw"]), content(many["raw"]))
        # Tokens the grammar forced are certain (logprob 0) and have no alternative.
        forced += sum(len(e["top_logprobs"]) == 1 for e in content(one["raw"]))
    assert forced > 0 and model.engine.stats().forced_tokens > 0


def test_speculated_rows_report_the_logprobs_of_decoding_in_the_batch(
        chat: Callable[..., ChatMLXBatch], model_dir: str) -> None:
    # Alone, every row with a draft checks it (up to four rows speculate); sixteen rows
    # decode in the batch. A repeated word drafts; a list of three words drafts and is taken.
    checks = [0]

    def counted(*args: Any) -> Any:
        checks[0] += 1
        return speculate(*args)

    config = EngineConfig(max_batch=16, prefill_chunk=64, speculation=4)
    probe = StepProbe(on_lanes=every_draft_checked(counted))
    with Engine(model_dir, config, probe=probe).start() as engine, \
            shared_engine(model_dir, engine):
        _speculated_in_the_batch(chat, checks)


def _speculated_in_the_batch(chat: Callable[..., ChatMLXBatch], checks: list[int]) -> None:
    model = chat(logprobs=True, top_logprobs=2, max_tokens=40,
                 engine_config={"speculation": 4})
    tokenizer = model.engine.tokenizer
    repeated = [tokenizer.decode([token] * 16)
                for token in prompts_of_lengths(model.engine, [8], seed=1)[0]]
    alone, batched = alone_and_batched(model, repeated + PROMPTS)
    assert checks[0] > 0
    for one, many in zip(alone, batched, strict=True):
        assert one.content == many.content
        assert_close(content(one), content(many))
    lists = model.bind(max_tokens=120).with_structured_output(ITEMS, include_raw=True)
    before = model.engine.stats().drafted_tokens
    alone, batched = alone_and_batched(lists, ["list", "pick some", "names:"] * 6)
    assert model.engine.stats().drafted_tokens > before
    for one, many in zip(alone, batched, strict=True):
        assert_close(content(one["raw"]), content(many["raw"]))
