"""A llama-shaped layer's decode step as two kernel ops (``decode_layer``): the same logits,
bit for bit, as the layer op by op on the same kernels, one row or several with padding;
taken only where every part is the kernels' own, and left where a part or the cache is not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache

from engine.device.kernels import cpu_kernels, decode_layer, kernel_layers

pytestmark = pytest.mark.skipif(
    not cpu_kernels.kernels_available(),
    reason=f"CPU kernels unavailable here: {cpu_kernels.kernel_status().reason}")

COMMON = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=192,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
              rope_theta=10000.0)


def _llama() -> nn.Module:
    return llama.Model(llama.ModelArgs(model_type="llama", **COMMON))  # type: ignore[arg-type]


def _llama3_rope() -> nn.Module:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return llama.Model(llama.ModelArgs(model_type="llama", rope_scaling=scaling,  # type: ignore[arg-type]
                                       max_position_embeddings=512, **COMMON))


def _qwen2() -> nn.Module:  # q/k/v add a bias
    return qwen2.Model(qwen2.ModelArgs(model_type="qwen2", tie_word_embeddings=True,  # type: ignore[arg-type]
                                       **COMMON))


def _qwen3() -> nn.Module:  # q and k take a norm per head
    return qwen3.Model(qwen3.ModelArgs(model_type="qwen3", head_dim=32,  # type: ignore[arg-type]
                                       tie_word_embeddings=True, max_position_embeddings=512,
                                       **COMMON))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": _llama, "llama3-rope": _llama3_rope, "qwen2": _qwen2, "qwen3": _qwen3}


def _installed(build: Callable[[], nn.Module], seed: int = 5) -> nn.Module:
    mx.random.seed(seed)
    model = build()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    for _, m in model.named_modules():  # biases a real checkpoint has: non-zero
        if "bias" in m and isinstance(m, nn.QuantizedLinear):
            m["bias"] = mx.random.normal(m["bias"].shape) * 0.5
    kernel_layers.install(model)
    assert decode_layer.install(model) == 2
    return model


@pytest.fixture
def switch() -> Iterator[Callable[[bool], None]]:
    def set_to(on: bool) -> None:
        decode_layer.SWITCH = on

    yield set_to
    decode_layer.SWITCH = True


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"decode_rest": 0}
    real = cpu_kernels.decode_rest

    def counting(*args: Any, **kwargs: Any) -> mx.array:
        calls["decode_rest"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "decode_rest", counting)
    return calls


def _decode(model: nn.Module, paddings: list[int], steps: int) -> list[mx.array]:
    """The logits of ``steps`` greedy decode steps after a padded prompt a row."""
    cache = [BatchKVCache(paddings) for _ in model.layers]
    rows = [[0] * p + [(3 * i + j) % 60 + 1 for j in range(9 - p)]
            for i, p in enumerate(paddings)]
    logits = model(mx.array(rows), cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    out = []
    for _ in range(steps):
        logits = model(token, cache=cache)
        mx.eval(logits)
        out.append(logits)
        token = mx.argmax(logits[:, -1:], axis=-1)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("paddings", [[0], [0, 3, 6]])
def test_the_two_ops_give_the_layer_by_op_logits_bit_for_bit(
        family: str, paddings: list[int], switch: Callable[[bool], None],
        counted: dict[str, int]) -> None:
    model = _installed(FAMILIES[family])
    switch(False)
    by_op = _decode(model, paddings, 5)
    assert counted["decode_rest"] == 0
    switch(True)
    fused = _decode(model, paddings, 5)
    assert counted["decode_rest"] == 5 * 2  # every decode step, every layer
    for a, b in zip(by_op, fused):
        assert mx.array_equal(a, b).item()


def test_prefill_and_a_quantized_cache_keep_the_layer_by_op(counted: dict[str, int]) -> None:
    model = _installed(_llama)
    model(mx.array([[1, 2, 3, 4]]), cache=[BatchKVCache([0]) for _ in model.layers])
    assert counted["decode_rest"] == 0  # four queries: op by op
    cache = [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    model(mx.array([[1, 2, 3]]), cache=cache)
    mx.eval(model(mx.array([[4]]), cache=cache))
    assert counted["decode_rest"] == 0  # a cache with bits: mlx-lm's path


def test_a_part_swapped_after_install_sends_the_layer_back_to_its_own_forward(
        switch: Callable[[bool], None], counted: dict[str, int]) -> None:
    """A row adapter or a float16 KV projection replaces a part: that layer runs op by op
    (the same logits as with the switch off), the untouched layer keeps the two ops."""
    model = _installed(_llama)
    first = model.layers[0].self_attn
    plain = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=4)
    plain.update(first.k_proj.parameters())
    first.k_proj = plain  # not the kernels' sibling any more
    switch(False)
    by_op = _decode(model, [0], 3)
    switch(True)
    fused = _decode(model, [0], 3)
    assert counted["decode_rest"] == 3  # the second layer only
    for a, b in zip(by_op, fused):
        assert mx.array_equal(a, b).item()


class _OwnRope(nn.RoPE):  # type: ignore[misc]
    """A RoPE class of a user's own: it may compute anything."""


def test_blocks_whose_parts_the_ops_do_not_compute_are_left_as_they_are() -> None:
    """A bias on o_proj (llama's attention_bias) or a RoPE class of its own: no layer is
    given the two ops."""
    mx.random.seed(2)
    biased = llama.Model(llama.ModelArgs(model_type="llama", attention_bias=True,  # type: ignore[arg-type]
                                         **COMMON))
    own_rope = llama.Model(llama.ModelArgs(model_type="llama", **COMMON))  # type: ignore[arg-type]
    for block in own_rope.layers:
        block.self_attn.rope = _OwnRope(32, base=10000.0)
    for model in (biased, own_rope):
        nn.quantize(model, group_size=32, bits=4)
        kernel_layers.install(model)
        assert decode_layer.install(model) == 0
