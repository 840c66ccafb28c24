"""A quantized KV cache mlx-lm's BatchGenerator batches (``engine.device.upstream.quantized_kv``).

The ground truth for every batched run is the same prompt decoded alone: a plain greedy
loop over one row's ``RowQuantizedKVCache`` (mlx-lm's ``QuantizedKVCache`` semantics), no
batch, no padding. Quantization is per token along the head dim, so a row's stored
tokens are the same bits in a batch as alone; a batch that mis-pads, mis-rolls or
mis-masks a row changes its attention and, within a few greedy steps, its tokens.

Two models: the tiny test model (32-wide heads, so group size 32) and a random one with
64-wide heads built in memory, for mlx-lm's default group size 64 and the byte bounds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import qwen2
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.device.upstream.quantized_kv import (
    BatchQuantizedKVCache,
    RowQuantizedKVCache,
    quantized_prompt_cache,
)

TOKENS = 12
LENGTHS = (1, 4, 9, 17, 30)  # a one-token prompt joins with an empty cache


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Any:
    """The tiny test model (heads 32 wide)."""
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    return model


@pytest.fixture(scope="module")
def wide() -> Any:
    """A random qwen2 with 64-wide heads, for group size 64 (mlx-lm's default)."""
    mx.random.seed(7)
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=512,
                           rope_theta=10000.0, tie_word_embeddings=True)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


# (model fixture, group size): group size must divide the head width.
MODELS = [("tiny", 32), ("wide", 64)]


def _prompts(model: Any, lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.args.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(logits: mx.array) -> list[int]:
    tokens: list[int] = mx.argmax(logits[:, -1, :], axis=-1).tolist()  # type: ignore[assignment]
    return tokens


def _decode_cache(model: Any, cache: list[Any], last: int, n: int) -> list[int]:
    """``n`` greedy tokens from one row's cache, feeding ``last`` first."""
    out: list[int] = []
    token = last
    for _ in range(n):
        token = _greedy(model(mx.array([[token]]), cache=cache))[0]
        out.append(token)
    return out


def _alone(model: Any, prompt: list[int], bits: int, group: int, n: int = TOKENS) -> list[int]:
    """The prompt decoded on its own: its row cache prefilled with all but the last token
    (as the generator splits it), then greedy one token at a time."""
    cache = quantized_prompt_cache(model, bits, group)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=cache)
    return _decode_cache(model, cache, prompt[-1], n)


def _generator(model: Any, rows: int) -> BatchGenerator:
    # Every row prefills in one batch: prompts of different lengths are right padded, and
    # the cache's finalize rolls the padding to the left.
    return BatchGenerator(model, max_tokens=TOKENS, prefill_batch_size=rows,
                          completion_batch_size=rows)


def _drive(generator: BatchGenerator, out: dict[int, list[int]],
           done: Callable[[], bool]) -> None:
    for _ in range(200):
        if done():
            return
        for response in generator.next_generated():
            out.setdefault(response.uid, []).append(response.token)
    raise AssertionError("the generator did not finish")


def _steps(generator: BatchGenerator, out: dict[int, list[int]], n: int) -> None:
    for _ in range(n):
        for response in generator.next_generated():
            out.setdefault(response.uid, []).append(response.token)


def _batched(model: Any, prompts: list[list[int]], bits: int, group: int
             ) -> tuple[list[list[int]], list[Any]]:
    """Each prompt's tokens through one BatchGenerator, rows on quantized caches; and the
    kinds of the decoding batch's cache layers, seen mid-run."""
    generator = _generator(model, len(prompts))
    uids = generator.insert(prompts, caches=[quantized_prompt_cache(model, bits, group)
                                             for _ in prompts])
    out: dict[int, list[int]] = {}
    _steps(generator, out, 3)
    kinds = [type(layer) for layer in generator._generation_batch.prompt_cache]
    _drive(generator, out, lambda: all(len(out.get(u, [])) >= TOKENS for u in uids))
    return [out[uid][:TOKENS] for uid in uids], kinds


