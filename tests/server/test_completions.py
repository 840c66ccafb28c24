"""``/v1/completions`` through the real ``openai`` SDK's ``completions.create`` on loopback.

The tiny model has random weights, so these tests hold structure and determinism, not
meaning: every greedy choice equals the engine's own ``TextRequest`` of the same prompt, in
text and token count, whole, streamed, several prompts at once (batched: they decode in
one step), as token ids, ``n`` times, with ``echo`` and ``logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from engine import Completion, Engine, SamplingParams, TextRequest
from mlx_providers.server import ServerSettings
from tests.conftest import wait_until
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(240)

Serve = Callable[..., tuple[LiveServer, Engine]]
PROMPTS = ["def hello(", "import os\n", "class Point:"]
TOKENS = 8


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def own(engine: Engine, prompt: str, max_tokens: int = TOKENS,
        **params: Any) -> Completion:
    """What the engine itself generates for the prompt (greedy unless ``params`` say)."""
    return engine.submit(TextRequest(prompt, SamplingParams(max_tokens=max_tokens, **params))
                         ).result(timeout=60)


def test_a_completion_is_the_engines_own_text_request(client: openai.OpenAI,
                                                      server_engine: Engine) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=TOKENS)
    expected = own(server_engine, PROMPTS[0])
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.model == "tiny"
    [choice] = reply.choices
    assert choice.index == 0 and choice.text == expected.text
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert reply.usage is not None
    assert reply.usage.completion_tokens == TOKENS == expected.usage.completion_tokens
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + TOKENS


def test_max_tokens_defaults_to_the_legacy_16(client: openai.OpenAI,
                                              server_engine: Engine) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPTS[1])
    expected = own(server_engine, PROMPTS[1], max_tokens=16)
    assert reply.choices[0].text == expected.text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == expected.usage.completion_tokens <= 16


async def test_the_async_client_gets_the_same_completion(live_server: LiveServer,
                                                         client: openai.OpenAI) -> None:
    aclient = openai.AsyncOpenAI(base_url=live_server.base_url, api_key="unused",
                                 max_retries=0, timeout=60)
    reply = await aclient.completions.create(model="tiny", prompt=PROMPTS[2],
                                             max_tokens=TOKENS)
    same = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=TOKENS)
    assert reply.choices[0].text == same.choices[0].text
    chunks = [c async for c in await aclient.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=TOKENS, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == same.choices[0].text
    await aclient.close()


def test_a_stream_adds_up_to_the_whole_completion(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=TOKENS)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0],
                                            max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    *texts, usage = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in texts][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert all(c.usage is None for c in texts)
    assert usage.choices == [] and usage.usage is not None
    assert whole.usage is not None
    assert usage.usage.completion_tokens == whole.usage.completion_tokens == TOKENS


def test_several_prompts_are_rows_of_one_batch(serve: Serve) -> None:
    server, eng = serve()
    sdk = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    reply = sdk.completions.create(model="tiny", prompt=PROMPTS, max_tokens=TOKENS)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert eng.stats().peak_running == len(PROMPTS)  # decoded in the same steps
    expected = [own(eng, p) for p in PROMPTS]
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(e.usage.prompt_tokens for e in expected)
    assert reply.usage.completion_tokens == len(PROMPTS) * TOKENS
    # Streamed, the rows' chunks interleave, each naming its choice.
    texts = ["", "", ""]
    finished: list[int] = []
    for chunk in sdk.completions.create(model="tiny", prompt=PROMPTS, max_tokens=TOKENS,
                                        stream=True):
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished.append(choice.index)
    assert texts == [e.text for e in expected]
    assert sorted(finished) == [0, 1, 2]


def test_token_id_prompts_are_continued_as_their_text(client: openai.OpenAI,
                                                     server_engine: Engine) -> None:
    ids = [list(server_engine.tokenizer.encode(p)) for p in PROMPTS[:2]]
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=TOKENS)
    assert one.choices[0].text == own(server_engine, PROMPTS[0]).text
    both = client.completions.create(model="tiny", prompt=ids, max_tokens=TOKENS)
    assert [c.text for c in both.choices] == [own(server_engine, p).text for p in PROMPTS[:2]]


def test_n_choices_per_prompt_are_indexed_prompt_major(client: openai.OpenAI,
                                                       server_engine: Engine) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2,
                                      max_tokens=TOKENS)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    first, second = own(server_engine, PROMPTS[0]).text, own(server_engine, PROMPTS[1]).text
    assert [c.text for c in reply.choices] == [first, first, second, second]  # greedy
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, best_of=2,
                                     max_tokens=2).choices[1].index == 1


def test_seeded_choices_each_have_their_own_seed(client: openai.OpenAI) -> None:
    """Choice j of a seeded request samples with seed + j: n samples, each reproducible."""
    def sampled(seed: int, n: int = 1) -> list[str]:
        reply = client.completions.create(model="tiny", prompt=PROMPTS[0], n=n, seed=seed,
                                          temperature=1.0, max_tokens=TOKENS)
        return [c.text for c in reply.choices]

    pair = sampled(7, n=2)
    assert pair == [*sampled(7), *sampled(8)]
    assert pair == sampled(7, n=2)


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI,
                                                    server_engine: Engine) -> None:
    expected = own(server_engine, PROMPTS[0]).text
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True,
                                      max_tokens=TOKENS)
    assert reply.choices[0].text == PROMPTS[0] + expected
    ids = list(server_engine.tokenizer.encode(PROMPTS[0]))
    as_ids = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=TOKENS)
    assert as_ids.choices[0].text == PROMPTS[0] + expected  # the ids decoded
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True,
                                            max_tokens=TOKENS, stream=True))
    assert chunks[0].choices[0].text == PROMPTS[0]
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + expected


def test_logprobs_in_the_legacy_shape_are_the_engines(client: openai.OpenAI,
                                                       server_engine: Engine) -> None:
    expected = own(server_engine, PROMPTS[0], logprobs=True, top_logprobs=2)
    assert expected.logprobs is not None
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=TOKENS,
                                      logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.text_offset is not None
    assert len(logprobs.tokens) == TOKENS
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs],
                                                    abs=1e-4)
    text = server_engine.tokenizer.decode
    assert logprobs.tokens == [text([t.token_id]) for t in expected.logprobs]
    for token, value, top, lp in zip(logprobs.tokens, logprobs.token_logprobs,
                                     logprobs.top_logprobs, expected.logprobs, strict=True):
        assert top[token] == pytest.approx(value)  # the chosen token is always listed
        assert 2 <= len(top) <= 3  # the two likeliest, and the chosen one if not among them
        assert max(top.values()) == pytest.approx(lp.top[0][1], abs=1e-4)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    # Streamed: each chunk carries its own tokens, the offsets running on.
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model="tiny", prompt=PROMPTS[0],
                                           max_tokens=TOKENS, logprobs=2, stream=True):
        part = chunk.choices[0].logprobs
        if part is not None:
            for key, values in streamed.items():
                values += getattr(part, key)
    assert streamed["tokens"] == logprobs.tokens
    assert streamed["text_offset"] == logprobs.text_offset
    assert streamed["token_logprobs"] == pytest.approx(logprobs.token_logprobs)
    zero = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2,
                                     logprobs=0).choices[0].logprobs
    assert zero is not None and zero.top_logprobs is not None and zero.tokens is not None
    assert [list(top) for top in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_a_stop_string_ends_the_choice(client: openai.OpenAI, server_engine: Engine) -> None:
    text = own(server_engine, PROMPTS[1], max_tokens=16).text
    stop = text[4:7]
    assert len(stop) == 3 and not stop.isspace(), text
    reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16,
                                      stop=[stop])
    assert reply.choices[0].text == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_openai_parameters_this_server_lacks_are_ignored(client: openai.OpenAI,
                                                         server_engine: Engine) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=TOKENS,
                                      user="someone", frequency_penalty=0.5,
                                      presence_penalty=0.5, logit_bias={"1": -100})
    assert reply.choices[0].text == own(server_engine, PROMPTS[0]).text


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"echo": True, "logprobs": 1}, "echo", "prompt tokens' logprobs"),
    ({"best_of": 3}, "best_of", "ranks none"),
    ({"suffix": "return x"}, "suffix", "no fill-in-the-middle tokens"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "give a prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]", "empty"),
    ({"prompt": [[1, 2], []]}, "prompt[1]", "empty"),
    ({"prompt": [1, "a"]}, "prompt[0]", "valid string"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": [2**40]}, "prompt", "out of range"),
    ({"prompt": [999_999]}, None, "out of range"),
    ({"model": "nope"}, "model", "does not exist"),
])
def test_what_cannot_be_served_is_a_400_naming_it(client: openai.OpenAI,
                                                  fields: dict[str, Any], param: str | None,
                                                  says: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**body)
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400)
    assert says in error.message
    if param is not None:
        assert getattr(error, "param", None) == param


def test_more_choices_than_the_model_admits_are_refused(serve: Serve) -> None:
    server, eng = serve(ServerSettings(max_queue=0))  # admits max_batch (8) rows
    sdk = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="more than this model runs"):
        sdk.completions.create(model="tiny", prompt=PROMPTS, n=3, max_tokens=2)
    assert eng.stats().completed == 0
    reply = sdk.completions.create(model="tiny", prompt=PROMPTS[:2], n=4, max_tokens=2)
    assert len(reply.choices) == 8


LONG = 1500  # tokens: with every step slowed, a row that is not cancelled runs for seconds
STEP = 0.02


def test_a_dropped_stream_evicts_every_row(serve: Serve,
                                           slow_steps: Callable[[float], None]) -> None:
    slow_steps(STEP)
    server, eng = serve()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": PROMPTS, "max_tokens": LONG, "stream": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        assert eng.stats().running == len(PROMPTS)
    wait_until(lambda: eng.stats().cancelled == len(PROMPTS), timeout=10)
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=10)
    assert eng.stats().completed == 0


def test_a_client_that_leaves_a_whole_request_evicts_every_row(
        serve: Serve, slow_steps: Callable[[float], None]) -> None:
    slow_steps(STEP)
    server, eng = serve()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.6, json={
            "model": "tiny", "prompt": PROMPTS, "n": 2, "max_tokens": LONG})
    wait_until(lambda: eng.stats().cancelled == 2 * len(PROMPTS), timeout=10)
    wait_until(lambda: eng.stats().running == 0 and eng.stats().pending == 0, timeout=10)
    assert eng.stats().completed == 0