# (1) The heart: batched == alone.

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("which", "group"), MODELS)
def test_batched_rows_decode_as_each_prompt_alone(bits: int, which: str, group: int,
                                                  request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which)
    prompts = _prompts(model, LENGTHS, seed=bits)
    batched, kinds = _batched(model, prompts, bits, group)
    assert kinds == [BatchQuantizedKVCache] * len(model.layers)  # no silent float path
    assert batched == [_alone(model, p, bits, group) for p in prompts]


def test_scales_stored_as_mlx_lm_stores_them_batch_as_alone(tiny: Any) -> None:
    """``scales_dtype=mx.float32`` is mlx-lm's own layout; its cache survives the deep
    copy the generator makes when a prefill batch splits (a ``Dtype`` does not copy)."""
    prompts = _prompts(tiny, LENGTHS, seed=3)
    generator = _generator(tiny, len(prompts))
    uids = generator.insert(prompts, caches=[quantized_prompt_cache(tiny, 8, 32, mx.float32)
                                             for _ in prompts])
    out: dict[int, list[int]] = {}
    _drive(generator, out, lambda: all(len(out.get(u, [])) >= TOKENS for u in uids))
    alone = []
    for prompt in prompts:
        cache = quantized_prompt_cache(tiny, 8, 32, mx.float32)
        if len(prompt) > 1:
            tiny(mx.array([prompt[:-1]]), cache=cache)
            assert cache[0].keys[1].dtype == mx.float32
        alone.append(_decode_cache(tiny, cache, prompt[-1], TOKENS))
    assert [out[uid][:TOKENS] for uid in uids] == alone


# (2) filter, extend, extract + merge, trim: the other rows' tokens unchanged.

@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_removed_mid_decode_leaves_the_others(tiny: Any, bits: int) -> None:
    prompts = _prompts(tiny, (6, 25, 11), seed=11)
    generator = _generator(tiny, len(prompts))
    uids = generator.insert(prompts, caches=[quantized_prompt_cache(tiny, bits, 32)
                                             for _ in prompts])
    out: dict[int, list[int]] = {}
    _steps(generator, out, 5)
    # The longest prompt is the only row without left padding: filtering it out makes
    # every remaining row share padding, which the filter then cuts off.
    generator.remove([uids[1]])
    kept = [uids[0], uids[2]]
    _drive(generator, out, lambda: all(len(out.get(u, [])) >= TOKENS for u in kept))
    for uid, prompt in zip(uids, prompts, strict=True):
        if uid in kept:
            assert out[uid][:TOKENS] == _alone(tiny, prompt, bits, 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_joining_later_leave_the_others(tiny: Any, bits: int) -> None:
    first = _prompts(tiny, (7, 3), seed=21)
    later = _prompts(tiny, (40, 2), seed=22)  # one longer than the batch so far, one shorter
    generator = _generator(tiny, 4)
    caches = [quantized_prompt_cache(tiny, bits, 32) for _ in range(4)]
    uids = generator.insert(first, caches=caches[:2])
    out: dict[int, list[int]] = {}
    _steps(generator, out, 4)
    uids += generator.insert(later, caches=caches[2:])
    _drive(generator, out, lambda: all(len(out.get(u, [])) >= TOKENS for u in uids))
    for uid, prompt in zip(uids, first + later, strict=True):
        assert out[uid][:TOKENS] == _alone(tiny, prompt, bits, 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_extracted_and_merged_back_resumes_its_tokens(tiny: Any, bits: int) -> None:
    prompts = _prompts(tiny, (5, 14, 9), seed=31)
    generator = _generator(tiny, len(prompts))
    uids = generator.insert(prompts, caches=[quantized_prompt_cache(tiny, bits, 32)
                                             for _ in prompts])
    out: dict[int, list[int]] = {}
    _steps(generator, out, 5)
    taken = uids[0]  # the shortest: its extract must cut its left padding off
    so_far = list(out[taken])
    cache, history = generator.remove([taken], return_prompt_caches=True)[taken]
    assert all(isinstance(layer, RowQuantizedKVCache) for layer in cache)
    # The extracted row holds its prompt and every token reported so far, padding cut off.
    assert history == prompts[0] + so_far
    assert [layer.size() for layer in cache] == [len(history)] * len(cache)
    # Back in: the last reported token is rewound and fed again (mlx-lm feeds a one-token
    # prompt); the row merges with its history into the running batch.
    assert all(layer.trim(1) == 1 for layer in cache)
    (back,) = generator.insert([[so_far[-1]]], max_tokens=[TOKENS - len(so_far)],
                               caches=[cache])
    rest = uids[1:]
    _drive(generator, out, lambda: (len(out.get(back, [])) >= TOKENS - len(so_far)
                                    and all(len(out[u]) >= TOKENS for u in rest)))
    assert so_far + out[back] == _alone(tiny, prompts[0], bits, 32)
    for uid in rest:
        assert out[uid][:TOKENS] == _alone(tiny, prompts[uids.index(uid)], bits, 32)


def _batch_of_rows(model: Any, prompts: list[list[int]], bits: int, group: int
                   ) -> tuple[list[Any], list[int]]:
    """Each prompt prefilled alone into its row cache, then the rows merged: a batch cache
    per layer (rows of different lengths, left padded), and the rows' last tokens."""
    rows = []
    for prompt in prompts:
        cache = quantized_prompt_cache(model, bits, group)
        model(mx.array([prompt[:-1]]), cache=cache)
        rows.append(cache)
    batch = [RowQuantizedKVCache.merge([row[i] for row in rows])
             for i in range(len(model.layers))]
    return batch, [p[-1] for p in prompts]


def _decode_batch(model: Any, batch: list[Any], inputs: list[int], n: int) -> list[list[int]]:
    """``n`` greedy steps of the batch; each step's tokens, by row."""
    steps = []
    for _ in range(n):
        inputs = _greedy(model(mx.array(inputs)[:, None], cache=batch))
        steps.append(inputs)
    return [list(row) for row in zip(*steps, strict=True)]


@pytest.mark.parametrize("bits", [8, 4])
def test_trimmed_batch_redecodes_the_same_tokens(tiny: Any, bits: int) -> None:
    prompts = _prompts(tiny, (3, 12, 8), seed=41)
    batch, last = _batch_of_rows(tiny, prompts, bits, 32)
    first = _decode_batch(tiny, batch, last, TOKENS)
    assert first == [_alone(tiny, p, bits, 32) for p in prompts]  # merge with history
    rewind = 5
    assert all(layer.trim(rewind) == rewind for layer in batch)
    # The cache now ends at token TOKENS - rewind; the token after it is fed again.
    again = _decode_batch(tiny, batch, [row[-rewind - 1] for row in first], rewind)
    assert again == [row[-rewind:] for row in first]


@pytest.mark.parametrize("bits", [8, 4])
def test_extract_then_merge_round_trips_the_batch(tiny: Any, bits: int) -> None:
    prompts = _prompts(tiny, (3, 12, 8), seed=51)
    batch, last = _batch_of_rows(tiny, prompts, bits, 32)
    _decode_batch(tiny, batch, last, 3)
    for layer in batch:
        rows = [layer.extract(i) for i in range(len(prompts))]
        assert [row.size() for row in rows] == [len(p) - 1 + 3 for p in prompts]
        again = BatchQuantizedKVCache.merge(rows)
        assert again.size() == layer.size()
        assert again.left_padding.tolist() == layer.left_padding.tolist()
        assert again.offset.tolist() == layer.offset.tolist()
        pad = layer.left_padding.tolist()
        for old, new in zip(layer.keys_and_values(), again.keys_and_values(), strict=True):
            for a, b in zip(old, new, strict=True):
                for i, p in enumerate(pad):  # the padding's contents are never read
                    assert mx.array_equal(a[i, :, p:], b[i, :, p:]).item()


# (3) Bytes per token against float32.

def _cache_bytes(model: Any, prompts: list[list[int]], caches: list[list[Any]]) -> int:
    generator = _generator(model, len(prompts))
    generator.insert(prompts, caches=caches)
    _steps(generator, {}, 4)
    return int(generator.prompt_cache_nbytes)


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.27), (4, 0.15)])
@pytest.mark.parametrize(("which", "group"), MODELS)
def test_stored_bytes_per_token_against_float32(bits: int, bound: float, which: str,
                                                group: int,
                                                request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which)
    prompts = _prompts(model, (5, 20, 9), seed=61)
    plain = _cache_bytes(model, prompts, [make_prompt_cache(model) for _ in prompts])
    packed = _cache_bytes(model, prompts, [quantized_prompt_cache(model, bits, group)
                                           for _ in prompts])
    ratio = packed / plain
    # Per head-dim element: ``bits`` of value, plus a float16 scale and bias per group,
    # against 32 bits. Both batches hold the same tokens in buffers of the same steps.
    assert ratio == (bits + 32 / group) / 32
    if group >= 64:  # 32-wide heads take group 32 at most: twice the overhead
        assert ratio <= bound


# (4) A float cache resumed from elsewhere.

@pytest.mark.parametrize("bits", [8, 4])
def test_a_float_cache_converted_equals_one_quantized_from_the_start(bits: int) -> None:
    mx.random.seed(bits)
    float_cache, quantized = KVCache(), RowQuantizedKVCache(group_size=32, bits=bits)
    for chunk in (100, 200, 1, 7):  # crosses the 256-token buffer step
        keys, values = mx.random.normal((1, 2, chunk, 64)), mx.random.normal((1, 2, chunk, 64))
        float_cache.update_and_fetch(keys, values)
        quantized.update_and_fetch(keys, values)
    converted = RowQuantizedKVCache.from_float(float_cache, bits=bits, group_size=32)
    assert converted.size() == quantized.size() == 308
    for old, new in zip(quantized.keys_and_values(), converted.keys_and_values(),
                        strict=True):
        for a, b in zip(old, new, strict=True):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_converted_float_row_joins_a_quantized_batch(tiny: Any, bits: int) -> None:
    prompts = _prompts(tiny, (10, 4, 16), seed=71)
    # The middle row was prefilled elsewhere with a float cache.
    resumed = make_prompt_cache(tiny)
    tiny(mx.array([prompts[1][:-1]]), cache=resumed)

    def converted() -> list[Any]:
        return [RowQuantizedKVCache.from_float(layer, bits, 32) for layer in resumed]

    alone = _decode_cache(tiny, converted(), prompts[1][-1], TOKENS)
    generator = _generator(tiny, len(prompts))
    uids = generator.insert(
        [prompts[0], prompts[1][-1:], prompts[2]],
        caches=[quantized_prompt_cache(tiny, bits, 32), converted(),
                quantized_prompt_cache(tiny, bits, 32)])
    out: dict[int, list[int]] = {}
    _drive(generator, out, lambda: all(len(out.get(u, [])) >= TOKENS for u in uids))
    assert out[uids[1]][:TOKENS] == alone
    assert out[uids[0]][:TOKENS] == _alone(tiny, prompts[0], bits, 32)
    assert out[uids[2]][:TOKENS] == _alone(tiny, prompts[2], bits, 32)
    # A float layer handed straight to the merge is quantized on the way in, the same.
    quantized_row = quantized_prompt_cache(tiny, bits, 32)[0]
    direct = RowQuantizedKVCache.merge([quantized_row, resumed[0]])
    via = RowQuantizedKVCache.merge([quantized_row, converted()[0]])
    for old, new in zip(direct.keys_and_values(), via.keys_and_values(), strict=True):
        for a, b in zip(old, new, strict=True):
            assert mx.array_equal(a, b).item()
